"""The memory planner: exact parameter counts, ZeRO sharding, the shipped fixtures' tables,
the start-up refusal, and its prediction against peak memory measured on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandpiper.commands._plan import check_fits, plan_run, render, to_json
from sandpiper.config import load_config
from sandpiper.errors import SetupError
from sandpiper.trainer import memory_plan as mp

REPO = Path(__file__).resolve().parents[3]
MODELS = REPO / "configs" / "models"
GIB = mp.GIB


@pytest.fixture(scope="module")
def qwen3_4b() -> mp.ModelShape:
    return mp.model_shape(MODELS / "qwen3-4b")


@pytest.mark.parametrize(
    ("folder", "published", "tied"),
    [
        # the counts the model cards give; Qwen3-4B's with its tied embedding counted once
        ("qwen3-4b", 4_022_468_096, True),
        ("qwen2.5-7b-instruct", 7_615_616_512, False),
        ("llama-3.1-8b", 8_030_261_248, False),
    ],
)
def test_meta_build_counts_the_published_parameters(
    folder: str, published: int, tied: bool
) -> None:
    shape = mp.model_shape(MODELS / folder)
    assert shape.params_published == published
    untied = shape.vocab * shape.hidden if tied else 0  # the learner trains lm_head on its own
    assert shape.params_trained == published + untied
    assert shape.tied is tied


def test_qwen3_has_qk_norm_and_its_kv_bytes(qwen3_4b: mp.ModelShape) -> None:
    assert qwen3_4b.qk_norm and (qwen3_4b.layers, qwen3_4b.kv_heads, qwen3_4b.head_dim) == (
        36,
        8,
        128,
    )
    share = mp.vllm_terms(qwen3_4b, mp.VllmShare(0.5, max_model_len=8192), mp.GPU_BYTES["h200"])
    assert share["kv_bytes_per_token"] == 2 * 36 * 8 * 128 * 2
    assert share["concurrent_sequences"] == share["kv_tokens"] // 8192 > 0


def test_zero_stages_shard_what_deepspeed_shards(qwen3_4b: mp.ModelShape) -> None:
    n, w = qwen3_4b.params_trained, 8
    terms = {
        s: mp.learner_terms(
            qwen3_4b, mp.LearnerSetup(precision="bf16", zero_stage=s, world_size=w)
        )[0]
        for s in range(4)
    }
    assert terms[0]["weights"] == 2 * n and terms[0]["optimizer_adam"] == 8 * n
    assert terms[0]["master_fp32"] == 4 * n and terms[0]["gradients"] == 2 * n
    shard = -(-n // w)
    assert terms[1]["optimizer_adam"] == 8 * shard and terms[1]["master_fp32"] == 4 * shard
    assert terms[1]["gradients"] == 2 * n  # stage 1 keeps whole gradients
    assert terms[2]["gradients"] == 2 * shard and terms[2]["weights"] == 2 * n
    assert terms[3]["weights"] == 2 * shard
    fp32 = mp.learner_terms(qwen3_4b, mp.LearnerSetup(precision="fp32"))[0]
    assert fp32["master_fp32"] == 0 and fp32["weights"] == 4 * n  # no second copy in fp32 ZeRO-0
    offload = mp.learner_terms(
        qwen3_4b, mp.LearnerSetup(precision="bf16", zero_stage=2, offload_optimizer=True)
    )
    assert "optimizer_adam" not in offload[0] and offload[1]["optimizer_adam"] == 8 * n


def test_checkpointing_and_chunking_shrink_what_they_should(qwen3_4b: mp.ModelShape) -> None:
    base = mp.LearnerSetup(precision="bf16", micro_batch_tokens=8192, row_tokens=8192)
    full = mp.learner_terms(qwen3_4b, base)[0]
    ckpt = mp.learner_terms(
        qwen3_4b, mp.LearnerSetup(**{**_fields(base), "gradient_checkpointing": True})
    )[0]
    logits = mp.learner_terms(
        qwen3_4b, mp.LearnerSetup(**{**_fields(base), "logprob_chunk_tokens": 0})
    )[0]
    assert full["activations"] > 20 * ckpt["activations"]
    assert logits["logprob_step"] > 4 * full["logprob_step"]


def _fields(setup: mp.LearnerSetup) -> dict:
    return {k: getattr(setup, k) for k in setup.__slots__}


def _cfg(tmp_path: Path, text: str):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(path)


ONE_H200 = """
[inference]
gpus = [0]
gpu_memory_utilization = 0.22
max_model_len = 8192
[learner]
model = "configs/models/qwen3-4b"
gpus = [0]
precision = "bf16"
gradient_checkpointing = true
micro_batch_tokens = 8192
deepspeed_config = "configs/deepspeed_zero2.json"
"""

EIGHT_H100 = """
[inference]
gpus = [0, 1, 2, 3]
num_servers = 4
gpu_memory_utilization = 0.9
max_model_len = 8192
[learner]
model = "configs/models/qwen2.5-7b-instruct"
gpus = [4, 5, 6, 7]
precision = "bf16"
gradient_checkpointing = true
micro_batch_tokens = 8192
deepspeed_config = "configs/deepspeed_zero2.json"
"""


def test_qwen3_4b_on_one_h200(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qwen3_4b) -> None:
    monkeypatch.chdir(REPO)
    cfg = _cfg(tmp_path, ONE_H200)
    plans = plan_run(cfg, gpu="h200", gpu_bytes=mp.GPU_BYTES["h200"], shape=qwen3_4b)
    assert [gp.role for gp in plans] == ["learner+inference"]
    plan = plans[0].plan
    assert plan.fits and plan.total <= plan.gpu_bytes and plan.vllm["concurrent_sequences"] >= 8
    table = render(plans, model=cfg.learner.model, shape=qwen3_4b)
    assert "4,022,468,096" in table and "vLLM share" in table and "fits" in table
    doc = to_json(plans, model=cfg.learner.model, shape=qwen3_4b)
    assert doc["fits"] is True and doc["gpus"][0]["learner"]["gradients"] > 0
    json.dumps(doc)  # every term is a plain number
    # the default vLLM share (0.92) beside the learner cannot fit
    cfg.inference.gpu_memory_utilization = None
    assert not plan_run(cfg, gpu="h200", gpu_bytes=mp.GPU_BYTES["h200"], shape=qwen3_4b)[
        0
    ].plan.fits


def test_the_plan_shows_both_sides_of_checkpointing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qwen3_4b
) -> None:
    """The table and the JSON give the activations and the rank's peak with checkpointing on
    and off, whichever the config chose; the chosen side is the one the plan adds up."""
    monkeypatch.chdir(REPO)
    cfg = _cfg(tmp_path, ONE_H200)
    for chosen in (True, False):
        cfg.learner.gradient_checkpointing = chosen
        plans = plan_run(cfg, gpu="h200", gpu_bytes=mp.GPU_BYTES["h200"], shape=qwen3_4b)
        plan = plans[0].plan
        on, off = plan.checkpointing["on"], plan.checkpointing["off"]
        used = on if chosen else off
        assert used["activations"] == plan.learner["activations"]
        assert used["peak"] == plan.learner_peak
        assert on["activations"] * 10 < off["activations"] and on["peak"] < off["peak"]
        assert off["recompute_layer"] == 0 < on["recompute_layer"]
        other = "off" if chosen else "on"
        table = render(plans, model=cfg.learner.model, shape=qwen3_4b)
        assert f"with checkpointing {other}: activations" in table
        doc = to_json(plans, model=cfg.learner.model, shape=qwen3_4b)
        assert doc["gpus"][0]["checkpointing"][other]["peak"] > 0


def test_qwen2_5_7b_on_eight_h100(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    cfg = _cfg(tmp_path, EIGHT_H100)
    plans = plan_run(cfg, gpu="h100-80gb", gpu_bytes=mp.GPU_BYTES["h100-80gb"])
    roles = {gp.role: gp for gp in plans}
    assert set(roles) == {"learner", "inference"}
    assert (
        roles["learner"].gpu_ids == (4, 5, 6, 7) and roles["learner"].plan.setup["world_size"] == 4
    )
    assert all(gp.plan.fits for gp in plans)


def test_refuses_what_the_device_cannot_hold(tmp_path: Path, monkeypatch, qwen3_4b) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.setattr(mp, "model_shape", lambda _path: qwen3_4b)
    cfg = _cfg(tmp_path, ONE_H200)
    with pytest.raises(SetupError) as refused:
        check_fits(cfg, role="learner", device=lambda: ("fake-40gb", 40 * GIB))
    message = str(refused.value)
    assert "does not fit on fake-40gb" in message and "Adam moments" in message
    check_fits(cfg, role="learner", device=lambda: ("h200", mp.GPU_BYTES["h200"]))
    check_fits(cfg, role="learner", device=lambda: None)  # no CUDA device: nothing to check
    cfg.inference.gpus = []
    cfg.learner.gpus = []
    check_fits(cfg, role="inference", device=lambda: ("fake", GIB))  # vLLM not on a GPU here


@pytest.mark.parametrize("command", ["learn", "collect"])
def test_learn_and_collect_refuse_at_start_with_the_table(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the real commands: on a host whose CUDA device (faked) is too small, ``learn``
    and ``collect`` exit 1 before anything starts, with the planner's table in the error."""
    from typer.testing import CliRunner

    from sandpiper.cli import app
    from sandpiper.commands import _plan, _preflight

    model = tmp_path / "qwen3-4b"
    model.mkdir()
    (model / "config.json").write_bytes((MODELS / "qwen3-4b" / "config.json").read_bytes())
    (model / "model.safetensors").write_bytes(b"")  # check_model wants weights; none are read
    config = tmp_path / "run.toml"
    config.write_text(
        ONE_H200.replace('"configs/models/qwen3-4b"', f'"{model}"').replace(
            "configs/deepspeed_zero2.json", str(REPO / "configs" / "deepspeed_zero2.json")
        )
    )
    monkeypatch.chdir(tmp_path)  # runs/ and the store under the test's folder
    monkeypatch.setattr(_plan, "cuda_device_bytes", lambda: ("fake-24gb", 24 * GIB))
    monkeypatch.setattr(_preflight, "collector_ready", lambda cfg, **kw: None)
    started: list[str] = []
    monkeypatch.setattr(
        "sandpiper.collector.daemon.launch.run_collector_process", lambda cfg: started.append("c")
    )
    monkeypatch.setattr("sandpiper.trainer.main.run_learner", lambda cfg: started.append("l"))
    done = CliRunner().invoke(app, [command, "-c", str(config)])
    assert done.exit_code == 1, done.output
    assert "does not fit on fake-24gb" in done.output and "vLLM share" in done.output
    assert not started
    # the same config on a device that holds it starts (the start itself is faked here)
    monkeypatch.setattr(_plan, "cuda_device_bytes", lambda: ("h200", mp.GPU_BYTES["h200"]))
    done = CliRunner().invoke(app, [command, "-c", str(config)])
    assert started, done.output


def test_gpu_names() -> None:
    assert mp.gpu_bytes_of("H200") == ("h200", mp.GPU_BYTES["h200"])
    assert mp.gpu_bytes_of("a6000=47.5") == ("a6000", int(47.5 * GIB))
    with pytest.raises(mp.PlanError):
        mp.gpu_bytes_of("h300")


# Measured against the learner's own step on CPU: one subprocess per case (peak memory is a
# process's high-water mark); the probe's docstring says what "peak" is and why.
CPU_CASES = [
    ("runs/tiny-model", "fp32", False, 256),
    ("runs/tiny-model", "fp32", True, 256),
    ("runs/tiny-model", "bf16", False, 256),
    ("runs/tiny-model", "bf16", True, 256),
]
SLOW_CPU_CASES = [
    ("runs/smollm2-135m", "fp32", False, 128),
    ("runs/smollm2-135m", "fp32", True, 128),
    ("runs/smollm2-135m", "bf16", False, 128),
    ("runs/smollm2-135m", "bf16", True, 128),
]
TOLERANCE = 0.25


def probe(model: str, precision: str, checkpointing: bool, row_tokens: int) -> dict:
    folder = REPO / model
    if not (folder / "config.json").is_file():
        pytest.skip(f"{model} is built by scripts/setup.sh")
    argv = [
        sys.executable, "-m", "sandpiper.trainer.memory_probe", "--model", str(folder),
        "--precision", precision, "--row-tokens", str(row_tokens), "--rows", "2" if "tiny" in model else "1",
        "--json",
    ] + (["--checkpointing"] if checkpointing else [])  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(("model", "precision", "checkpointing", "row_tokens"), CPU_CASES)
def test_prediction_matches_measured_peak_tiny(model, precision, checkpointing, row_tokens) -> None:
    result = probe(model, precision, checkpointing, row_tokens)
    assert abs(result["rel_error"]) <= TOLERANCE, result


@pytest.mark.slow
@pytest.mark.long
@pytest.mark.parametrize(("model", "precision", "checkpointing", "row_tokens"), SLOW_CPU_CASES)
def test_prediction_matches_measured_peak_smollm2(
    model, precision, checkpointing, row_tokens
) -> None:
    result = probe(model, precision, checkpointing, row_tokens)
    assert abs(result["rel_error"]) <= TOLERANCE, result


SHIPPED_GPU_CONFIGS = {
    "gpu-1xh200-qwen3-4b.toml": "h200",
    "gpu-8xh100-qwen2.5-7b.toml": "h100-80gb",
}
"""Each shipped GPU config -> the GPU it is written for."""


@pytest.mark.parametrize(("name", "gpu"), SHIPPED_GPU_CONFIGS.items())
def test_every_shipped_gpu_config_fits_its_gpu(name: str, gpu: str) -> None:
    """`sandpiper plan` on the shipped file as a user runs it (its model sized from the
    shipped config.json when the weights are not here)."""
    from typer.testing import CliRunner

    from sandpiper.cli import app

    shipped = sorted(p.name for p in (REPO / "configs").glob("gpu-*.toml"))
    assert shipped == sorted(SHIPPED_GPU_CONFIGS), "a new GPU config needs its GPU here"
    done = CliRunner().invoke(
        app, ["plan", "-c", str(REPO / "configs" / name), "--gpu", gpu, "--json"]
    )
    assert done.exit_code == 0, done.output
    plan = json.loads(done.output)
    assert plan["fits"] is True, done.output
