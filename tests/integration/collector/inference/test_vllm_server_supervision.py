"""A vLLM server that dies is restarted by its supervisor and serves what it served before:
the last reloaded checkpoint, under the same policy version."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest

from sandpiper.collector.inference.base import SamplingParams
from sandpiper.collector.inference.vllm_client import VLLMPolicyClient
from tests.integration.collector.inference.test_vllm_client import perturbed_checkpoint
from tests.integration.collector.inference.test_vllm_server import (
    reference_logprobs,
    server_version,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_killed_server_restarts_on_its_last_weights(vllm_server, tmp_path):
    server = vllm_server.server
    if server is None:
        pytest.skip("an external server (SANDPIPER_TEST_VLLM_URL) is not supervised here")
    checkpoint = perturbed_checkpoint(vllm_server.model_dir, tmp_path / "policy", seed=2)
    version = await server_version(vllm_server.url) + 1
    prompt_ids = [1, 100, 200, 300]
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=3)

    async with VLLMPolicyClient([vllm_server.url], initial_version=version - 1) as client:
        try:
            await client.reload(checkpoint, version)
            server.record_weights(checkpoint, version)
            os.killpg(server.pid, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while server.is_alive() and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not server.is_alive()
            restarts = server.restarts
            assert await asyncio.to_thread(server.ensure_running) is True
            assert server.restarts == restarts + 1
            gen = await client.generate(prompt_ids, params)
        finally:
            # hand the shared server back on its original weights, under a fresh version
            if server.is_alive():
                await client.reload(vllm_server.model_dir, version + 1)
                server.record_weights(vllm_server.model_dir, version + 1)

    assert gen.policy_versions_T.tolist() == [version] * len(gen.token_ids_T)
    expected = reference_logprobs(checkpoint, prompt_ids, gen.token_ids_T.tolist())
    np.testing.assert_allclose(gen.logprobs_T, expected, atol=2e-3)
