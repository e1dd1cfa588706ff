"""Placement and launch lines: which GPUs each process gets, vLLM's CUDA and CPU lines, the
learner's DeepSpeed line, and the `--dry-run` JSON of `sandpiper collect` / `learn`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sandpiper.cli import app
from sandpiper.collector.inference.vllm_server import VLLMServer
from sandpiper.collector.run_setup import served_model
from sandpiper.commands.learn import learner_launch
from sandpiper.config import InferenceConfig, load_config
from sandpiper.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]
H200 = REPO / "configs" / "gpu-1xh200-qwen3-4b.toml"
H100 = REPO / "configs" / "gpu-8xh100-qwen2.5-7b.toml"


def test_cpu_launch_line_is_unchanged() -> None:
    """The demo's and the tests' servers: float32, eager, one process, CPU KV cache."""
    server = VLLMServer.from_config(InferenceConfig(), "/m")
    assert server.command()[1:] == [
        "-m", "vllm.entrypoints.openai.api_server", "--model", "/m", "--host", "127.0.0.1",
        "--port", "8100", "--dtype", "float32", "--max-model-len", "2048", "--logprobs-mode",
        "raw_logprobs", "--enable-scale-out", "--disable-uvicorn-access-log", "--enforce-eager",
        "--distributed-executor-backend", "uni",
    ]  # fmt: skip
    env = server.environment_set({})
    assert env == {
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "GOMP_SPINCOUNT": "10000",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }


def test_cuda_servers_get_their_own_gpus_and_gpu_flags() -> None:
    config = InferenceConfig(
        gpus=[4, 5, 6, 7], num_servers=2, tensor_parallel_size=2,
        gpu_memory_utilization=0.85, max_num_seqs=64,
    )  # fmt: skip
    first, second = (VLLMServer.from_config(config, "/m", index=i) for i in (0, 1))
    assert first.environment_set({})["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert second.environment_set({})["CUDA_VISIBLE_DEVICES"] == "6,7"
    cmd = first.command()
    for absent in ("--enforce-eager", "--distributed-executor-backend", "float32"):
        assert absent not in cmd
    flags = " ".join(cmd)
    assert "--dtype auto" in flags and "--enable-prefix-caching" in flags
    assert "--tensor-parallel-size 2" in flags and "--gpu-memory-utilization 0.85" in flags
    assert "--max-num-seqs 64" in flags
    env = first.environment_set({})
    assert "VLLM_CPU_KVCACHE_SPACE" not in env and "VLLM_ENABLE_V1_MULTIPROCESSING" not in env


def test_device_auto_is_cuda_exactly_when_gpus_are_placed() -> None:
    assert VLLMServer.from_config(InferenceConfig(gpus=[0]), "/m").device == "cuda"
    assert VLLMServer.from_config(InferenceConfig(), "/m").device == "cpu"
    explicit = InferenceConfig(device="cuda", dtype="float32", enforce_eager=True)
    server = VLLMServer.from_config(explicit, "/m")
    assert server.device == "cuda" and "--enforce-eager" in server.command()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["--inference.gpus", "[0]", "--learner.gpus", "[0, 1]"], "overlaps inference.gpus"),
        (["--inference.gpus", "[0]", "--learner.gpus", "[0]"], "gpu_memory_utilization"),
        (["--inference.gpus", "[0, 1]", "--inference.num_servers", "1"], "num_servers"),
        (["--inference.gpus", "[0]", "--inference.device", "cpu"], "takes no GPUs"),
        (["--learner.gpus", "[2, 2]"], "distinct"),
    ],
)
def test_placement_is_refused_when_it_collides(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_one_shared_gpu_with_a_memory_share_is_allowed() -> None:
    cfg = load_config(H200)
    assert cfg.inference.gpus == cfg.learner.gpus == [0]
    assert cfg.inference.gpu_memory_utilization is not None


def test_learner_honours_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--num_gpus` would drop CUDA_VISIBLE_DEVICES and take GPUs 0..N-1 (vLLM's)."""
    cfg = load_config(None)
    plan = learner_launch(
        cfg, config_path="c.toml", extra=[], nproc=1,
        environ={"CUDA_VISIBLE_DEVICES": "2,3"}, master_port="1234",
    )  # fmt: skip
    argv = plan["argv"]
    assert argv[0] == str(Path(sys.executable).parent / "deepspeed")
    assert argv[1:3] == ["--include", "localhost:2,3"]
    assert "--num_gpus" not in argv
    assert argv[-4:] == ["--module", "sandpiper.trainer", "--config", "c.toml"]


@pytest.mark.parametrize("config", [None, H100], ids=["cpu", "8xh100"])
def test_a_rank_of_a_launched_world_trains_in_its_own_process(config) -> None:
    """`deepspeed --module sandpiper.cli learn` sets CUDA_VISIBLE_DEVICES=0,1 for each rank,
    also on CPU: read as a placement, every rank launched a world of its own on one port
    (EADDRINUSE in tests/integration/commands/test_learn_launchers.py)."""
    environ = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "0,1"}
    plan = learner_launch(
        load_config(config), config_path="c.toml", extra=[], nproc=1, environ=environ,
        master_port="1234",
    )  # fmt: skip
    assert plan["argv"] is None and plan["env"] == {}


def test_learner_gpus_from_config_and_cpu_path() -> None:
    plan = learner_launch(
        load_config(H100), config_path=None, extra=[], nproc=1, environ={}, master_port="1"
    )
    assert plan["argv"][1:3] == ["--include", "localhost:4,5,6,7"]
    one = learner_launch(load_config(H200), config_path=None, extra=[], nproc=1, environ={},
                         master_port="1")  # fmt: skip
    assert one["argv"] is None and one["env"] == {"CUDA_VISIBLE_DEVICES": "0"}
    cpu = learner_launch(load_config(None), config_path=None, extra=[], nproc=2, environ={},
                         master_port="1")  # fmt: skip
    assert cpu["argv"][1:3] == ["--num_gpus", "2"]  # no placement: the CPU path as before


def test_dry_runs_print_every_process_as_json(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    runner = CliRunner()
    out = runner.invoke(app, ["collect", "-c", str(H100), "--dry-run"])
    assert out.exit_code == 0, out.output
    servers = json.loads(out.output)["processes"]
    assert [s["env"]["CUDA_VISIBLE_DEVICES"] for s in servers] == ["0", "1", "2", "3"]
    assert all(Path(s["cwd"]).is_absolute() and "--enable-prefix-caching" in s["argv"]
               for s in servers)  # fmt: skip
    assert len({s["argv"][s["argv"].index("--port") + 1] for s in servers}) == 4
    out = runner.invoke(app, ["learn", "-c", str(H100), "--dry-run"])
    assert out.exit_code == 0, out.output
    (learner,) = json.loads(out.output)["processes"]
    assert "localhost:4,5,6,7" in learner["argv"]


def test_a_served_model_folder_is_sent_as_an_absolute_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    monkeypatch.chdir(tmp_path)
    assert served_model("m") == str(tmp_path / "m")
    assert served_model("Qwen/Qwen2.5-7B-Instruct") == "Qwen/Qwen2.5-7B-Instruct"


def test_a_tied_model_is_refused_with_the_fix(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    with pytest.raises(ConfigError, match="sandpiper model import"):
        served_model(str(tmp_path))
