"""The inference contract the agent loop depends on: token ids in, token ids out.

``collector.inference.vllm_client`` implements it against vLLM servers; unit tests use a
scripted fake. Every sampled token comes back with its sampling logprob and the policy
version of the weights that produced it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class Generation:
    token_ids_T: np.ndarray
    """int32 sampled token ids (the stop token included when the model emitted one)."""
    logprobs_T: np.ndarray
    """float32 sampling logprob of each sampled token (raw or processed: see config)."""
    policy_versions_T: np.ndarray
    """int32 policy version that produced each token (changes mid-sequence on a reload)."""
    finish_reason: str
    """``stop`` (EOS or a stop token), ``length`` (max_tokens) or ``abort``."""
    server: str = ""
    """URL of the server that answered (for debugging)."""
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    """Per sampled token, the most likely ``(token id, logprob)`` pairs at its position, most
    likely first (``SamplingParams.top_logprobs`` of them); None when not asked for."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    """Strings that end the sample (the server detokenizes to find them; the sampled ids
    end with the token that completes one)."""
    top_logprobs: int = 0
    """Also return the k most likely tokens at each sampled position (0: none)."""


class PolicyClient(Protocol):
    """Generates continuations of a token-id prompt with the current policy."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation: ...

    @property
    def policy_version(self) -> int:
        """Version the servers are serving now."""
        ...

    async def reload(self, checkpoint_dir: str, version: int) -> None:
        """Serve the weights in ``checkpoint_dir`` as ``version`` from now on (hot-load)."""
        ...
