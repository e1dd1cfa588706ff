"""Token-in / token-out :class:`PolicyClient` over one or more vLLM servers.

Generation uses vLLM's ``POST /inference/v1/generate`` (servers started with
``--enable-scale-out``): token ids in, sampled token ids out, with the logprob of each
sampled token (``logprobs: 0``) and ``weight_versions`` spans saying which weight version
produced which output tokens. Whether those logprobs are raw (before temperature / top-p,
vLLM's default) or processed is the *server's* ``--logprobs-mode``; Sandpiper runs servers
with ``InferenceConfig.logprobs_mode`` (default ``raw_logprobs``) and the learner computes
the same kind.

Routing: each request goes to the server with the fewest outstanding requests (ties go to
the server that was picked least recently); a server that just failed gets no new requests
for ``down_cooldown_s`` unless no other server is left.

Retries: a request that times out, cannot connect or gets a 5xx is retried (waits doubling
from ``retry_wait_s``) on another server when there is one. The caller receives exactly one
:class:`Generation` per call: a failed attempt returns nothing, and an attempt abandoned by a
timeout is cancelled on the server (vLLM aborts a request whose client disconnects), so no
sample is ever produced twice. 4xx answers are not retried (the request itself is wrong);
a prompt longer than the context raises :class:`ContextLengthExceeded`.

Weight reload (:meth:`VLLMPolicyClient.reload`): on every server,
``/pause?mode=keep&clear_cache=true`` (in-flight requests are frozen, not aborted; the KV and
prefix caches are dropped), ``/collective_rpc reload_weights`` from the checkpoint folder,
``/update_weight_version``, ``/resume``. In-flight requests continue on the new weights (their
prefix is recomputed) and their later tokens carry the new version.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx
import numpy as np
import orjson

from sandpiper.collector.inference.base import Generation, SamplingParams
from sandpiper.config import InferenceConfig
from sandpiper.errors import InferenceError

log = logging.getLogger(__name__)

GENERATE_PATH = "/inference/v1/generate"
RETRY_WAIT_MAX_S = 10.0
"""The longest wait between two attempts of one request (waits double from ``retry_wait_s``)."""
_JSON_HEADERS = {"content-type": "application/json"}
_CONTEXT_ERROR_MARKERS = ("maximum model length", "maximum context length", "max_model_len")
"""Phrases of vLLM's 400 answer when a prompt does not fit (vLLM 0.32 says the first)."""


class ContextLengthExceeded(InferenceError):
    """The prompt plus ``max_tokens`` does not fit the server's ``--max-model-len``."""


class _Retryable(InferenceError):
    """An attempt failed in a way another attempt may not (5xx, timeout, connection)."""


class VLLMPolicyClient:
    """:class:`~sandpiper.collector.inference.base.PolicyClient` over vLLM servers (async context manager)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        request_timeout_s: float = 120.0,
        max_retries: int = 3,
        initial_version: int = 0,
        retry_wait_s: float = 0.5,
        down_cooldown_s: float = 5.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not urls:
            raise InferenceError("VLLMPolicyClient needs at least one server URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.retry_wait_s = retry_wait_s
        self._version = initial_version
        self.outstanding = dict.fromkeys(self.urls, 0)
        """Requests in flight per server (what routing balances)."""
        self._last_pick = dict.fromkeys(self.urls, -1)
        self.down_cooldown_s = down_cooldown_s
        self._down_until = dict.fromkeys(self.urls, 0.0)
        """monotonic time until which a server that just failed gets no new requests"""
        self._picks = itertools.count()
        self._reload_lock = asyncio.Lock()
        # one pooled client for all servers; per-request timeouts come from request_timeout_s
        self._http = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            transport=transport,
        )

    @classmethod
    def from_config(
        cls, config: InferenceConfig, urls: Sequence[str], **kwargs
    ) -> VLLMPolicyClient:
        """A client with ``config``'s timeout and retry settings."""
        kwargs.setdefault("request_timeout_s", config.request_timeout_s)
        kwargs.setdefault("max_retries", config.max_retries)
        return cls(urls, **kwargs)

    @property
    def policy_version(self) -> int:
        """Version the servers serve now (the last successful :meth:`reload`)."""
        return self._version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Sample one continuation of ``prompt_ids``; exactly one Generation per call."""
        if not prompt_ids:
            raise InferenceError("empty prompt")
        body = generate_body(prompt_ids, params)
        request_id = uuid.uuid4().hex
        tried: list[str] = []
        # A plain loop rather than tenacity's, and orjson rather than httpx's json: the two
        # took ~80 µs of CPU per call, retried or not (~200 -> ~120 µs, bench/client_bench.py's
        # client_cpu_us_per_call).
        for attempt in itertools.count(1):
            url = self._pick(avoid=tried)
            tried.append(url)
            # a fresh id per attempt: the abandoned attempt may still be aborting
            body["request_id"] = f"{request_id}-{attempt}"
            version_at_send = self._version
            try:
                payload = await self._post_generate(url, body)
            except _Retryable:
                if attempt > self.max_retries:
                    raise
                await asyncio.sleep(min(self.retry_wait_s * 2 ** (attempt - 1), RETRY_WAIT_MAX_S))
                continue
            return _to_generation(payload, url, version_at_send, params.top_logprobs)
        raise AssertionError("unreachable")

    def _pick(self, avoid: Sequence[str] = ()) -> str:
        """Least outstanding requests first, among servers that are not cooling down after a
        failure and not yet tried for this request (relaxed in that order when none is left)."""
        now = time.monotonic()
        fresh = [u for u in self.urls if u not in avoid]
        candidates = [u for u in fresh if self._down_until[u] <= now] or fresh or self.urls
        url = min(candidates, key=lambda u: (self.outstanding[u], self._last_pick[u]))
        self._last_pick[url] = next(self._picks)
        return url

    async def _post_generate(self, url: str, body: dict) -> dict:
        self.outstanding[url] += 1
        try:
            response = await self._http.post(
                url + GENERATE_PATH, content=orjson.dumps(body), headers=_JSON_HEADERS
            )
        except httpx.TimeoutException as e:
            self._mark_down(url)
            raise _Retryable(f"{url}: request timed out after {self.request_timeout_s} s") from e
        except httpx.TransportError as e:
            self._mark_down(url)
            raise _Retryable(f"{url}: {type(e).__name__}: {e}") from e
        finally:
            self.outstanding[url] -= 1
        if response.status_code >= 500:
            self._mark_down(url)
            raise _Retryable(f"{url}: HTTP {response.status_code}: {response.text[:300]}")
        if response.status_code != 200:
            text = response.text[:500]
            if any(m in text for m in _CONTEXT_ERROR_MARKERS):
                raise ContextLengthExceeded(f"{url}: {text}")
            raise InferenceError(f"{url}: HTTP {response.status_code}: {text}")
        return orjson.loads(response.content)

    def _mark_down(self, url: str) -> None:
        self._down_until[url] = time.monotonic() + self.down_cooldown_s
        log.warning("%s failed; no new requests for %.0f s", url, self.down_cooldown_s)

    async def reload(self, checkpoint_dir: str | Path, version: int) -> None:
        """Load ``checkpoint_dir`` in place on every server and label new tokens ``version``."""
        async with self._reload_lock:
            await asyncio.gather(
                *(self._reload_one(url, str(checkpoint_dir), version) for url in self.urls)
            )
            self._version = version

    async def _reload_one(self, url: str, checkpoint_dir: str, version: int) -> None:
        # keep: in-flight requests are frozen, not aborted. clear_cache: vLLM 0.32 then
        # preempts them and drops the prefix cache, so after /resume every token (in-flight or
        # new) is computed from a KV cache rebuilt with the new weights, never a stale one.
        await self._control(url, "/pause", params={"mode": "keep", "clear_cache": "true"})
        try:
            await self._control(
                url,
                "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": checkpoint_dir}},
            )
            await self._control(url, "/update_weight_version", json={"new_version": str(version)})
        finally:
            # always resume: a server left paused would hang every later request
            await self._control(url, "/resume")
        log.info("%s now serves version %d from %s", url, version, checkpoint_dir)

    async def set_version(self, version: int) -> None:
        """Label the weights the servers hold now as ``version`` (no reload)."""
        await asyncio.gather(
            *(
                self._control(url, "/update_weight_version", json={"new_version": str(version)})
                for url in self.urls
            )
        )
        self._version = version

    async def _control(self, url: str, path: str, **kwargs) -> dict:
        try:
            response = await self._http.post(url + path, **kwargs)
        except httpx.HTTPError as e:
            raise InferenceError(f"{url}{path}: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise InferenceError(f"{url}{path}: HTTP {response.status_code}: {response.text[:300]}")
        return response.json() if response.content else {}

    async def server_versions(self) -> dict[str, str]:
        """The weight version string each server reports now (``/weight_info``)."""

        async def one(url: str) -> str:
            try:
                response = await self._http.get(url + "/weight_info", timeout=10.0)
                return str(response.json()["weight_version"])
            except (httpx.HTTPError, ValueError, KeyError) as e:
                raise InferenceError(f"{url}/weight_info: {e!r}") from e

        return dict(zip(self.urls, await asyncio.gather(*map(one, self.urls)), strict=True))

    async def healthy(self) -> dict[str, bool]:
        """``/health`` of every server."""

        async def one(url: str) -> bool:
            try:
                return (await self._http.get(url + "/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                return False

        return dict(zip(self.urls, await asyncio.gather(*map(one, self.urls)), strict=True))

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> VLLMPolicyClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


def generate_body(prompt_ids: Sequence[int], params: SamplingParams) -> dict[str, Any]:
    """The ``/inference/v1/generate`` body of one sample of ``prompt_ids`` (no request id)."""
    return {
        "token_ids": list(prompt_ids),
        "sampling_params": {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "stop_token_ids": list(params.stop_token_ids),
            "logprobs": params.top_logprobs,  # 0: the sampled token's own logprob only
            # stop strings are found in the text: vLLM refuses them without detokenizing
            "detokenize": bool(params.stop),
            **({"stop": list(params.stop)} if params.stop else {}),
        },
    }


def _to_generation(payload: dict, url: str, version_at_send: int, top_k: int = 0) -> Generation:
    """Turn a ``/inference/v1/generate`` answer into a Generation (validating its shape);
    ``top_k``: the top logprobs asked for (``SamplingParams.top_logprobs``)."""
    try:
        choice = payload["choices"][0]
        token_ids = choice["token_ids"] or []
        content = (choice.get("logprobs") or {}).get("content") or []
        logprobs = [entry["logprob"] for entry in content]
        spans = choice.get("weight_versions") or []
        top = _top_logprobs(content, top_k) if top_k else None
    except (KeyError, IndexError, TypeError, ValueError) as e:
        raise InferenceError(f"{url}: malformed generate response: {e!r}") from e
    if len(logprobs) != len(token_ids):
        raise InferenceError(
            f"{url}: {len(token_ids)} tokens but {len(logprobs)} logprobs (server too old?)"
        )
    return Generation(
        token_ids_T=np.asarray(token_ids, dtype=np.int32),
        logprobs_T=np.asarray(logprobs, dtype=np.float32),
        policy_versions_T=versions_from_spans(spans, len(token_ids), version_at_send),
        finish_reason=choice.get("finish_reason") or "abort",
        server=url,
        top_logprobs=top,
    )


def _top_logprobs(content: list[dict], k: int) -> tuple[tuple[tuple[int, float], ...], ...]:
    """The ``k`` most likely ``(id, logprob)`` at each position: vLLM lists the sampled token
    first, then the top candidates (the sampled one may be among them, or not)."""
    out = []
    for entry in content:
        seen: dict[int, float] = {}
        for cand in entry.get("top_logprobs") or []:
            seen.setdefault(int(cand["token_id"]), float(cand["logprob"]))
        ranked = sorted(seen.items(), key=lambda kv: -kv[1])[:k]
        out.append(tuple(ranked))
    return tuple(out)


def versions_from_spans(spans: list[dict], n_tokens: int, default_version: int) -> np.ndarray:
    """Per-token int32 versions from vLLM's ``[{"version", "start", "end"}]`` spans.

    Tokens no span covers, and spans whose version is not an integer (vLLM starts at
    ``"default"`` until a version is set), get ``default_version``: the client's version when
    the request was sent.
    """
    versions_T = np.full(n_tokens, default_version, dtype=np.int32)
    for span in spans:
        try:
            version = int(span["version"])
        except (TypeError, ValueError):
            continue
        start, end = max(0, int(span["start"])), min(n_tokens, int(span["end"]))
        versions_T[start:end] = version
    return versions_T
