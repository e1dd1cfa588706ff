"""Config composition: shipped configs load, dotted overrides apply, typos are errors."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from sandpiper.config import (
    CollectorConfig,
    CollectorSettings,
    LearnerSettings,
    RunConfig,
    load_config,
    parse_overrides,
    to_toml,
    write_resolved,
)
from sandpiper.errors import ConfigError

CONFIGS = sorted((Path(__file__).resolve().parents[3] / "configs").glob("*.toml"))


def test_some_configs_are_shipped() -> None:
    assert any(p.name == "local.toml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path) -> None:
    config = load_config(path)
    assert isinstance(config, RunConfig)


def test_dotted_overrides_in_both_spellings() -> None:
    config = load_config(None, ["--learner.lr", "1e-6", "--collector.group_size=4"])
    assert config.learner.lr == pytest.approx(1e-6)
    assert config.collector.group_size == 4


def test_override_values_are_toml_literals_or_strings() -> None:
    parsed = parse_overrides(
        ["--store.url", "duckdb:///x.db", "--tracking.enabled", "false", "--a.b", "[1, 2]"]
    )
    assert parsed == {
        "store": {"url": "duckdb:///x.db"},
        "tracking": {"enabled": False},
        "a": {"b": [1, 2]},
    }


def test_unknown_field_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match="lrr"):
        load_config(None, ["--learner.lrr", "1"])


def test_wrong_type_is_an_error() -> None:
    with pytest.raises(ConfigError, match="group_size"):
        load_config(None, ["--collector.group_size", "many"])


def test_override_without_value_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no value"):
        parse_overrides(["--learner.lr"])


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_resolved_config_round_trips(tmp_path: Path) -> None:
    config = load_config(CONFIGS[0], ["--learner.lr", "3e-6", "--name", "x"])
    out = write_resolved(config, tmp_path)
    assert out.name == "config.resolved.toml"
    again = RunConfig.model_validate(tomllib.loads(out.read_text()))
    assert again == config
    assert to_toml(again) == out.read_text()


def test_max_lag_is_one_setting_and_the_old_collector_key_is_read_with_a_warning(tmp_path, caplog):
    path = tmp_path / "old.toml"
    path.write_text("[collector]\nmax_lag = 1\n")
    with caplog.at_level("WARNING", logger="sandpiper.config"):
        cfg = load_config(path)
    assert cfg.learner.max_lag == 1
    assert "collector.max_lag is deprecated" in caplog.text
    assert "max_lag" not in CollectorConfig.model_fields
    path.write_text("[collector]\nmax_lag = 1\n[learner]\nmax_lag = 1\n")
    assert load_config(path).learner.max_lag == 1
    path.write_text("[collector]\nmax_lag = 0\n[learner]\nmax_lag = 3\n")
    with pytest.raises(ConfigError, match="differ"):
        load_config(path)
    with pytest.raises(ConfigError, match="differ"):
        load_config(None, ["--collector.max_lag", "0", "--learner.max_lag", "2"])


def test_each_part_is_given_only_its_own_settings(tmp_path):
    cfg = load_config(
        None,
        ["--name", "r", "--runs_dir", str(tmp_path), "--learner.model", "m",
         "--learner.groups_per_step", "3", "--learner.max_lag", "1",
         "--collector.heartbeat_ttl_s", "7", "--collector.group_size", "2"],
    )  # fmt: skip
    col, lea = cfg.for_collector(), cfg.for_learner()
    # The collector sees no learner or tracking section, only the three learner facts it acts
    # on; the learner sees no collector, sandbox or inference section.
    assert {"learner", "tracking"}.isdisjoint(CollectorSettings.model_fields)
    assert {"collector", "sandbox", "inference"}.isdisjoint(LearnerSettings.model_fields)
    assert (col.model, col.groups_per_step, col.max_lag) == ("m", 3, 1)
    assert col.collector.group_size == 2 and col.run_dir == tmp_path / "r"
    assert lea.collector_heartbeat_ttl_s == 7 and lea.learner.model == "m"
    # Both record the whole resolved config with the run, and it reads back as it was.
    assert RunConfig.model_validate_json(col.resolved_json) == cfg
    assert lea.resolved_json == col.resolved_json
    with pytest.raises(ValueError):  # frozen: a part cannot change what the run decided
        col.max_lag = 5
    # write_resolved from a part's settings writes the whole run's config.
    out = write_resolved(lea, tmp_path / "out")
    assert load_config(out) == cfg


def test_writers_starting_together_do_not_take_each_others_file(tmp_path):
    """A collector and learners starting at once all write ``config.resolved.toml``: with a
    shared temporary name one writer's rename took the file another was about to rename
    (FileNotFoundError at start-up, seen with two learners started together)."""
    import multiprocessing

    config = RunConfig.model_validate({"name": "r", "runs_dir": str(tmp_path)})
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(4) as pool:
        outs = pool.starmap(_write_many, [(config, tmp_path)] * 8)
    assert outs == [str(tmp_path / "config.resolved.toml")] * 8
    assert [p.name for p in tmp_path.iterdir()] == ["config.resolved.toml"]
    assert tomllib.loads((tmp_path / "config.resolved.toml").read_text())["name"] == "r"


def _write_many(config, folder):
    for _ in range(50):
        out = write_resolved(config, folder)
    return str(out)
