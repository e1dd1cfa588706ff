"""One :class:`SamplingLimits` per run: read from the config once, handed unchanged to the
episode loop, the policy, the gateway and the stored record."""

from __future__ import annotations

import dataclasses

from sandpiper.collector.gateway.server import GATEWAY_MODEL_NAME, GatewaySettings
from sandpiper.config import RunConfig, SamplingLimits
from sandpiper.store.records import GroupSampling

NON_DEFAULT = {
    "collector": {
        "max_turns": 3, "max_tokens_per_turn": 17, "max_episode_tokens": 99,
        "temperature": 0.5, "top_p": 0.9, "tool_parser": "bash_block",
        "max_argument_bytes": 4096, "system_prompt": "Be terse.", "gateway_sampling": "client",
    },
    "inference": {"max_model_len": 4096},
    "learner": {"algo": "sft"},  # GRPO refuses top_p < 1 (config/checks.py: check_scoring)
}  # fmt: skip


def test_every_limit_is_read_from_the_config():
    """A field that :meth:`SamplingLimits.from_config` forgot would keep its default."""
    limits = RunConfig.model_validate(NON_DEFAULT).for_collector().sampling
    default = SamplingLimits()
    for field in dataclasses.fields(SamplingLimits):
        assert getattr(limits, field.name) != getattr(default, field.name), field.name
    assert limits.context_limit == 4096 and limits.tool_format == "bash_block"


def test_the_defaults_are_the_configs():
    assert RunConfig().for_collector().sampling == SamplingLimits()


def test_the_gateway_and_the_record_take_the_same_limits():
    limits = RunConfig.model_validate(NON_DEFAULT).for_collector().sampling
    gateway = GatewaySettings.for_run(limits, run_id="r")
    assert gateway.sampling is limits and gateway.model_names == (GATEWAY_MODEL_NAME, "r")
    record = GroupSampling.from_limits(limits)
    for name in ("temperature", "top_p", "max_tokens_per_turn", "max_turns",
                 "max_episode_tokens", "context_limit", "tool_format"):  # fmt: skip
        assert getattr(record, name) == getattr(limits, name), name
    assert record.endpoint is None and record.model is None
    assert GroupSampling.from_json(record.to_json()) == record
