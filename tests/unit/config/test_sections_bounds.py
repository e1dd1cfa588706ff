"""Every number of every config class has bounds, and a value past one is refused in one line.

The walk finds the config classes itself (every pydantic model of every module of
``sandpiper.config``), so a new numeric field without a bound, or a new class, fails here
until it gets one.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any

import pytest
from annotated_types import Ge, Gt, Le, Lt
from pydantic import BaseModel, ValidationError

import sandpiper.config
from sandpiper.config import RunConfig, load_config
from sandpiper.config.checks import walk_numeric
from sandpiper.errors import ConfigError

OPEN = {
    "LearnerConfig.sft_min_reward": "a reward is any finite number (a test script's score, "
    "-banned_penalty)",
}
"""Numbers with no bound on purpose, and why; they still refuse NaN and infinities."""

REPO = Path(__file__).resolve().parents[3]


def _config_classes() -> list[type[BaseModel]]:
    found = {}
    modules = [
        importlib.import_module(f"sandpiper.config.{info.name}")
        for info in pkgutil.iter_modules(sandpiper.config.__path__)
    ]
    assert modules, "no module found in sandpiper.config"
    for module in modules:
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseModel) and obj.__module__ == module.__name__:
                found[obj.__qualname__] = obj
    return [c for name, c in sorted(found.items()) if not inspect.isabstract(c)]


def _own_numbers(cls: type[BaseModel]):
    return [
        (name, info, t)
        for name, info, t in walk_numeric(cls)
        if "." not in name  # a section's fields are checked on the section's class
    ]


def _past(info: Any, t: type) -> list[Any]:
    """Values just outside each declared bound."""
    out = []
    for meta in info.metadata:
        if isinstance(meta, Ge):
            out.append(t(meta.ge) - 1)
        elif isinstance(meta, Gt):
            out.append(t(meta.gt))
        elif isinstance(meta, Le):
            out.append(t(meta.le) + 1)
        elif isinstance(meta, Lt):
            out.append(t(meta.lt))
    return out


CLASSES = _config_classes()
FIELDS = [(cls, name, info, t) for cls in CLASSES for name, info, t in _own_numbers(cls)]


def test_the_walk_sees_every_part_and_dozens_of_numbers() -> None:
    names = {c.__name__ for c in CLASSES}
    assert {"RunConfig", "LearnerConfig", "CollectorConfig", "SandboxConfig",
            "InferenceConfig", "StoreConfig", "CollectorSettings", "LearnerSettings"} <= names  # fmt: skip
    assert len(FIELDS) > 70


@pytest.mark.parametrize(
    ("cls", "name", "info", "t"), FIELDS, ids=[f"{c.__name__}.{n}" for c, n, _, _ in FIELDS]
)
def test_every_number_has_a_bound(cls, name, info, t) -> None:
    key = f"{cls.__name__}.{name}"
    if key in OPEN:
        assert not _past(info, t), f"{key} has bounds now: take it off OPEN"
        return
    assert _past(info, t), (
        f"{key} has no bound: give it Field(..., ge=/gt=/le=/lt=) (or, if any value is "
        "meaningful, an entry in OPEN saying why)"
    )


def _section_of(cls: type[BaseModel]) -> str | None:
    for section, info in RunConfig.model_fields.items():
        if info.annotation is cls:
            return section
    return "" if cls is RunConfig else None


LOADABLE = [(c, n, i, t) for c, n, i, t in FIELDS if _section_of(c) is not None]


@pytest.mark.parametrize(
    ("cls", "name", "info", "t"), LOADABLE, ids=[f"{c.__name__}.{n}" for c, n, _, _ in LOADABLE]
)
def test_a_value_past_a_bound_is_refused_in_one_line_naming_field_and_value(
    cls, name, info, t
) -> None:
    section = _section_of(cls)
    dotted = f"{section}.{name}" if section else name
    key = f"{cls.__name__}.{name}"
    values = ["nan", "inf"] if key in OPEN else [str(v) for v in _past(info, t)]
    if t is float and key not in OPEN:
        values.append("nan")
    for value in values:
        with pytest.raises(ConfigError) as refused:
            load_config(None, [f"--{dotted}", value])
        message = str(refused.value)
        assert "\n" not in message, message
        assert message.startswith(f"override --{dotted}: {dotted} = "), message
        assert ": must be" in message, message


def test_a_value_past_a_bound_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[learner]\nlr = -1\ngroups_per_step = 0\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value).splitlines() == [
        f"{path}: learner.lr = -1: must be >= 0",
        f"{path}: learner.groups_per_step = 0: must be >= 1",
    ]


SETTINGS = [(c, n, i, t) for c, n, i, t in FIELDS if _section_of(c) is None]


@pytest.mark.parametrize(
    ("cls", "name", "info", "t"), SETTINGS, ids=[f"{c.__name__}.{n}" for c, n, _, _ in SETTINGS]
)
def test_a_parts_settings_refuse_what_the_config_refuses(cls, name, info, t) -> None:
    config = RunConfig()
    valid = config.for_collector() if "Collector" in cls.__name__ else config.for_learner()
    assert isinstance(valid, cls)
    for value in _past(info, t):
        with pytest.raises(ValidationError, match=name):
            cls.model_validate({**dict(valid), name: value})


def test_docs_configuration_md_is_current() -> None:
    from sandpiper.commands._config_doc import render

    page = (REPO / "docs" / "configuration.md").read_text()
    assert page == render(), (
        "docs/configuration.md is stale: .venv/bin/sandpiper config docs > docs/configuration.md"
    )


def test_the_docs_list_every_field_with_its_bounds() -> None:
    from sandpiper.commands._config_doc import render

    page = render()
    for section, info in RunConfig.model_fields.items():
        model = info.annotation
        if isinstance(model, type) and issubclass(model, BaseModel):
            assert f"## `[{section}]`" in page
            for field in model.model_fields:
                assert f"- **`{field}`**" in page
    assert (
        "- **`lr`** (`float`, default `1e-05`, ≥ 0, ≤ 1): AdamW learning rate; 0 keeps the weights fixed (the control run of a learning test)."
        in page
    )
