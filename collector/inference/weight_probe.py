"""A vLLM worker extension that reports what a server holds, for tests and for checking a
GPU deployment: ``--worker-extension-cls sandpiper.collector.inference.weight_probe.WeightProbe``
(with ``VLLM_SERVER_DEV_MODE=1``), then ``POST /collective_rpc {"method": "weight_checksums"}``.

Each worker answers checksums of its input embedding and output layer (its shard under
tensor parallelism) and whether the two are one tensor: after an in-place reload they must
equal the learner's checkpoint, each its own. Only launch lines that name it load it; the
shipped ones do not."""

from __future__ import annotations

from typing import Any


def checksums(weight: Any) -> list[float]:
    """``[sum, sum of squares, sum weighted by position]`` in float64 (the last one catches
    rows swapped or copied over each other)."""
    import torch

    w = weight.detach().to("cpu", torch.float64).flatten()
    ramp = torch.arange(1, w.numel() + 1, dtype=torch.float64) / w.numel()
    return [float(w.sum()), float((w * w).sum()), float((w * ramp).sum())]


class WeightProbe:
    """Mixed into vLLM's worker (which provides ``model_runner``)."""

    model_runner: Any

    def weight_checksums(self) -> dict[str, Any]:
        model = self.model_runner.model
        # vLLM's decoder models keep the embedding at model.embed_tokens (Llama, Qwen2/3)
        embedding = model.model.embed_tokens.weight
        output = model.lm_head.weight
        return {
            "embedding": checksums(embedding),
            "lm_head": checksums(output),
            "shared": embedding.data_ptr() == output.data_ptr(),
        }
