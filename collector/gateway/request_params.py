"""What a client asks of one sample, mapped onto the run's sampling: one piece for every API.

Every API the gateway serves (chat completions, completions, and any other wire format) reads
its request's sampling fields into one :class:`RequestParams` (:func:`chat_params` for the
OpenAI chat and completions bodies; another API builds it from its own names, passing
``names`` so that errors name the field the client sent, e.g. ``stop_sequences``). Then:

- :meth:`RequestParams.check` applies the run's **sampling policy**
  (``SamplingLimits.gateway_sampling``, from ``collector.gateway_sampling``) before anything reaches the model. Under ``"run"`` (the
  default, for training) every call samples with the run's ``temperature`` and ``top_p``: a
  request asking for other values, or for a ``seed``, is refused with HTTP 400 saying why (a
  training sample must come from the distribution the learner corrects for; a fixed seed
  makes every episode of a GRPO group sample the same tokens, so the group teaches nothing).
  Values equal to the run's are accepted. Under ``"client"`` (evaluation, serving) the
  request's ``temperature``, ``top_p`` and ``seed`` are honoured.
- :meth:`RequestParams.sampling_params` builds the :class:`SamplingParams` sent to vLLM
  from ``SamplingLimits.reply_request`` (the reply's cap, the same formula native episodes
  use, and the temperature, top_p and seed the policy allows), with ``stop`` strings
  (vLLM stops on them; :func:`cut_at_stop` cuts a reply that ran past one, e.g. from a
  client that ignores them) and ``top_logprobs`` (vLLM returns the k most likely tokens at
  each sampled position).
- :func:`note_ignored` logs once per process each field that is accepted but changes
  nothing (``prompt_cache_key``, ``user``, ``metadata``, unknown ``extra_body`` keys such as
  ``top_k``), and :func:`log_request` logs every request at DEBUG with its episode.

What the gateway cannot honour exactly (``logit_bias``, ``response_format``, ``n > 1``,
...) stays refused by the API module, naming the parameter.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sandpiper.collector.gateway.openai_api import APIError
from sandpiper.collector.inference.base import Generation, SamplingParams
from sandpiper.config import SamplingLimits
from sandpiper.config.sampling import ReplyRequest
from sandpiper.config.sections import MAX_TEMPERATURE

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20
"""OpenAI's limit for ``top_logprobs``, and vLLM's default ``--max-logprobs``."""
MAX_STOP_STRINGS = 16
"""More stop strings than any client sends (OpenAI allows 4); each costs vLLM a text scan."""

HARMLESS = frozenset(
    {
        "prompt_cache_key", "safety_identifier", "metadata", "user", "verbosity", "store",
        "service_tier", "reasoning_effort", "stream_options", "parallel_tool_calls",
    }
)  # fmt: skip
"""Fields that change nothing about the sample (or are honoured elsewhere): accepted."""

_NOTED: set[str] = set()


@dataclass(frozen=True, slots=True)
class RequestParams:
    """The sampling fields of one request, in the gateway's terms (None: not sent)."""

    max_tokens: int | None = None
    """The client's cap on the reply; it can only lower the run's
    (``SamplingLimits.reply_request``, the one per-turn formula)."""
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Strings that end the reply (not included in the text returned)."""
    logprobs: bool = False
    """Return each sampled token's logprob (as vLLM sampled it)."""
    top_logprobs: int = 0
    """Also the k most likely tokens at each position (needs ``logprobs``)."""
    parallel_tool_calls: bool = True
    """False: at most one tool call per reply is returned (the others are recorded as the
    model's format errors)."""
    names: Mapping[str, str] = field(default_factory=dict)
    """The API's name of a field where it differs from the attribute's (for errors)."""

    def name(self, attribute: str) -> str:
        return self.names.get(attribute, attribute)

    def check(self, run: SamplingLimits) -> None:
        """Refuse what the run's sampling policy does not allow (HTTP 400, saying why)."""
        if run.gateway_sampling == "client":
            return
        for attribute, ours in (("temperature", run.temperature), ("top_p", run.top_p)):
            asked = getattr(self, attribute)
            if asked is not None and not math.isclose(asked, ours, abs_tol=1e-9):
                raise _refused(
                    self.name(attribute),
                    f"{self.name(attribute)}={asked:g} differs from this run's {ours:g} "
                    f"(collector.{attribute}): a training sample must come from the "
                    "distribution the learner corrects for. Leave it out, or send the run's "
                    'value (collector.gateway_sampling = "client" honours it, for runs not '
                    "trained on)",
                )
        if self.seed is not None:
            raise _refused(
                self.name("seed"),
                "seed is refused by this run's sampling policy: a fixed seed makes every "
                "episode of a GRPO group sample the same tokens, so the group teaches nothing. "
                'Leave it out (collector.gateway_sampling = "client" honours it)',
            )

    def sampling_params(
        self, reply: ReplyRequest, *, stop_token_ids: Sequence[int]
    ) -> SamplingParams:
        """The vLLM request of this call: ``reply`` (``SamplingLimits.reply_request`` of this
        request's ask: the reply's cap, and the temperature, top_p and seed the run's
        sampling policy allows) with the stop ids and strings and ``top_logprobs``."""
        return SamplingParams(
            max_tokens=reply.max_tokens,
            temperature=reply.temperature,
            top_p=reply.top_p,
            seed=reply.seed,
            stop_token_ids=tuple(stop_token_ids),
            stop=self.stop,
            top_logprobs=self.top_logprobs if self.logprobs else 0,
        )


def chat_params(body: Mapping[str, Any], *, completions: bool = False) -> RequestParams:
    """The sampling fields of an OpenAI chat (or legacy completions) request, checked."""
    max_tokens = _positive_int(body, "max_completion_tokens") or _positive_int(body, "max_tokens")
    if completions:  # legacy: ``logprobs`` is the number of top tokens (0 = sampled only)
        top = body.get("logprobs")
        if top is not None and (not _is_int(top) or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise _invalid("logprobs", f"logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        logprobs, top_logprobs = top is not None, int(top or 0)
    else:
        logprobs = _flag(body, "logprobs", False)
        top_logprobs = _top_logprobs(body.get("top_logprobs"), logprobs)
    return RequestParams(
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, MAX_TEMPERATURE),
        top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
        seed=_seed(body.get("seed")),
        stop=stop_strings(body.get("stop"), "stop"),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        parallel_tool_calls=_flag(body, "parallel_tool_calls", True),
    )


def stop_strings(value: Any, param: str) -> tuple[str, ...]:
    """A request's stop strings (a string or a list of them; None: none)."""
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise _invalid(param, f"{param} must be a non-empty string or a list of them")
    if len(items) > MAX_STOP_STRINGS:
        raise _invalid(param, f"{param}: at most {MAX_STOP_STRINGS} stop strings")
    return tuple(dict.fromkeys(items))


def note_ignored(fields: Iterable[str], *, known: Iterable[str]) -> None:
    """Log once per process each field of ``fields`` that is harmless or not in ``known``
    (accepted, changes nothing: a cache key, a user id, an ``extra_body`` key)."""
    known = set(known)
    for key in fields:
        if key in _NOTED or (key in known and key not in HARMLESS):
            continue
        _NOTED.add(key)
        kind = "a field that changes nothing here" if key in HARMLESS else "an unknown field"
        log.info("gateway: accepting %r (%s; logged once)", key, kind)


def log_request(episode_id: str, route: str, body: Mapping[str, Any]) -> None:
    """One DEBUG line per request, with its episode (the fields, not the conversation)."""
    if log.isEnabledFor(logging.DEBUG):
        shown = {k: v for k, v in body.items() if k not in ("messages", "input", "prompt",
                                                            "tools", "system")}  # fmt: skip
        log.debug("episode %s: POST %s %s", episode_id, route, shown)


def cut_at_stop(
    generation: Generation, stop: Sequence[str], decode: Callable[[Sequence[int]], str]
) -> tuple[Generation, int | None]:
    """``generation`` ending with the token that completes the first stop string, and where
    that string starts in its text (None: no stop string in the text, nothing cut).

    vLLM stops on the strings itself, so this cuts only a reply that ran past one (a policy
    client that does not honour them); the tokens up to the stop string's last one are what
    was sampled and are recorded, the client's text ends before the string."""
    if not stop:
        return generation, None
    ids = [int(t) for t in generation.token_ids_T]
    text = decode(ids)
    hits = [(text.find(s), s) for s in stop if s in text]
    if not hits:
        return generation, None
    start, hit = min(hits)
    lo, hi = 1, len(ids)  # the shortest prefix whose text holds the whole string
    while lo < hi:
        mid = (lo + hi) // 2
        if hit in decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    if lo == len(ids) and generation.finish_reason == "stop":
        return generation, start
    top = generation.top_logprobs
    return (
        dataclasses.replace(
            generation,
            token_ids_T=generation.token_ids_T[:lo],
            logprobs_T=generation.logprobs_T[:lo],
            policy_versions_T=generation.policy_versions_T[:lo],
            finish_reason="stop",
            top_logprobs=None if top is None else top[:lo],
        ),
        start,
    )


def _refused(param: str, why: str) -> APIError:
    return APIError(400, why, param=param, code="unsupported_parameter")


def _invalid(param: str, why: str) -> APIError:
    return APIError(400, why, param=param, code="invalid_value")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(body: Mapping[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise _invalid(key, f"{key} must be a positive integer")
    return int(value)


def _number(
    body: Mapping[str, Any], key: str, low: float, high: float, *, low_open: bool = False
) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise _invalid(key, f"{key} must be a number in {span}")
    return float(value)


def _flag(body: Mapping[str, Any], key: str, default: bool) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _invalid(key, f"{key} must be true or false")
    return value


def _top_logprobs(value: Any, logprobs: bool) -> int:
    if value is None:
        return 0
    if not _is_int(value) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise _invalid(
            "top_logprobs", f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}"
        )
    if value and not logprobs:
        raise _invalid("top_logprobs", "top_logprobs needs logprobs=true")
    return int(value)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or not -(2**63) <= value < 2**64:
        raise _invalid("seed", "seed must be a 64-bit integer")
    return int(value)
