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
class ReplyRequest:
    """How one model reply is sampled: what :meth:`SamplingLimits.reply_request` asks of the
    model (the token policy's ``SamplingParams``, the chat policy's request body, the
    gateway's ``SamplingParams`` all carry exactly these values)."""

    max_tokens: int
    """The reply's token cap (>= 1): the one per-turn formula."""
    temperature: float
    top_p: float
    seed: int | None = None
    """Only a gateway request's own seed, under ``gateway_sampling = "client"``."""


@dataclass(frozen=True, slots=True)
class NoRoom:
    """No reply can be asked for: the context is full or the episode's token budget is
    spent. ``reason`` is the episode's stop reason (``store.records.StopReason``'s value)."""

    reason: Literal["context_exceeded", "max_tokens"]
    limit: int
    """The limit that is spent: ``context_limit`` or the episode's token budget."""


@dataclass(frozen=True, slots=True)
class SamplingLimits:
    """How every episode of a run is sampled and bounded, in one object.

    Built once from the config (:meth:`from_config`, which
    :attr:`sandpiper.config.CollectorSettings.sampling` calls) and handed unchanged to the
    episode loop (``collector.episode.loop.run_episode``), the policy sessions
    (``collector.episode.policy``, ``collector.episode.chat_policy``), the gateway
    (``collector.gateway.server.GatewaySettings``) and the stored record
    (``store.records.GroupSampling.from_limits``, which keeps its own JSON form). No part
    copies these fields into a class of its own, and none turns them into a model request by
    hand: :meth:`reply_request` is the one per-turn cap (and temperature, top_p, seed) of
    the token policy, the chat policy and the gateway.

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

    def reply_request(
        self,
        *,
        prompt_tokens: int | None,
        sampled_tokens: int,
        episode_budget: int | Literal["run"] | None = "run",
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
    ) -> ReplyRequest | NoRoom:
        """The sampling of the next model reply of an episode, or why there is none.

        The one per-turn cap, used by the token policy, the chat policy and the gateway::

            max_tokens = min(max_tokens            (the client's ask, if any),
                             max_tokens_per_turn,
                             episode_budget - sampled_tokens,
                             context_limit - prompt_tokens)

        ``prompt_tokens``: the tokens the reply follows (the whole context so far); None
        where the caller does not render the prompt (the chat policy: the endpoint renders
        it and refuses a prompt too long for its own context, ``ContextLengthExceeded``),
        and the context term is left out. ``sampled_tokens``: the episode's sampled tokens
        so far. ``episode_budget``: its sampled-token budget, ``"run"`` =
        ``max_episode_tokens`` (the gateway passes its episode's, None = no budget).

        When the context has no room (checked first: nothing more fits, whatever the
        budget) or the budget is spent, the answer is :class:`NoRoom`, never a cap below 1.

        ``max_tokens``, ``temperature``, ``top_p``, ``seed``: a gateway client's own ask
        (None: not asked). ``max_tokens`` can only lower the cap; the others are honoured
        only under ``gateway_sampling = "client"`` (under ``"run"`` the gateway refuses
        other values before this, ``RequestParams.check``, and the run's are used)."""
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, not {max_tokens}")
        terms = [self.max_tokens_per_turn, *([] if max_tokens is None else [max_tokens])]
        if prompt_tokens is not None:
            terms.append(self.context_limit - prompt_tokens)
            if terms[-1] < 1:
                return NoRoom("context_exceeded", self.context_limit)
        budget = self.max_episode_tokens if episode_budget == "run" else episode_budget
        if budget is not None:
            terms.append(budget - sampled_tokens)
            if terms[-1] < 1:
                return NoRoom("max_tokens", budget)
        honour = self.gateway_sampling == "client"
        return ReplyRequest(
            max_tokens=min(terms),
            temperature=temperature if honour and temperature is not None else self.temperature,
            top_p=top_p if honour and top_p is not None else self.top_p,
            seed=seed if honour else None,
        )
