"""Prefix sharing (trainer/prefix.py): a group's common prompt computed once gives the same
logprobs, loss and gradients as the unshared packing (fp32), on the tiny model and a small
Llama, with gradient checkpointing on and off, chunked or not; groups whose samples do not
all share the prompt; clustering; refusal where the mask would not be honoured."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from sandpiper.config import LearnerConfig
from sandpiper.errors import LearnerError
from sandpiper.trainer.engine import World
from sandpiper.trainer.loss import LossConfig, grpo_loss
from sandpiper.trainer.optimise import build_minibatch
from sandpiper.trainer.packing import (
    MicroBatch,
    TrainSequence,
    pack,
    pack_shared,
    packed_logprobs,
)
from sandpiper.trainer.prefix import (
    MIN_SHARED_PREFIX,
    Sharing,
    attention_tokens,
    share_clusters,
    shared_layout,
    unsupported_reason,
)

ONE = World(0, 1, torch.device("cpu"))
FREE = Sharing(max_row_tokens=10_000, attention_tokens=1e9)
"""Attention that costs nothing: every group with a prefix shares it (the equality tests)."""


def _llama(attn: str = "sdpa") -> Any:
    """A small random Llama (3 layers, GQA, untied head) with attention ``attn``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = attn
    model = LlamaForCausalLM(config)
    assert model.config._attn_implementation == attn
    return model


@pytest.fixture(scope="module")
def tiny(learner_tiny_model: Path) -> Any:
    from sandpiper.trainer.checkpoint import load_model

    return load_model(learner_tiny_model)


def _seq(
    name: str, tokens: np.ndarray, rng: np.random.Generator, *, loss_from: int,
    adv: float, temperature: float = 1.0,
) -> TrainSequence:  # fmt: skip
    mask = np.zeros(len(tokens), bool)
    mask[loss_from:] = True
    behav = np.where(mask, -6.0 + rng.normal(0, 0.3, len(tokens)), np.nan).astype(np.float32)
    return TrainSequence(name, tokens.astype(np.int32), mask, behav, adv, temperature=temperature)


def _group(
    rng: np.random.Generator, vocab: int, prompt: int, completions: Sequence[int], *,
    name: str = "g", system: np.ndarray | None = None, temperature: float = 1.0,
) -> list[TrainSequence]:  # fmt: skip
    """Samples that share a prompt (after an optional common system prompt), each with its
    own completion (the loss tokens)."""
    head = rng.integers(3, vocab, prompt)
    if system is not None:
        head = np.concatenate([system, head])
    advs = rng.normal(0, 1, len(completions))
    out = []
    for k, (n, a) in enumerate(zip(completions, advs, strict=True)):
        tokens = np.concatenate([head, rng.integers(3, vocab, n)])
        out.append(_seq(f"{name}{k}", tokens, rng, loss_from=len(head), adv=float(a),
                        temperature=temperature))  # fmt: skip
    return out


def _shared_and_plain(seqs: Sequence[TrainSequence]) -> tuple[MicroBatch, MicroBatch]:
    """One shared micro-batch of ``seqs`` (all clusters in one row) and the unshared
    packing of the same sequences in the same order."""
    pairs = [(s, 0.01 * (1 + i % 3)) for i, s in enumerate(seqs)]
    clusters = share_clusters([s.token_ids_T for s in seqs], FREE)
    shared = pack_shared(
        [[[pairs[m] for m in c.members] for c in clusters]], [[c.prefix for c in clusters]]
    )
    flat = [pairs[m] for c in clusters for m in c.members]
    plain = pack([s for s, _ in flat], [c for _, c in flat])
    return shared, plain


def _loss_and_grads(
    model: torch.nn.Module, micro: MicroBatch, chunk_tokens: int
) -> tuple[torch.Tensor, float, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    logp = packed_logprobs(model, micro, chunk_tokens=chunk_tokens)
    prox = logp.detach() + 0.01 * micro.loss_mask_T  # some ratios away from 1 (clipping)
    loss, _ = grpo_loss(
        logp, prox, micro.logp_behav_T, micro.advantages_T, micro.loss_mask_T,
        micro.token_scale_T, micro.seq_index_T, micro.num_seqs, LossConfig(),
    )  # fmt: skip
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return logp.detach(), float(loss.detach()), grads


def _assert_equal(model: torch.nn.Module, seqs: Sequence[TrainSequence], chunk: int) -> None:
    shared, plain = _shared_and_plain(seqs)
    assert torch.equal(shared.input_ids, plain.input_ids)  # the loss sees the same row
    logp_s, loss_s, grads_s = _loss_and_grads(model, shared, chunk)
    logp_p, loss_p, grads_p = _loss_and_grads(model, plain, chunk)
    assert (logp_s - logp_p).abs().max() <= 1e-5
    assert abs(loss_s - loss_p) <= 1e-5 * max(1.0, abs(loss_p))
    assert (grads_s - grads_p).abs().max() <= 1e-5 * float(grads_p.abs().max())


def _checkpointing(model: Any, on: bool) -> Any:
    model.train()
    if on:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    return model


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("chunk", [5, 1024])  # many checkpointed chunks, one chunk
def test_shared_prefix_matches_unshared_on_the_tiny_model(tiny, checkpointing, chunk) -> None:
    rng = np.random.default_rng(0)
    vocab = tiny.config.vocab_size
    system = rng.integers(3, vocab, 24)  # both tasks' prompts start with it
    seqs = _group(rng, vocab, 60, [9, 17, 1, 30], system=system, name="a")
    seqs += _group(rng, vocab, 45, [12, 5, 22], system=system, name="b", temperature=0.7)
    seqs += _group(rng, vocab, 20, [11], name="c")  # a group of one
    shared, _ = _shared_and_plain(seqs)
    assert shared.num_tokens < sum(len(s.token_ids_T) for s in seqs)  # computed once
    _assert_equal(_checkpointing(tiny, checkpointing), seqs, chunk)


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_matches_unshared_on_a_llama(attn, checkpointing) -> None:
    rng = np.random.default_rng(1)
    seqs = _group(rng, 512, 90, [14, 3, 40, 25, 8, 19, 31, 2])  # G = 8
    _assert_equal(_checkpointing(_llama(attn), checkpointing), seqs, chunk=16)


def test_the_mask_and_positions_are_what_make_it_equal(tiny) -> None:
    """Controls: continuations that see each other, or positions restarting at 0 after the
    prefix, change the logprobs (the equality tests above can fail)."""
    from dataclasses import replace

    rng = np.random.default_rng(7)
    shared, plain = _shared_and_plain(_group(rng, tiny.config.vocab_size, 30, [20, 25]))
    layout = shared.shared
    assert layout is not None
    n = layout.input_ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool).tril()[None, None]
    restarted = layout.position_ids.clone()
    restarted[0, 30:] -= 30
    tiny.eval()
    with torch.no_grad():
        want = packed_logprobs(tiny, plain)
        assert (packed_logprobs(tiny, shared) - want).abs().max() <= 1e-5
        for broken in (replace(layout, attention_mask=causal),
                       replace(layout, position_ids=restarted)):  # fmt: skip
            got = packed_logprobs(tiny, replace(shared, shared=broken))
            assert (got - want).abs().max() > 1e-3


def test_a_sample_shorter_than_the_prompt_and_identical_samples(tiny) -> None:
    rng = np.random.default_rng(2)
    vocab = tiny.config.vocab_size
    seqs = _group(rng, vocab, 50, [10, 20, 15])
    head = seqs[0].token_ids_T[:50]
    # cut inside the prompt (a truncated sample): the group shares its first 30 tokens
    seqs.append(_seq("short", head[:30].copy(), rng, loss_from=20, adv=0.5))
    seqs.append(_seq("same", seqs[1].token_ids_T.copy(), rng, loss_from=50, adv=-0.3))
    clusters = share_clusters([s.token_ids_T for s in seqs], FREE)
    assert [(len(c.members), c.prefix) for c in clusters] == [(5, 30)]
    _assert_equal(_checkpointing(tiny, False), seqs, chunk=1024)


def test_no_common_prefix_falls_back_to_plain_packing(tiny) -> None:
    rng = np.random.default_rng(3)
    vocab = tiny.config.vocab_size
    seqs = [
        _seq(f"e{n}", rng.integers(3, vocab, n), rng, loss_from=n // 2, adv=1.0)
        for n in (30, 41, 17)
    ]
    seqs[1] = _seq("e41", np.concatenate([seqs[0].token_ids_T[:5], seqs[1].token_ids_T[5:]]),
                   rng, loss_from=20, adv=-1.0)  # fmt: skip
    clusters = share_clusters([s.token_ids_T for s in seqs], FREE)
    assert all(len(c.members) == 1 for c in clusters)  # 5 common tokens: not worth it
    shared, plain = _shared_and_plain(seqs)
    assert shared.num_tokens == plain.num_tokens
    _assert_equal(_checkpointing(tiny, False), seqs, chunk=1024)


def test_build_minibatch_gives_the_same_loss_and_gradient(tiny) -> None:
    """The learner's path: several micro-batches (a group too big for one splits), scales
    over the whole minibatch; summed loss and gradient equal to the unshared packing."""
    rng = np.random.default_rng(4)
    vocab = tiny.config.vocab_size
    seqs = _group(rng, vocab, 70, [12, 30, 7, 21, 16, 9, 25, 4], name="a")
    seqs += _group(rng, vocab, 40, [33, 8, 14, 27, 19, 5, 11, 22], name="b")
    cfg = LearnerConfig(micro_batch_tokens=160)
    model = _checkpointing(tiny, False)
    results = []
    for sharing in (None, Sharing(160, attention_tokens(tiny.config))):
        micros = build_minibatch(seqs, learner_cfg=cfg, world=ONE, sharing=sharing)
        model.zero_grad(set_to_none=True)
        total, forward = 0.0, 0
        for micro in micros:
            _, loss, _ = _loss_and_grads_accumulate(model, micro)
            total += loss
            forward += micro.num_tokens
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((total, grads, forward, len(micros)))
    (loss_p, grads_p, fwd_p, n_p), (loss_s, grads_s, fwd_s, n_s) = results
    assert fwd_s < 0.6 * fwd_p and n_s <= n_p
    assert abs(loss_s - loss_p) <= 1e-5 * max(1.0, abs(loss_p))
    assert (grads_s - grads_p).abs().max() <= 1e-5 * float(grads_p.abs().max())


def _loss_and_grads_accumulate(model: torch.nn.Module, micro: MicroBatch):
    logp = packed_logprobs(model, micro, chunk_tokens=64)
    loss, stats = grpo_loss(
        logp, logp.detach(), micro.logp_behav_T, micro.advantages_T, micro.loss_mask_T,
        micro.token_scale_T, micro.seq_index_T, micro.num_seqs, LossConfig(),
    )  # fmt: skip
    loss.backward()
    return logp, float(loss.detach()), stats


def test_clusters_partition_the_sequences_and_fit_the_budget() -> None:
    rng = np.random.default_rng(5)
    prompt = rng.integers(3, 100, 40)
    tokens = [np.concatenate([prompt, rng.integers(3, 100, 10)]) for _ in range(8)]
    tokens += [rng.integers(3, 100, 30) for _ in range(3)]
    clusters = share_clusters(tokens, Sharing(max_row_tokens=100, attention_tokens=1e9))
    assert sorted(m for c in clusters for m in c.members) == list(range(11))
    assert all(c.tokens <= 100 or len(c.members) == 1 for c in clusters)
    shared = [c for c in clusters if len(c.members) > 1]
    # 40 + 10 k <= 100: at most 6 continuations with one copy of the prompt
    assert sorted(len(c.members) for c in shared) == [2, 6]
    assert all(c.prefix == 40 for c in shared)
    assert MIN_SHARED_PREFIX > 5  # the fall-back test relies on it


def test_a_cluster_counts_its_tokens_when_its_prefix_shrinks() -> None:
    rng = np.random.default_rng(8)
    head = rng.integers(3, 100, 40)
    tokens = [np.concatenate([head, rng.integers(3, 100, n)]) for n in (5, 7)]
    tokens.append(np.concatenate([head[:25], rng.integers(3, 100, 9)]))
    [cluster] = share_clusters(tokens, FREE)
    assert cluster.prefix == 25 and cluster.tokens == 25 + 20 + 22 + 9
    layout = shared_layout([[(tokens, cluster.prefix)]], "cpu")
    assert layout.input_ids.shape == (1, cluster.tokens)


def test_clusters_form_only_where_sharing_is_cheaper() -> None:
    """The tiny model's attention costs a token as much as its other layers at 768 tokens a
    row: a long agent prompt with short completions is shared, a short prompt with long
    completions is not (its shared row's attention would cost more than the prompt saves),
    and another task's samples that share only a system prompt stay apart."""
    from transformers import Qwen2Config

    from sandpiper.models.tiny import MODEL_SHAPE

    k = attention_tokens(Qwen2Config(**MODEL_SHAPE))
    assert k == 768
    tiny = Sharing(max_row_tokens=4096, attention_tokens=k)
    rng = np.random.default_rng(9)
    system = rng.integers(3, 2000, 600)

    def group(prompt: int, completion: int) -> list[np.ndarray]:
        head = np.concatenate([system, rng.integers(3, 2000, prompt)])
        return [np.concatenate([head, rng.integers(3, 2000, completion)]) for _ in range(8)]

    agent = share_clusters(group(200, 100) + group(150, 120), tiny)
    assert sorted((len(c.members), c.prefix) for c in agent) == [(8, 750), (8, 800)]
    long_tail = share_clusters([t[580:] for t in group(0, 500)], tiny)  # 20 common tokens
    assert all(len(c.members) == 1 for c in long_tail)


def test_sharing_refuses_a_model_that_would_ignore_the_mask() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from sandpiper.trainer.logprobs import CHUNKED_ARCHITECTURES
    from sandpiper.trainer.prefix import SHARED_ARCHITECTURES

    assert SHARED_ARCHITECTURES <= CHUNKED_ARCHITECTURES  # the shared path scores in chunks
    assert unsupported_reason(_llama()) is None
    flash = _llama()
    flash.config._attn_implementation = "flash_attention_2"
    assert "flash_attention_2" in (unsupported_reason(flash) or "")
    sliding = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, use_sliding_window=True, sliding_window=8,
        max_window_layers=0,
    ))  # fmt: skip
    assert "sliding" in (unsupported_reason(sliding) or "")
    rng = np.random.default_rng(6)
    shared, _ = _shared_and_plain(_group(rng, 64, 20, [4, 5]))
    with pytest.raises(LearnerError, match="share_prefix"):
        packed_logprobs(flash, shared)
