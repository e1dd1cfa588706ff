"""The sampling limits of a run's episodes, in one object every part shares.

This module imports only the standard library and the config sections (pydantic).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sandpiper.config.sections import CollectorConfig, InferenceConfig, ToolFormat

_COLLECTOR, _INFERENCE = CollectorConfig(), InferenceConfig()
"""The config's defaults: the one source of :class:`SamplingLimits`' defaults."""


@dataclass(frozen=True, slots=True)
class SamplingLimits:
    """How every episode of a run is sampled and bounded, in one object.

    Built once from the config (:meth:`from_config`, which
    :attr:`sandpiper.config.CollectorSettings.sampling` calls) and handed unchanged to the
    episode loop (``collector.episode.loop.run_episode``), the policy sessions
    (``collector.episode.policy``, ``collector.episode.chat_policy``), the gateway
    (``collector.gateway.server.GatewaySettings``) and the stored record
    (``store.records.GroupSampling.from_limits``, which keeps its own JSON form). No part
    copies these fields into a class of its own.

    It lives here, in the config leaf, because the collector, the gateway and the store all
    take it and each of them may import this module (``.importlinter``), while the config
    may import none of them. Its defaults are the config's own (``SamplingLimits()`` is the
    default config's limits: tests build it with a few fields changed); a run builds it from
    its config, never from these defaults."""

    max_turns: int = _COLLECTOR.max_turns
    """``collector.max_turns``: model replies per episode."""
    max_tokens_per_turn: int = _COLLECTOR.max_tokens_per_turn
    """``collector.max_tokens_per_turn``: sampled tokens per model reply."""
    max_episode_tokens: int = _COLLECTOR.max_episode_tokens
    """``collector.max_episode_tokens``: sampled (completion) tokens over all turns."""
    context_limit: int = _INFERENCE.max_model_len
    """``inference.max_model_len``: tokens in the context (prompt + every segment)."""
    temperature: float = _COLLECTOR.temperature
    top_p: float = _COLLECTOR.top_p
    tool_format: ToolFormat = _COLLECTOR.tool_parser
    """``collector.tool_parser``: how actions are written and parsed."""
    max_argument_bytes: int = _COLLECTOR.max_argument_bytes
    """``collector.max_argument_bytes``: a tool call whose arguments are larger (UTF-8 bytes
    of their JSON) is refused, checked once, where the call is parsed
    (``collector.episode.parsers.check_call_size``)."""
    system_prompt: str | None = _COLLECTOR.system_prompt
    """``collector.system_prompt``; None = the episode loop's default prompt."""
    gateway_sampling: Literal["run", "client"] = _COLLECTOR.gateway_sampling
    """``collector.gateway_sampling``: whether the gateway refuses (``run``) or honours
    (``client``) a request's own temperature, top_p and seed."""

    @classmethod
    def from_config(cls, collector: CollectorConfig, inference: InferenceConfig) -> SamplingLimits:
        """The limits of a run's ``collector`` and ``inference`` sections."""
        return cls(
            max_turns=collector.max_turns,
            max_tokens_per_turn=collector.max_tokens_per_turn,
            max_episode_tokens=collector.max_episode_tokens,
            context_limit=inference.max_model_len,
            temperature=collector.temperature,
            top_p=collector.top_p,
            tool_format=collector.tool_parser,
            max_argument_bytes=collector.max_argument_bytes,
            system_prompt=collector.system_prompt,
            gateway_sampling=collector.gateway_sampling,
        )
