"""The rules across config fields (sandpiper/config/checks.py): each refuses what it should,
in one line naming the field, its value and what is allowed, and lets the rest through; every
config the project ships (configs/*.toml and the demo's derived configs) passes them."""

from __future__ import annotations

from pathlib import Path

import pytest

from sandpiper.config import RunConfig, load_config
from sandpiper.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as refused:
        load_config(None, list(overrides))
    message = str(refused.value)
    assert "\n" not in message, message
    return message


def test_grpo_needs_two_samples_per_group_sft_takes_one() -> None:
    message = _refused("--collector.group_size", "1")
    assert message.startswith("override --collector.group_size: collector.group_size = 1: ")
    assert 'learner.algo = "grpo" needs >= 2' in message
    cfg = load_config(None, ["--collector.group_size", "1", "--learner.algo", "sft"])
    assert cfg.collector.group_size == 1


@pytest.mark.parametrize("objective", ["ppo", "gspo"])
@pytest.mark.parametrize("field", ["eps_low", "eps_high"])
def test_ppo_and_gspo_need_a_clip_range_with_width(objective: str, field: str) -> None:
    message = _refused("--learner.objective", f'"{objective}"', f"--learner.{field}", "0")
    assert f"learner.{field} = 0" in message and f"objective = '{objective}' needs" in message


def test_cispo_takes_a_zero_clip_and_no_lower_bound() -> None:
    cfg = load_config(None, ["--learner.objective", "cispo", "--learner.eps_low", "0",
                             "--learner.eps_high", "0"])  # fmt: skip
    assert cfg.learner.eps_low == 0
    assert load_config(None, ["--learner.objective", "cispo", "--learner.eps_low", "1"])
    assert "learner.eps_low = 1.5: must be <= 1" in _refused("--learner.eps_low", "1.5")


def test_token_budgets_nest() -> None:
    message = _refused("--collector.max_tokens_per_turn", "4096")
    assert "collector.max_tokens_per_turn = 4096: must be <= max_episode_tokens = 2048" in message
    message = _refused("--collector.max_episode_tokens", "4096")
    assert "collector.max_episode_tokens = 4096: must be <= inference.max_model_len = 2048" in (
        message
    )
    fine = ["--collector.max_tokens_per_turn", "64", "--collector.max_episode_tokens", "64",
            "--inference.max_model_len", "64", "--learner.micro_batch_tokens", "64"]  # fmt: skip
    assert load_config(None, fine).inference.max_model_len == 64


def test_a_micro_batch_holds_a_whole_sequence() -> None:
    message = _refused("--learner.micro_batch_tokens", "1024")
    assert "learner.micro_batch_tokens = 1024: must be >= inference.max_model_len = 2048" in (
        message
    )


def test_grpo_scores_tokens_as_they_were_sampled() -> None:
    """Raw sampling logprobs are before temperature: GRPO at another temperature needs the
    processed ones (the learner then divides by it); top-p's nucleus is never reproduced."""
    message = _refused("--collector.temperature", "0.7")
    assert "collector.temperature = 0.7: " in message and "processed_logprobs" in message
    cfg = load_config(None, ["--collector.temperature", "0.7",
                             "--inference.logprobs_mode", "processed_logprobs"])  # fmt: skip
    assert cfg.for_learner().logprobs_mode == "processed_logprobs"
    assert "collector.top_p = 0.9: " in _refused("--collector.top_p", "0.9")
    assert "collector.temperature = 0.0: " in _refused(
        "--collector.temperature", "0", "--inference.logprobs_mode", "processed_logprobs"
    )
    sft = load_config(None, ["--learner.algo", "sft", "--collector.top_p", "0.9",
                             "--collector.temperature", "0.7"])  # fmt: skip
    assert sft.collector.top_p == 0.9


def test_temperature_is_bounded_as_the_gateway_bounds_a_request() -> None:
    """The run config took 50 while the gateway refuses a request's temperature above 2."""
    from sandpiper.collector.gateway.openai_api import APIError
    from sandpiper.collector.gateway.request_params import chat_params

    with pytest.raises(APIError):
        chat_params({"temperature": 2.5})
    assert chat_params({"temperature": 2.0}).temperature == 2.0
    assert "collector.temperature = 2.5: must be <= 2" in _refused(
        "--collector.temperature", "2.5", "--inference.logprobs_mode", "processed_logprobs"
    )
    cfg = ["--collector.temperature", "2", "--inference.logprobs_mode", "processed_logprobs"]
    assert load_config(None, cfg).collector.temperature == 2.0


def test_ports_fit_and_the_gateway_is_not_a_servers_port() -> None:
    message = _refused("--inference.base_port", "65535", "--inference.num_servers", "2")
    assert "inference.base_port = 65535" in message and "65536" in message
    assert "inference.base_port = 70000: must be <= 65535" in _refused(
        "--inference.base_port", "70000"
    )
    message = _refused("--collector.gateway_port", "8100")
    assert "collector.gateway_port = 8100: is one of the inference servers' ports" in message
    # With servers given by URL nothing is launched on those ports.
    ok = ["--collector.gateway_port", "8100", "--inference.server_urls", '["http://h:8000"]']
    assert load_config(None, ok).collector.gateway_port == 8100


def test_server_urls_and_store_urls_need_a_known_scheme_and_hide_passwords() -> None:
    message = _refused("--inference.server_urls", '["h:8000"]')
    assert 'inference.server_urls = "h:8000": each must be an http:// or https://' in message
    message = _refused("--store.url", "mysql://me:s3cret@db/x")
    assert "s3cret" not in message and "me:***@db" in message
    assert "use duckdb:///path/store.duckdb or postgresql+psycopg://" in message
    assert load_config(None, ["--store.url", "postgresql+psycopg://u@h/db"])


def test_heartbeat_ttl_outlasts_a_heartbeat() -> None:
    message = _refused("--collector.heartbeat_ttl_s", "2")
    assert "collector.heartbeat_ttl_s = 2.0: must be > heartbeat_s = 5.0" in message


def test_rejection_needs_a_bound_that_keeps_on_policy_tokens() -> None:
    assert "rejection needs reject_lo or reject_hi" in _refused("--learner.reject", "k3")
    assert "learner.reject_hi = -0.1: must be >= 0" in _refused("--learner.reject_hi", "-0.1")
    cfg = load_config(None, ["--learner.reject", "k1", "--learner.reject_lo", "-0.69"])
    assert cfg.learner.reject_lo == -0.69


def test_sandbox_tmpfs_fits_its_memory_and_uid_ranges_fit_32_bits() -> None:
    message = _refused("--sandbox.memory_mb", "300")
    assert "sandbox.memory_mb = 300: must exceed workspace_size_mb + tmp_size_mb = 320" in message
    message = _refused("--sandbox.uid_slots", "70000")
    assert "sandbox.uid_slots = 70000" in message and "largest uid" in message
    # uid 0 .. 65535 are the host's own users: a container must never map onto them.
    assert "sandbox.uid_base = 0: must be >= 65536" in _refused("--sandbox.uid_base", "0")


@pytest.mark.parametrize("name", ["../etc", "a/b", ".hidden", "", "x" * 129])
def test_a_run_name_is_one_folder_name(name: str) -> None:
    assert "name = " in _refused("--name", f'"{name}"')


def test_unknown_field_suggests_the_close_one() -> None:
    assert _refused("--learner.lrr", "1") == (
        "override --learner.lrr: learner.lrr: no such field (did you mean lr?)"
    )


def test_assignment_is_checked_too() -> None:
    cfg = RunConfig()
    with pytest.raises(ValueError, match="greater than or equal to 0"):
        cfg.learner.lr = -1.0


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_shipped_configs_pass_every_rule(path: Path) -> None:
    cfg = load_config(path)
    assert RunConfig.model_validate(cfg.model_dump()) == cfg


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_demos_derived_configs_pass_every_rule(model: str) -> None:
    from sandpiper.demo.run import DEMO_MODELS, demo_configs

    spec = DEMO_MODELS[model]
    base = load_config(REPO / spec.config)
    for derived in demo_configs(base, spec.tasks, spec.sft_learner):
        assert RunConfig.model_validate(derived.model_dump()) == derived
