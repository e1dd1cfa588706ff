"""One evaluation harness for both sides of the race: ``sandpiper collect --eval``.

Every checkpoint, whichever system wrote it, is loaded in place into one vLLM server
(``/collective_rpc reload_weights``, the route the collector uses for new policy versions)
and evaluated by the real CLI, ``sandpiper collect --eval``, on the held-out tasks with the
same sampling (the race's collector settings, ``validation_group_size`` samples per task).
Results go to one DuckDB store, one run per checkpoint.

Which checkpoint stands for a wall-clock mark: the newest one each side had written by then
(its time measured from the start of that side's run), the start checkpoint when none.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class Checkpoint:
    side: str
    path: str
    t_s: float
    """Seconds after the side's start at which it existed."""
    label: str


def at_marks(checkpoints: list[Checkpoint], marks_s: list[float], start: Checkpoint) -> list:
    """For each mark, the newest checkpoint written at or before it (else ``start``)."""
    chosen = []
    for mark in marks_s:
        before = [c for c in checkpoints if c.t_s <= mark]
        chosen.append(max(before, key=lambda c: c.t_s) if before else start)
    return chosen


def eval_config(base: Any, *, heldout: Path, runs_dir: Path, name: str, samples: int) -> Any:
    """The race's collector settings on the held-out tasks, ``samples`` per task."""
    cfg = base.model_copy(deep=True)
    cfg.name, cfg.runs_dir = name, str(runs_dir)
    cfg.store.url = f"duckdb:///{runs_dir}/eval.duckdb"
    cfg.collector.tasks, cfg.collector.validation_group_size = str(heldout), samples
    return cfg


def run_eval(cfg: Any, *, endpoint: str, model: str, log_path: Path) -> None:
    """``sandpiper collect --eval`` in its own process, as a user runs it."""
    from sandpiper.config import write_resolved

    path = write_resolved(cfg)
    cmd = [sys.executable, "-m", "sandpiper.cli", "collect", "-c", str(path), "--eval",
           "--endpoint", endpoint, "--model", model]  # fmt: skip
    with log_path.open("ab") as log:
        done = subprocess.run(cmd, stdout=log, stderr=log)
    if done.returncode != 0:
        raise RuntimeError(f"sandpiper collect --eval failed; see {log_path}")


def eval_reward(store_url: str, run_id: str) -> dict[str, Any]:
    """Mean reward and pass rate (reward >= 1) over the valid episodes of one eval run, and
    their rewards (each point's interval is computed from them)."""
    from sandpiper.analysis import api

    frame = api.episodes(store_url, run_id=run_id)
    valid = frame.filter(frame["valid"])
    n = valid.height
    rewards = valid["reward"].to_list() if n else []
    return {
        "reward": sum(rewards) / n if n else float("nan"),
        "pass_rate": sum(r >= 1.0 for r in rewards) / n if n else float("nan"),
        "n_valid": n,
        "n_episodes": frame.height,
        "rewards": [float(r) for r in rewards],
    }


class Harness:
    """One vLLM server (on the start checkpoint); :meth:`evaluate` swaps weights in place."""

    def __init__(self, base_cfg: Any, *, start: Path, heldout: Path, out: Path, samples: int):
        from sandpiper.collector.inference.vllm_server import VLLMServer

        self.base, self.heldout, self.out, self.samples = base_cfg, heldout, out, samples
        self.model = str(start)
        inf = base_cfg.inference
        self.server = VLLMServer(
            model_dir=start, port=_free_port(), max_model_len=inf.max_model_len,
            kv_cache_gib=inf.kv_cache_gib, log_path=out / "eval-vllm.log",
            extra_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes"),
        )  # fmt: skip
        self.results: dict[str, dict[str, Any]] = {}
        self._version = 0

    def __enter__(self) -> Harness:
        # Every checkpoint is evaluated again: a previous evaluation's episodes (a rerun with
        # ``--only``) would join the same run ids and double those points' samples.
        for path in self.out.glob("eval.duckdb*"):  # the file, its WAL, its spool folder
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop()

    def evaluate(self, ckpt: Checkpoint) -> dict[str, Any]:
        """Eval reward of one checkpoint (cached by path: a checkpoint is evaluated once)."""
        if ckpt.path in self.results:
            return self.results[ckpt.path]
        from sandpiper.collector.inference.vllm_client import VLLMPolicyClient

        self._version += 1

        async def load() -> None:
            async with VLLMPolicyClient([self.server.url]) as client:
                await client.reload(ckpt.path, self._version)

        asyncio.run(load())
        name = f"eval-{ckpt.label}"
        cfg = eval_config(self.base, heldout=self.heldout, runs_dir=self.out, name=name,
                          samples=self.samples)  # fmt: skip
        run_eval(cfg, endpoint=self.server.url, model=self.model, log_path=self.out / "eval.log")
        result = {"checkpoint": ckpt.path, "run_id": name,
                  **eval_reward(cfg.store.url, name)}  # fmt: skip
        self.results[ckpt.path] = result
        return result


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
