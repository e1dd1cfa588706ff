"""The learner loop against an in-memory store: version 0, what a step registers, skipped
groups, minibatches x epochs, resume from the latest version, SFT, and the dtype a version is
published in."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from sandpiper.testing import MemoryStore
from tests.fixtures.learner import make_config, sample_group

pytestmark = pytest.mark.slow  # DeepSpeed engines in-process (~10 s each on 2 cores)


@pytest.fixture(scope="module")
def world():
    from sandpiper.trainer.engine import init_distributed

    return init_distributed()


def _groups(model, n: int, version: int = 0, start: int = 0):
    torch.manual_seed(start)
    return [sample_group(model, run_id="lt", task=i, seq=start + i, version=version)
            for i in range(n)]  # fmt: skip


def test_step_registers_next_version_with_its_groups(tmp_path, learner_tiny_model, world):
    from sandpiper.trainer.learner import Learner

    cfg = make_config(tmp_path, learner_tiny_model, minibatches=2, epochs=2, lr=1e-3)
    store = MemoryStore()
    learner = Learner(cfg.for_learner(), store, world)
    assert [p.version for p in store.registered] == [0]
    assert store.registered[0].checkpoint_uri.endswith("v000000-t0001")
    store.write_groups(_groups(learner.engine.module, 2))
    batch = store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=2)
    metrics = learner.train_step(batch)
    assert learner.version == 1 and store.registered[-1].parent_version == 0
    assert set(store.consumed) == set(batch.group_ids)
    assert metrics["optimizer_steps"] == 4  # 2 minibatches x 2 epochs
    # The first minibatch trains on-policy samples: raw weights are 1 up to float noise.
    assert metrics["is/w_min"] == pytest.approx(1.0, abs=1e-4)
    assert metrics["batch/sequences"] == 16 and metrics["staleness/lag_0"] == 2
    assert 0.0 <= metrics["loss/clipped_frac"] < 1.0 and metrics["perf/tokens_per_s"] > 0

    # Resume: a new learner continues from version 1's checkpoint.
    learner.close()
    again = Learner(cfg.for_learner(), store, world)
    assert again.version == 1
    a = dict(learner.engine.module.named_parameters())
    for name, p in again.engine.module.named_parameters():
        assert torch.equal(p, a[name]), name


def test_zero_variance_groups_are_counted_and_still_consumed(tmp_path, learner_tiny_model, world):
    from dataclasses import replace

    from sandpiper.trainer.learner import Learner

    cfg = make_config(tmp_path, learner_tiny_model)
    store = MemoryStore()
    learner = Learner(cfg.for_learner(), store, world)
    flat = [
        replace(g, episodes=tuple(replace(e, reward=1.0) for e in g.episodes))
        for g in _groups(learner.engine.module, 2)
    ]
    store.write_groups(flat)
    before = {k: v.clone() for k, v in learner.engine.module.state_dict().items()}
    metrics = learner.train_step(store.claims.claim(run_id="lt", learner_id="x", n_groups=2,
                                                   max_lag=2))  # fmt: skip
    assert metrics["batch/groups_zero_variance"] == 2 and metrics["batch/sequences"] == 0
    assert len(store.consumed) == 2 and learner.version == 1
    for k, v in learner.engine.module.state_dict().items():
        assert torch.equal(v, before[k])


def test_stale_samples_get_importance_weights(tmp_path, learner_tiny_model, world):
    from sandpiper.trainer.learner import Learner

    cfg = make_config(tmp_path, learner_tiny_model, lr=5e-3, groups_per_step=2)
    store = MemoryStore()
    learner = Learner(cfg.for_learner(), store, world)
    store.write_groups(_groups(learner.engine.module, 4))  # all sampled by version 0
    learner.train_step(store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=2))
    metrics = learner.train_step(
        store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=2)
    )
    assert metrics["staleness/lag_1"] == 2
    assert metrics["is/w_max"] > 1.0 > metrics["is/w_min"] and metrics["is/ess"] < 1.0
    assert metrics["kl/sampler_vs_learner"] > 0


def test_shared_prefixes_train_the_same_step(tmp_path, learner_tiny_model, world, monkeypatch,
                                            caplog):  # fmt: skip
    """``share_prefix`` on and off give the same step (the groups' 30-token prompts are
    computed once a row: rows stay within ``max_model_len``); a model whose attention would
    ignore the mask falls back to unshared packing, with a log line."""
    import logging

    import tests.fixtures.learner as fixtures
    from sandpiper.trainer.learner import Learner

    monkeypatch.setattr(
        fixtures,
        "PROMPTS",
        ([(7 * i) % 200 + 3 for i in range(30)], [(11 * i) % 190 + 5 for i in range(30)]),
    )
    metrics = {}
    for share in (False, True):
        cfg = make_config(tmp_path / str(share), learner_tiny_model, share_prefix=share)
        store = MemoryStore()
        learner = Learner(cfg.for_learner(), store, world)
        assert (learner.sharing is not None) is share
        store.write_groups(_groups(learner.engine.module, 2))
        batch = store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=2)
        seqs, _ = learner.sequences(batch)
        micros = learner.pack(seqs)
        if share:
            layouts = [m.shared for m in micros if m.shared is not None]
            assert len(layouts) == len(micros)
            assert max(layout.input_ids.shape[1] for layout in layouts) <= 64
            assert sum(m.num_tokens for m in micros) < sum(len(s.token_ids_T) for s in seqs)
        metrics[share] = learner.train_step(batch)
        learner.close()
    for key in ("loss/grad_norm", "is/w_mean", "is/w_min", "is/w_max", "loss/clipped_frac"):
        assert metrics[True][key] == pytest.approx(metrics[False][key], rel=1e-5, abs=1e-7), key

    learner.engine.module.config._attn_implementation = "flash_attention_2"
    with caplog.at_level(logging.WARNING, logger="sandpiper.trainer.learner"):
        assert learner._sharing() is None
    assert "packing unshared" in caplog.text and "flash_attention_2" in caplog.text


def test_sft_registers_a_version_that_lowers_the_nll(tmp_path, learner_tiny_model, world):
    from sandpiper.trainer.learner import Learner
    from sandpiper.trainer.sft import run_sft

    cfg = make_config(tmp_path, learner_tiny_model, algo="sft", epochs=4, lr=1e-2,
                      sft_min_reward=0.5)  # fmt: skip
    store = MemoryStore()
    learner = Learner(cfg.for_learner(), store, world)
    store.write_groups(_groups(learner.engine.module, 2))
    chosen = store.claims.sft_episodes(run_id="lt", min_reward=0.5)
    first = run_sft(learner)
    assert first["sft/episodes"] == len(chosen) > 0
    assert learner.version == 1 and store.registered[-1].learner_step == 1
    second = run_sft(learner)  # the same data again: the model has learned it
    assert second["sft/nll"] < first["sft/nll"]
    assert np.isfinite(second["loss/grad_norm"])


def test_training_state_every_k_versions_and_at_a_clean_stop(tmp_path, learner_tiny_model, world):
    """``train_state_every = 2``: v2 has the training state, v1 and v3 not; a learner that
    starts then resumes from v2's state (v3 stays the latest version); :meth:`finish` (a
    clean stop) adds v3's, and the next learner resumes from it exactly."""
    from safetensors.torch import load_file

    from sandpiper.trainer.learner import Learner
    from sandpiper.trainer.resume import has_train_state

    cfg = make_config(tmp_path, learner_tiny_model, lr=1e-3, train_state_every=2).for_learner()
    store = MemoryStore()
    learner = Learner(cfg, store, world)
    store.write_groups(_groups(learner.engine.module, 6))
    for _ in range(3):
        batch = store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=5)
        metrics = learner.train_step(batch)
    folders = [Path(p.checkpoint_uri) for p in store.registered]
    assert [has_train_state(f) for f in folders] == [False, False, True, False]
    assert metrics["checkpoint/bytes"] > 0 and "checkpoint/train_state_bytes" not in metrics
    assert store.steps[-2]["checkpoint/train_state_bytes"] > 0  # v2's

    def weights(learner) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in learner.engine.module.state_dict().items()}

    # as after a crash: the lease lapses (a second learner would otherwise wait for it as a
    # standby, forever in this test) and v3 has no training state
    assert learner.keeper is not None
    learner.keeper.close(release=True)
    crashed = Learner(cfg, store, world)
    assert crashed.version == 3
    v2 = load_file(str(folders[2] / "model.safetensors"))
    got = weights(crashed)
    assert all(torch.equal(got[k], v) for k, v in v2.items())
    crashed.close()
    learner.finish()
    assert has_train_state(folders[3])
    resumed = Learner(cfg, store, world)
    assert resumed.version == 3
    want, got = weights(learner), weights(resumed)
    assert all(torch.equal(got[k], v) for k, v in want.items())
    resumed.close()
    learner.close(release=False)  # its lease was handed over above


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_a_version_is_published_in_the_training_dtype(
    tmp_path, learner_tiny_model, world, caplog, precision, dtype
):
    """The sampler's weights are written in the dtype the learner computes with: bf16
    safetensors from a bf16 learner (DeepSpeed's bf16 mode), float32 from an fp32 one; the
    log line of the version says what was written, in bytes."""
    from safetensors.torch import load_file

    from sandpiper.trainer.learner import Learner

    caplog.set_level("INFO", logger="sandpiper.trainer.learner")
    cfg = make_config(tmp_path, learner_tiny_model, precision=precision, lr=1e-3)
    store = MemoryStore()
    learner = Learner(cfg.for_learner(), store, world)
    store.write_groups(_groups(learner.engine.module, 2))
    metrics = learner.train_step(
        store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=2)
    )
    assert learner.version == 1
    folder = Path(store.registered[-1].checkpoint_uri)
    files = sorted(folder.glob("*.safetensors"))
    assert files
    dtypes = {key: t.dtype for file in files for key, t in load_file(str(file)).items()}
    assert dtypes and set(dtypes.values()) == {dtype}, dtypes
    written = f"{metrics['checkpoint/bytes'] / 1e6:,.1f} MB written ("
    assert f"{written}{str(dtype).removeprefix('torch.')} weights" in caplog.text
    learner.close()


def test_auto_threads_follow_the_idle_cores_step_by_step(tmp_path, learner_tiny_model, world):
    """``torch_threads = "auto"``: the first step keeps the start-up count, the next one takes
    what the first step measured (1 or 2 on this machine, whatever else runs), and both are
    in the step's metrics."""
    from sandpiper.trainer.learner import Learner

    start = torch.get_num_threads()
    cfg = make_config(tmp_path, learner_tiny_model, torch_threads="auto", lr=1e-3)
    store = MemoryStore()
    learner = Learner(cfg.for_learner(), store, world)
    try:
        seen = []
        for step in range(2):
            store.write_groups(_groups(learner.engine.module, 2, version=step, start=2 * step))
            batch = store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=100)
            seen.append(learner.train_step(batch)["perf/torch_threads"])
        assert seen[0] == start
        assert 1 <= seen[1] <= len(os.sched_getaffinity(0))
        assert torch.get_num_threads() == seen[1]  # applied before the second step
    finally:
        learner.close()
        torch.set_num_threads(start)


def test_a_full_disk_stops_the_step_with_the_fix_before_writing(
    tmp_path, learner_tiny_model, world, monkeypatch
):
    """With less free space than the last version wrote, the next step raises one clear
    error before writing anything (a full disk otherwise ends in a serialiser's ``unexpected
    pos``), registers nothing and leaves no half-written folder."""
    import shutil as real_shutil

    from sandpiper.errors import LearnerError
    from sandpiper.trainer import checkpoint
    from sandpiper.trainer.learner import Learner

    cfg = make_config(tmp_path, learner_tiny_model, lr=1e-3)
    store = MemoryStore()
    learner = Learner(cfg.for_learner(), store, world)
    try:
        store.write_groups(_groups(learner.engine.module, 2))
        batch = store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=100)
        learner.train_step(batch)
        before = sorted(p.name for p in learner.checkpoint_dir.iterdir())
        usage = real_shutil.disk_usage(tmp_path)
        monkeypatch.setattr(checkpoint.shutil, "disk_usage",
                            lambda path: usage._replace(free=1_000_000))  # fmt: skip
        store.write_groups(_groups(learner.engine.module, 2, version=1, start=2))
        batch = store.claims.claim(run_id="lt", learner_id="x", n_groups=2, max_lag=100)
        with pytest.raises(LearnerError, match=r"not enough disk space for policy v2 .*0\.00 GB"):
            learner.train_step(batch)
        assert [p.version for p in store.registered] == [0, 1]
        assert sorted(p.name for p in learner.checkpoint_dir.iterdir()) == before
    finally:
        learner.close()


def test_space_shortfall_names_the_need_the_free_space_and_the_fixes(tmp_path, monkeypatch):
    from sandpiper.trainer import checkpoint

    usage = checkpoint.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=2e9))
    assert checkpoint.space_shortfall(tmp_path, 1.5e9, what="policy v3") is None
    why = checkpoint.space_shortfall(tmp_path, 2.0e9, what="policy v3")  # 5 % to spare
    assert why is not None and "2.00 GB" in why and "policy v3" in why
    assert "checkpoint_retention" in why and "save_train_state" in why
