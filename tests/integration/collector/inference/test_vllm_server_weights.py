"""What a vLLM server holds after an in-place reload of a tied model's learner checkpoint,
read back from the server (not inferred from the KL, which on the CPU build passes by
accident), and a server started in another working directory with no policy registered.

One vLLM start covers both: the tied tiny model is refused as it is, its untied copy (the
fix the refusal names) is served by its absolute path from a server whose working directory
is elsewhere, then a learner-style checkpoint whose embedding and output layer differ is
reloaded and each matrix compared with the server's."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import httpx
import pytest
import torch

from sandpiper.collector.inference.vllm_client import VLLMPolicyClient
from sandpiper.collector.inference.vllm_server import VLLMServer
from sandpiper.collector.inference.weight_probe import checksums
from sandpiper.collector.run_setup import served_model
from sandpiper.errors import ConfigError
from tests.conftest import require
from tests.fixtures.vllm import free_port, tiny_model_copy

pytestmark = [pytest.mark.slow, pytest.mark.long]
PROBE = "sandpiper.collector.inference.weight_probe.WeightProbe"


def _tied_tiny_model(dest: Path) -> Path:
    from transformers import AutoModelForCausalLM

    src = tiny_model_copy(dest.parent / "untied-src")
    model = AutoModelForCausalLM.from_pretrained(src)
    model.lm_head.weight = model.get_input_embeddings().weight  # one matrix, as published
    model.config.tie_word_embeddings = True
    model.save_pretrained(dest)
    for f in src.iterdir():  # tokenizer, chat template
        if not (dest / f.name).exists():
            (dest / f.name).write_bytes(f.read_bytes())
    return dest


def _learner_checkpoint(base: Path, out: Path) -> dict[str, list[float]]:
    """An untied checkpoint as the learner writes one after a step: embedding and output
    layer moved apart. Returns their checksums."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        emb, head = model.get_input_embeddings().weight, model.lm_head.weight
        emb.add_(0.05 * torch.randn(emb.shape, generator=g))
        head.add_(-0.05 * torch.randn(head.shape, generator=g))
    model.save_pretrained(out)
    return {"embedding": checksums(emb), "lm_head": checksums(head)}


def test_reloaded_tied_model_serves_the_learners_matrices_from_another_cwd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    require("vLLM", importlib.util.find_spec("vllm") is not None, "install the `cpu` extra")
    from sandpiper.models.importer import import_model

    tied = _tied_tiny_model(tmp_path / "tied")
    with pytest.raises(ConfigError, match="sandpiper model import"):
        served_model(str(tied))
    import_model(tied, tmp_path / "policy" / "v0")
    monkeypatch.chdir(tmp_path)
    model = served_model("policy/v0")  # relative here, absolute on the wire
    assert os.path.isabs(model)
    elsewhere = tmp_path / "server-cwd"
    elsewhere.mkdir()
    expected = _learner_checkpoint(Path(model), tmp_path / "policy" / "v1")
    server = VLLMServer(
        model_dir=Path(model), port=free_port(), max_model_len=512,
        log_path=tmp_path / "vllm.log", cwd=elsewhere,
        extra_args=("--worker-extension-cls", PROBE),
    )  # fmt: skip
    with server:

        async def reload() -> None:
            async with VLLMPolicyClient([server.url]) as client:
                await client.reload(str((tmp_path / "policy" / "v1").resolve()), 1)

        asyncio.run(reload())
        r = httpx.post(f"{server.url}/collective_rpc", json={"method": "weight_checksums"},
                       timeout=60)  # fmt: skip
        assert r.status_code == 200, r.text
        (held,) = r.json()["results"]
    assert not held["shared"]
    for name in ("embedding", "lm_head"):
        assert held[name] == pytest.approx(expected[name], rel=1e-5, abs=1e-4), name
    assert held["embedding"] != pytest.approx(held["lm_head"], rel=1e-3)
