"""``trainer.replay`` without a store: variant parsing, and one replayed step on a small random
model checked against a straightforward recomputation (whole-batch gradient, explicit
per-micro-batch variance)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from sandpiper.config import LearnerConfig
from sandpiper.errors import ConfigError
from sandpiper.store.records import TrainEpisode, TrainGroup
from sandpiper.trainer import replay as rp
from sandpiper.trainer.loss import LossConfig, grpo_loss
from sandpiper.trainer.packing import pack, packed_logprobs, token_scales


def test_default_variants_parse_and_the_reference_is_untruncated() -> None:
    base = LearnerConfig(is_cap=3.0, loss_agg="sequence_mean")
    names = [rp.parse_variant(v, base).name for v in rp.DEFAULT_VARIANTS]
    assert len(set(names)) == len(names) and rp.REFERENCE not in names
    ref = rp.reference_variant(base).learner
    assert (ref.is_mode, ref.is_level, ref.objective) == ("truncate", "token", "ppo")
    assert math.isinf(ref.is_cap) and ref.loss_agg == "sequence_mean"
    v = rp.parse_variant("g: objective='gspo' eps_low=3e-4 reject_hi=0.5", base)
    assert (v.learner.objective, v.learner.eps_low, v.learner.reject_hi) == ("gspo", 3e-4, 0.5)
    assert v.overrides == {"objective": "gspo", "eps_low": 3e-4, "reject_hi": 0.5}


@pytest.mark.parametrize(
    ("spec", "says"),
    [
        ("no colon", "expected 'name:"),
        ("bad name!: is_cap=2", "expected 'name:"),
        ("x: lr=1.0", "is not field=value"),
        ("x: is_cap", "is not field=value"),
        ("x: objective='sgd'", "variant 'x'"),
    ],
)
def test_bad_variants_are_clear_errors(spec, says) -> None:
    with pytest.raises(ConfigError, match=says):
        rp.parse_variant(spec, LearnerConfig())


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def _groups(model, noise: float) -> list[TrainGroup]:
    """Two groups of four 9-token episodes; behaviour logprobs = the model's + noise."""
    rng = np.random.default_rng(1)
    groups = []
    for g in range(2):
        episodes = []
        for i in range(4):
            ids = rng.integers(1, 64, 9).astype(np.int32)
            mask = np.zeros(9, bool)
            mask[4:] = True
            with torch.no_grad():
                logits = model(input_ids=torch.tensor(ids[None]).long()).logits[0, :-1]
                lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:, None]).long())
            behav = np.full(9, np.nan, np.float32)
            behav[1:] = lp[:, 0].numpy() + rng.normal(0, noise, 8)
            behav[~mask] = np.nan
            versions = np.where(mask, 0, -1).astype(np.int32)
            episodes.append(TrainEpisode(f"e{g}{i}", float(i % 2 + g * 0.1 * i), True, ids,
                                         mask, behav, versions))  # fmt: skip
        groups.append(TrainGroup(f"g{g}", "t", 0, tuple(episodes)))
    return groups


def _flat_grad(model, loss) -> torch.Tensor:
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, retain_graph=True)
    return torch.cat([g.reshape(-1).double() for g in grads])


def test_replayed_step_matches_a_straightforward_recomputation(model) -> None:
    base = LearnerConfig(loss_agg="token_mean")
    variants = [rp.reference_variant(base), rp.parse_variant("none: is_mode='none'", base),
                rp.parse_variant("tis: is_cap=1.05", base)]  # fmt: skip
    groups = _groups(model, noise=0.3)
    rows = {r["variant"]: r for r in rp.replay_step(model, groups, 0, variants,
                                                    micro_batch_tokens=18)}  # fmt: skip
    assert rows["reference"]["micro_batches"] == 4  # 8 sequences of 9 tokens, 2 per pass

    # Whole batch in one pass and one micro-batch per sequence pair, computed directly.
    seqs = rp.sequences(groups, base, 0)
    scales = token_scales(seqs, mode="token_mean", total_loss_tokens=sum(s.loss_tokens for s in seqs),
                          total_seqs=len(seqs), constant=1.0)  # fmt: skip

    def gradient(cfg: LossConfig, part) -> torch.Tensor:
        micro = pack([seqs[i] for i in part], [scales[i] for i in part])
        logp = packed_logprobs(model, micro)
        loss, _ = grpo_loss(logp, logp.detach(), micro.logp_behav_T, micro.advantages_T,
                            micro.loss_mask_T, micro.token_scale_T, micro.seq_index_T,
                            micro.num_seqs, cfg)  # fmt: skip
        return _flat_grad(model, loss)

    everything = list(range(len(seqs)))
    ref = gradient(LossConfig.from_learner(variants[0].learner), everything)
    for v in variants:
        cfg = LossConfig.from_learner(v.learner)
        total = gradient(cfg, everything)
        row = rows[v.name]
        assert row["grad_norm"] == pytest.approx(float(total.norm()), rel=1e-5)
        cos = float(total @ ref) / float(total.norm() * ref.norm())
        assert row["cos_ref"] == pytest.approx(cos, abs=1e-6)
    assert rows["none"]["cos_ref"] < 0.9999 and rows["tis"]["truncated_frac"] > 0

    # The variance, written out: (1/M) sum_j |M g_j - G|^2 over the learner's micro-batches.
    cfg = LossConfig.from_learner(variants[0].learner)
    gs = []
    for m in rp.pack_step(seqs, variants[0].learner, 18):
        logp = packed_logprobs(model, m)
        loss, _ = grpo_loss(logp, logp.detach(), m.logp_behav_T, m.advantages_T, m.loss_mask_T,
                            m.token_scale_T, m.seq_index_T, m.num_seqs, cfg)  # fmt: skip
        gs.append(_flat_grad(model, loss))
    big = sum(gs)
    var = sum(float(((len(gs) * g - big) ** 2).sum()) for g in gs) / len(gs)
    assert rows["reference"]["grad_var"] == pytest.approx(var, rel=1e-4)
    assert rows["reference"]["grad_norm"] == pytest.approx(float(ref.norm()), rel=1e-5)


def test_on_policy_step_makes_every_variant_agree(model) -> None:
    base = LearnerConfig()
    variants = [rp.reference_variant(base)] + [
        rp.parse_variant(v, base)
        for v in rp.DEFAULT_VARIANTS
        if not v.startswith(("gspo", "batch"))
    ]
    rows = rp.replay_step(model, _groups(model, noise=0.0), 0, variants, micro_batch_tokens=18)
    for r in rows:
        assert r["cos_ref"] == pytest.approx(1.0, abs=1e-5), r["variant"]
        assert r["masked_frac"] == 0.0 and r["ess"] == pytest.approx(1.0, abs=1e-5)
