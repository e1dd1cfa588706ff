"""The tiny model builder: determinism, shape limits, tokenizer and chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandpiper.models.tiny import SPECIAL_TOKENS, TOOL_TOKENS, count_parameters, init_tiny_model

CPU_HEAD_SIZES = {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "execute_bash",
            "description": "Run a bash command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    }
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "a": init_tiny_model(root / "a", seed=0),
        "b": init_tiny_model(root / "b", seed=0),
        "c": init_tiny_model(root / "c", seed=1),
    }


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


def test_same_seed_gives_byte_identical_files(model_dirs: dict[str, Path]) -> None:
    a, b = _files(model_dirs["a"]), _files(model_dirs["b"])
    assert {"model.safetensors", "tokenizer.json", "config.json"} <= a.keys()
    assert a == b


def test_other_seed_changes_weights_not_tokenizer(model_dirs: dict[str, Path]) -> None:
    a, c = _files(model_dirs["a"]), _files(model_dirs["c"])
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]


def test_model_shape_fits_cpu_vllm(model_dirs: dict[str, Path]) -> None:
    config = json.loads((model_dirs["a"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["head_dim"] in CPU_HEAD_SIZES
    assert config["hidden_size"] // config["num_attention_heads"] == config["head_dim"]
    assert config["tie_word_embeddings"] is False
    assert 2000 <= config["vocab_size"] <= 4096
    assert 500_000 <= count_parameters(model_dirs["a"]) <= 3_000_000


def test_loads_in_transformers_untied_float32(model_dirs: dict[str, Path]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dirs["a"])
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["a"])
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert len(tokenizer) == model.config.vocab_size
    ids = tokenizer("def add(x, y):\n    return x + y", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_tokenizer_json_and_transformers_split_identically(model_dirs: dict[str, Path]) -> None:
    """AutoTokenizer rebuilds Qwen2's pre-tokenizer; it must match what tokenizer.json says."""
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    raw = Tokenizer.from_file(str(model_dirs["a"] / "tokenizer.json"))
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["a"])
    text = "Hello  world!\n\n  x = [1, 22, 333]  # ünïcödé 😀\n<tool_call>\n{}\n</tool_call>"
    assert raw.encode(text).ids == tokenizer.encode(text)
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_markup_tokens_are_single_ids(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["a"])
    for token in (*SPECIAL_TOKENS, *TOOL_TOKENS):
        assert len(tokenizer.encode(token)) == 1, token
    text = "<|im_start|>assistant\n<tool_call>\n{}\n</tool_call><|im_end|>"
    decoded = tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True)
    # control tokens are dropped, tool markup survives for the tool-call parser
    assert decoded == "assistant\n<tool_call>\n{}\n</tool_call>"


def test_chat_template_renders_tools_calls_and_responses(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["a"])
    call = {
        "type": "function",
        "function": {"name": "execute_bash", "arguments": {"command": "ls"}},
    }
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "List files."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "a.txt"},
        {"role": "tool", "content": "b.txt"},
    ]
    text = tokenizer.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0]) + "\n</tools>" in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "execute_bash", "arguments": '
        '{"command": "ls"}}\n</tool_call><|im_end|>\n'
    ) in text
    assert (
        "<|im_start|>user\n<tool_response>\na.txt\n</tool_response>\n"
        "<tool_response>\nb.txt\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_template_without_tools_and_string_arguments(model_dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dirs["a"])
    plain = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=False
    )
    assert plain == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    call = {"function": {"name": "submit", "arguments": '{"answer": "4"}'}}
    text = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "Sure.", "tool_calls": [call]},
        ],
        tokenize=False,
    )
    assert (
        'Sure.\n<tool_call>\n{"name": "submit", "arguments": {"answer": "4"}}\n</tool_call>' in text
    )


def test_cli_init_tiny_passes_the_seed(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from sandpiper.cli import app

    result = CliRunner().invoke(app, ["model", "init-tiny", str(tmp_path / "m"), "--seed", "1"])
    assert result.exit_code == 0, result.output
    assert "parameters, seed 1" in result.output
    assert _files(tmp_path / "m") == _files(model_dirs["c"])
