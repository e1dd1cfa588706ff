"""(c) Packed and unpacked logprobs agree; micro-batch planning and loss normalisers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from sandpiper.trainer.packing import (
    TrainSequence,
    pack,
    packed_logprobs,
    plan_micro_batches,
    token_scales,
)


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def _seq(rng: np.random.Generator, n: int, adv: float = 1.0, prompt: int = -1) -> TrainSequence:
    """A sequence whose first ``prompt`` tokens (default: half) are not in the loss."""
    mask = np.zeros(n, bool)
    mask[n // 2 if prompt < 0 else prompt :] = True
    return TrainSequence(
        f"e{n}", rng.integers(1, 96, n).astype(np.int32), mask,
        np.where(mask, -1.0, np.nan).astype(np.float32), adv,
    )  # fmt: skip


def test_packed_logprobs_match_one_sequence_at_a_time(model) -> None:
    rng = np.random.default_rng(0)
    seqs = [_seq(rng, n, prompt=1) for n in (17, 5, 40, 9)]  # every predictable token
    with torch.no_grad():
        packed = packed_logprobs(model, pack(seqs, [1.0] * len(seqs)))
        alone = torch.cat([packed_logprobs(model, pack([s], [1.0])) for s in seqs])
        # Reference without packing machinery: a plain forward of each sequence.
        ids = torch.from_numpy(seqs[2].token_ids_T.astype(np.int64))[None]
        logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
        plain = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(packed, alone, atol=1e-5), (packed - alone).abs().max()
    start = 17 + 5
    assert torch.allclose(packed[start + 1 : start + 40], plain, atol=1e-5)
    # Without restarting positions the packed result would differ (the test can fail).
    micro = pack(seqs, [1.0] * len(seqs))
    wrong = model(input_ids=micro.input_ids, use_cache=False).logits[0, start : start + 39]
    wrong = torch.log_softmax(wrong, -1).gather(1, micro.input_ids[0, start + 1 :][:39, None])
    assert not torch.allclose(wrong[:, 0], plain, atol=1e-3)


def test_pack_masks_sequence_starts_and_broadcasts_per_sequence_values() -> None:
    rng = np.random.default_rng(1)
    a, b = _seq(rng, 4, adv=0.5), _seq(rng, 3, adv=-2.0)
    b.loss_mask_T[0] = True  # a first token can never be predicted: pack must drop it
    micro = pack([a, b], [0.1, 0.2])
    assert micro.position_ids[0].tolist() == [0, 1, 2, 3, 0, 1, 2]
    assert micro.loss_mask_T.tolist() == [False, False, True, True, False, True, True]
    assert micro.advantages_T.tolist() == [0.5] * 4 + [-2.0] * 3
    assert torch.isfinite(micro.logp_behav_T).all()
    assert micro.token_scale_T.tolist() == pytest.approx([0.1] * 4 + [0.2] * 3)


def test_plan_micro_batches_respects_budget_and_keeps_every_sequence() -> None:
    lengths = [700, 300, 500, 100, 1200, 50]
    bins = plan_micro_batches(lengths, 1000)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    for b in bins:
        assert len(b) == 1 or sum(lengths[i] for i in b) <= 1000
    assert len(bins) == 3  # 1200 | 700+300 | 500+100+50


def test_token_scales_sum_to_the_right_mean() -> None:
    rng = np.random.default_rng(2)
    seqs = [_seq(rng, n) for n in (10, 20)]  # 5 and 10 loss tokens
    tok = token_scales(seqs, mode="token_mean", total_loss_tokens=15, total_seqs=2, constant=1)
    assert sum(c * s.loss_tokens for c, s in zip(tok, seqs, strict=True)) == pytest.approx(1.0)
    seq = token_scales(seqs, mode="sequence_mean", total_loss_tokens=15, total_seqs=2, constant=1)
    assert [c * s.loss_tokens for c, s in zip(seq, seqs, strict=True)] == pytest.approx([0.5] * 2)
    const = token_scales(seqs, mode="constant", total_loss_tokens=15, total_seqs=2, constant=64)
    assert const == pytest.approx([1 / 128] * 2)


def test_rows_of_a_micro_batch_match_one_row(model) -> None:
    from sandpiper.trainer.packing import pack_rows, plan_rows

    rng = np.random.default_rng(3)
    seqs = [_seq(rng, n, prompt=1) for n in (30, 12, 7, 25, 18, 3)]
    plan = plan_rows([len(s.token_ids_T) for s in seqs], max_tokens=60)
    assert all(len(rows) <= 2 for rows in plan)  # rows of 30 tokens, 2 per micro-batch
    assert sorted(i for rows in plan for row in rows for i in row) == list(range(6))
    got = {}
    with torch.no_grad():
        for rows in plan:
            micro = pack_rows([[(seqs[i], 1.0) for i in row] for row in rows])
            assert micro.input_ids.shape[1] == 30
            logp = packed_logprobs(model, micro)
            padding = micro.input_ids.reshape(-1) == 0
            assert not micro.loss_mask_T[padding].any()
            for r, row in enumerate(rows):
                offset = r * 30
                for i in row:
                    n = len(seqs[i].token_ids_T)
                    got[i] = logp[offset : offset + n]
                    offset += n
        for i, s in enumerate(seqs):
            alone = packed_logprobs(model, pack([s], [1.0]))
            assert torch.allclose(got[i], alone, atol=1e-5), i
