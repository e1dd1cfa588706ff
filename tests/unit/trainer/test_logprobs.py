"""Selected-token logprobs without full-vocabulary logits: equal to the full computation
(values and gradients, fp32), chunked or not, with temperature; the fallback for
architectures that scale their logits; the memory it saves."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from sandpiper.trainer.logprobs import selected_logprobs, supports_chunked
from sandpiper.trainer.packing import MicroBatch, TrainSequence, pack, packed_logprobs

VOCAB = 1000
ROOT = Path(__file__).resolve().parents[3]


def _learner_memory():
    spec = importlib.util.spec_from_file_location(
        "learner_memory", ROOT / "bench/learner_memory.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _qwen2(vocab: int = VOCAB) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def _micro(vocab: int = VOCAB, temperature: float = 1.0) -> MicroBatch:
    rng = np.random.default_rng(0)
    seqs = []
    for n in (37, 11, 60, 23):
        mask = np.zeros(n, bool)
        mask[n // 3 :] = True
        seqs.append(TrainSequence(
            f"e{n}", rng.integers(1, vocab, n).astype(np.int32), mask,
            np.where(mask, -1.0, np.nan).astype(np.float32), 1.0, temperature=temperature,
        ))  # fmt: skip
    return pack(seqs, [1.0] * len(seqs))


def full_logits_reference(model: torch.nn.Module, micro: MicroBatch) -> torch.Tensor:
    """The learner's computation before chunking, verbatim: full (tokens x V) logits."""
    out = model(
        input_ids=micro.input_ids, position_ids=micro.position_ids, attention_mask=None,
        use_cache=False,
    )  # fmt: skip
    logits = out.logits[:, :-1]
    targets = micro.input_ids[:, 1:]
    needed = micro.loss_mask_T.view(micro.input_ids.shape)[:, 1:]
    picked = -F.cross_entropy(logits[needed].float(), targets[needed], reduction="none")
    next_logp = torch.zeros(targets.shape, dtype=picked.dtype, device=picked.device)
    next_logp = next_logp.masked_scatter(needed, picked)
    logp = torch.cat([next_logp.new_zeros(next_logp.shape[0], 1), next_logp], dim=1)
    return logp.reshape(-1)


def _grads(model: torch.nn.Module, logp_T: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    weights = torch.linspace(-1.0, 1.0, logp_T.numel())  # an arbitrary loss of every token
    (logp_T * weights * micro.loss_mask_T).sum().backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("chunk_tokens", [7, 1024])  # many chunks (checkpointed), one chunk
def test_chunked_equals_full_logits_and_its_gradient(chunk_tokens: int) -> None:
    model, micro = _qwen2(), _micro()
    assert supports_chunked(model)
    ref = full_logits_reference(model, micro)
    ref_grad = _grads(model, ref, micro)
    got = packed_logprobs(model, micro, chunk_tokens=chunk_tokens)
    got_grad = _grads(model, got, micro)
    assert (got[~micro.loss_mask_T] == 0).all()
    assert (got - ref).abs().max() <= 1e-6
    assert (got_grad - ref_grad).abs().max() <= 1e-6 * max(1.0, float(ref_grad.abs().max()))
    # the test can fail: a shifted target (off by one position) is far off
    wrong = torch.roll(got, 1)
    assert (wrong - ref).abs().max() > 1e-2


def test_no_grad_chunks_match() -> None:
    model, micro = _qwen2(), _micro()
    with torch.no_grad():
        many = packed_logprobs(model, micro, chunk_tokens=5)
        one = packed_logprobs(model, micro, chunk_tokens=10_000)
    assert (many - one).abs().max() <= 1e-6


def test_temperature_divides_the_logits() -> None:
    model, micro = _qwen2(), _micro(temperature=0.7)
    assert micro.temperature_T is not None
    with torch.no_grad():
        got = packed_logprobs(model, micro, chunk_tokens=9)
        logits = model(
            input_ids=micro.input_ids, position_ids=micro.position_ids, use_cache=False
        ).logits[0, :-1]
        plain = torch.log_softmax(logits / 0.7, -1).gather(1, micro.input_ids[0, 1:, None])[:, 0]
    mask = micro.loss_mask_T[1:]
    assert (got[1:][mask] - plain[mask]).abs().max() <= 1e-5
    assert _micro().temperature_T is None  # temperature 1: no division at all


def test_selected_logprobs_gradient_wrt_hidden_states() -> None:
    torch.manual_seed(1)
    head = torch.nn.Linear(16, 300, bias=False)
    hidden = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 300, (50,))
    ref = torch.log_softmax(head(hidden), -1).gather(1, targets[:, None])[:, 0]
    (g_ref,) = torch.autograd.grad(ref.sum(), hidden)
    got = selected_logprobs(head, hidden, targets, chunk_tokens=8)
    (g_got,) = torch.autograd.grad(got.sum(), hidden)
    assert (got - ref).abs().max() <= 1e-6
    assert (g_got - g_ref).abs().max() <= 1e-6


def test_architecture_with_logit_softcapping_gets_full_logits() -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, final_logit_softcapping=2.0,
    )  # fmt: skip
    model = Gemma2ForCausalLM(config).eval()
    assert not supports_chunked(model)
    micro = _micro()
    with torch.no_grad():
        got = packed_logprobs(model, micro, chunk_tokens=7)
        ref = full_logits_reference(model, micro)
    assert (got - ref).abs().max() <= 1e-6


@pytest.mark.slow
@pytest.mark.long
def test_chunked_logprob_step_peak_memory_is_4x_lower_at_smollm2_vocab() -> None:
    """SmolLM2's output layer (V = 49,152), 8,192 loss tokens, forward and backward: the
    chunked step's peak resident growth is at least 4x below the full-logits step's."""
    result = _learner_memory().logprob_peak_mem_ratio(tokens=8192, chunk_tokens=1024)
    assert result["logprob_peak_mem_ratio"] >= 4.0, result


def test_temperature_scoring_matches_trls_own_logprob_code() -> None:
    """TRL 1.16 scores completions at its sampling ``temperature`` (``add_fused_lm_head``
    divides the logits by it; ``GRPOTrainer._get_per_token_logps_and_entropies`` runs it):
    the learner's logprobs of sequences sampled at 0.7 agree with TRL's, and so do their
    gradients."""
    import contextlib
    import copy
    import types

    pytest.importorskip("trl")
    from trl import GRPOTrainer
    from trl.trainer.utils import add_fused_lm_head

    ours_model = _qwen2()
    trl_model = copy.deepcopy(ours_model)
    add_fused_lm_head(trl_model, temperature=0.7)
    accelerator = types.SimpleNamespace(autocast=contextlib.nullcontext, is_main_process=True)
    stub = types.SimpleNamespace(accelerator=accelerator)
    rng = np.random.default_rng(3)
    for prompt, completion in ((5, 9), (12, 30)):
        ids = rng.integers(1, VOCAB, prompt + completion).astype(np.int32)
        mask = np.r_[np.zeros(prompt, bool), np.ones(completion, bool)]
        seq = TrainSequence("e", ids, mask, np.where(mask, -1.0, np.nan).astype(np.float32),
                            1.0, temperature=0.7)  # fmt: skip
        ours = packed_logprobs(ours_model, pack([seq], [1.0]), chunk_tokens=8)[prompt:]
        input_ids = torch.from_numpy(ids.astype(np.int64))[None]
        theirs, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            stub, trl_model, input_ids, torch.ones_like(input_ids), completion
        )
        assert (ours - theirs[0]).abs().max() <= 1e-5
        ours_model.zero_grad(), trl_model.zero_grad()
        ours.sum().backward()
        theirs.sum().backward()
        for a, b in zip(ours_model.parameters(), trl_model.parameters(), strict=True):
            assert (a.grad - b.grad).abs().max() <= 1e-5
    # the test can fail: at temperature 1 the learner's logprobs are not TRL's at 0.7
    seq1 = TrainSequence("e", ids, mask, seq.behaviour_logprobs_T, 1.0)
    with torch.no_grad():
        raw = packed_logprobs(ours_model, pack([seq1], [1.0]))[prompt:]
    assert (raw - theirs[0].detach()).abs().max() > 1e-2
