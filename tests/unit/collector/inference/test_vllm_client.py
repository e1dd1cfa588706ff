"""VLLMPolicyClient against a fake vLLM (httpx.MockTransport): parsing, routing, retries,
version spans and the reload sequence."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
import numpy as np
import pytest

from sandpiper.collector.inference.base import SamplingParams
from sandpiper.collector.inference.vllm_client import (
    ContextLengthExceeded,
    VLLMPolicyClient,
    versions_from_spans,
)
from sandpiper.errors import InferenceError

pytestmark = pytest.mark.anyio

A, B = "http://a:1", "http://b:2"
PARAMS = SamplingParams(max_tokens=4, temperature=0.7, seed=5, stop_token_ids=(2,))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def generate_answer(token_ids: list[int], spans: list[dict] | None = None, finish="stop") -> dict:
    spans = spans if spans is not None else [{"version": "0", "start": 0, "end": len(token_ids)}]
    content = [{"token_id": t, "logprob": -0.5 * (i + 1)} for i, t in enumerate(token_ids)]
    choice = {
        "index": 0,
        "finish_reason": finish,
        "token_ids": token_ids,
        "weight_versions": spans,
        "logprobs": {"content": content},
    }
    return {"request_id": "x", "choices": [choice]}


def make_client(handler: Callable, urls=(A,), **kwargs) -> VLLMPolicyClient:
    kwargs.setdefault("retry_wait_s", 0.0)
    return VLLMPolicyClient(list(urls), transport=httpx.MockTransport(handler), **kwargs)


async def test_generate_returns_tokens_logprobs_and_versions() -> None:
    seen: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/inference/v1/generate"
        seen.append(json.loads(request.content))
        return httpx.Response(200, json=generate_answer([7, 8, 2]))

    async with make_client(handler) as client:
        gen = await client.generate([1, 2, 3], PARAMS)
    assert gen.token_ids_T.tolist() == [7, 8, 2]
    assert gen.token_ids_T.dtype == np.int32
    np.testing.assert_allclose(gen.logprobs_T, [-0.5, -1.0, -1.5])
    assert gen.logprobs_T.dtype == np.float32
    assert gen.policy_versions_T.tolist() == [0, 0, 0]
    assert gen.finish_reason == "stop"
    assert gen.server == A
    sent = seen[0]
    assert sent["token_ids"] == [1, 2, 3]
    assert sent["sampling_params"]["logprobs"] == 0
    assert sent["sampling_params"]["temperature"] == 0.7
    assert sent["sampling_params"]["stop_token_ids"] == [2]
    assert sent["sampling_params"]["seed"] == 5


async def test_version_spans_split_a_sequence_across_a_reload() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=generate_answer([5, 6, 7, 8, 9], spans, "length"))

    async with make_client(handler, initial_version=3) as client:
        gen = await client.generate([1], PARAMS)
    assert gen.policy_versions_T.tolist() == [3, 3, 4, 4, 4]
    assert gen.finish_reason == "length"


def test_unlabelled_tokens_get_the_version_at_send_time() -> None:
    spans = [{"version": "default", "start": 0, "end": 2}, {"version": "9", "start": 2, "end": 3}]
    assert versions_from_spans(spans, 4, 6).tolist() == [6, 6, 9, 6]
    assert versions_from_spans([], 2, 1).tolist() == [1, 1]


async def test_least_outstanding_routing() -> None:
    release = asyncio.Event()
    hits: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        hits.append(f"http://{request.url.host}:{request.url.port}")
        if len(hits) <= 2:
            await release.wait()  # the first two requests stay outstanding
        return httpx.Response(200, json=generate_answer([4]))

    async with make_client(handler, urls=(A, B)) as client:
        slow = [asyncio.create_task(client.generate([1], PARAMS)) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert client.outstanding == {A: 1, B: 1}
        assert sorted(hits) == [A, B]  # one each, not both on A
        release.set()
        await asyncio.gather(*slow)
        assert client.outstanding == {A: 0, B: 0}
        servers = [(await client.generate([1], PARAMS)).server for _ in range(4)]
    # idle servers alternate (least recently picked first)
    assert servers.count(A) == 2 and servers.count(B) == 2


@pytest.mark.parametrize(
    "failure",
    [
        lambda r: httpx.Response(503, text="overloaded"),
        lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused", request=r)),
        lambda r: (_ for _ in ()).throw(httpx.ReadTimeout("slow", request=r)),
    ],
    ids=["http-503", "connect-error", "timeout"],
)
async def test_failed_attempt_is_retried_elsewhere_and_returns_once(failure) -> None:
    calls: list[tuple[str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        calls.append((request.url.host, body["request_id"]))
        if request.url.host == "a":
            return failure(request)
        return httpx.Response(200, json=generate_answer([11, 12]))

    async with make_client(handler, urls=(A, B), max_retries=3) as client:
        gen = await client.generate([1], PARAMS)
        assert client.outstanding == {A: 0, B: 0}
    assert gen.server == B and gen.token_ids_T.tolist() == [11, 12]
    assert [host for host, _ in calls] == ["a", "b"]
    assert calls[0][1] != calls[1][1]  # each attempt is a distinct server request


async def test_gives_up_after_max_retries() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        raise httpx.ReadTimeout("slow", request=request)

    async with make_client(handler, max_retries=2) as client:
        with pytest.raises(InferenceError, match="timed out"):
            await client.generate([1], PARAMS)
    assert calls == 3


async def test_waits_between_attempts_double_up_to_the_cap(monkeypatch) -> None:
    from sandpiper.collector.inference import vllm_client

    waits: list[float] = []

    async def no_sleep(seconds: float) -> None:
        waits.append(seconds)

    monkeypatch.setattr(vllm_client.asyncio, "sleep", no_sleep)
    bodies: list[bytes] = []

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.headers["content-type"] == "application/json"
        bodies.append(request.content)
        return httpx.Response(503, text="overloaded")

    async with make_client(handler, max_retries=6, retry_wait_s=0.5) as client:
        with pytest.raises(InferenceError, match="503"):
            await client.generate([1, 2], PARAMS)
    assert waits == [0.5, 1.0, 2.0, 4.0, 8.0, vllm_client.RETRY_WAIT_MAX_S]
    assert len(bodies) == 7 and json.loads(bodies[0])["token_ids"] == [1, 2]


async def test_client_errors_are_not_retried() -> None:
    calls = 0

    def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if len(json.loads(request.content)["token_ids"]) > 3:
            message = "The decoder prompt (length 5) is longer than the maximum model length of 3."
            return httpx.Response(400, json={"error": {"message": message}})
        return httpx.Response(422, json={"detail": "bad field"})

    async with make_client(handler, max_retries=3) as client:
        with pytest.raises(ContextLengthExceeded):
            await client.generate([1, 2, 3, 4, 5], PARAMS)
        with pytest.raises(InferenceError, match="422"):
            await client.generate([1], PARAMS)
    assert calls == 2


async def test_logprob_count_mismatch_is_an_error() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        answer = generate_answer([1, 2])
        answer["choices"][0]["logprobs"]["content"].pop()
        return httpx.Response(200, json=answer)

    async with make_client(handler, max_retries=0) as client:
        with pytest.raises(InferenceError, match="logprobs"):
            await client.generate([1], PARAMS)


def control_recorder(fail_path: str | None = None):
    calls: list[tuple[str, str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(
            (
                request.url.host,
                request.url.path,
                request.url.query.decode() or request.content.decode(),
            )
        )
        if request.url.path == fail_path:
            return httpx.Response(500, json={"error": "boom"})
        return httpx.Response(200, json={})

    return calls, handler


async def test_reload_pauses_reloads_sets_version_and_resumes_every_server() -> None:
    calls, handler = control_recorder()
    async with make_client(handler, urls=(A, B)) as client:
        await client.reload("/ckpt/v1", 1)
        assert client.policy_version == 1
    for host in ("a", "b"):
        mine = [(path, detail) for h, path, detail in calls if h == host]
        assert [path for path, _ in mine] == [
            "/pause",
            "/collective_rpc",
            "/update_weight_version",
            "/resume",
        ]
        assert mine[0][1] == "mode=keep&clear_cache=true"
        assert json.loads(mine[1][1]) == {
            "method": "reload_weights",
            "kwargs": {"weights_path": "/ckpt/v1"},
        }
        assert json.loads(mine[2][1]) == {"new_version": "1"}


async def test_failed_reload_still_resumes_and_keeps_the_old_version() -> None:
    calls, handler = control_recorder(fail_path="/collective_rpc")
    async with make_client(handler, initial_version=4) as client:
        with pytest.raises(InferenceError, match="collective_rpc"):
            await client.reload("/ckpt/v5", 5)
        assert client.policy_version == 4
    assert [path for _, path, _ in calls] == ["/pause", "/collective_rpc", "/resume"]


async def test_server_versions_and_config() -> None:
    from sandpiper.config import InferenceConfig

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/weight_info"
        return httpx.Response(200, json={"weight_version": request.url.host.upper()})

    config = InferenceConfig(request_timeout_s=7.0, max_retries=5)
    client = VLLMPolicyClient.from_config(
        config, [A, B], transport=httpx.MockTransport(handler), initial_version=2
    )
    async with client:
        assert (client.request_timeout_s, client.max_retries) == (7.0, 5)
        assert client.policy_version == 2
        assert await client.server_versions() == {A: "A", B: "B"}


async def test_failed_server_cools_down_before_getting_new_requests() -> None:
    hits: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hits.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=generate_answer([3]))

    async with make_client(handler, urls=(A, B), down_cooldown_s=60.0) as client:
        for _ in range(4):
            assert (await client.generate([1], PARAMS)).server == B
    assert hits == ["a", "b", "b", "b", "b"]  # A was tried once, then left alone
