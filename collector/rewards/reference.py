"""A task's reward reference: a tagged union on ``reward`` (the reward kind).

Every task carries one; :func:`sandpiper.collector.rewards.compute.compute_reward` scores with it and
the store keeps it as JSON (``tasks.reference``, :meth:`Reference.as_dict`). The kinds and
what each reads::

    math            answer (equivalence by math-verify)
    exact           answer (normalised exact match: answer_scores.normalize_answer)
    strict          answer (equal after stripping surrounding whitespace)
    choice          answer (one letter A-Z, answer_scores.choice_letter)
    rouge           answer, rouge_type (default rougeL F-measure)
    llm_in_sandbox  answer, domain, qa_type (the peer's scorer of that domain)
    reasoning_gym   dataset, config, index (that reasoning-gym item's own score_answer)
    python:M:F      function (M:F), prompt, row: your function (rewards/custom.py)
    tests           nothing: the task's test script reports the reward at submit
    none            nothing: reward 0 (collect without scoring)

and every kind may add ``banned_patterns`` / ``banned_penalty`` (a hit replaces the reward
with ``-banned_penalty``, as TRL does), ``answer_file`` (the answer is that file in the
sandbox), ``result_format`` (how the tests report) and an external agent (``agent_command``,
``agent_timeout_s``, ``agent_env``: docs/gateway.md).

Task files name these as plain keys beside the prompt (a JSONL row, a ``task.toml``);
:func:`parse_reference` keeps the keys the row's kind reads (a row's other fields are the
row's business, as before) and turns a wrong type into a :class:`TaskError` at load time,
instead of a ``.get`` that returns the wrong thing at scoring time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from sandpiper.errors import TaskError

__all__ = [
    "REFERENCE_KEYS",
    "REWARD_KINDS",
    "BrokenReference",
    "ChoiceReference",
    "ExactReference",
    "LlmInSandboxReference",
    "MathReference",
    "NoReward",
    "PythonReference",
    "ReasoningGymReference",
    "Reference",
    "RougeReference",
    "StrictReference",
    "TaskReference",
    "TestsReference",
    "parse_reference",
    "task_reference",
]


class _Reference(BaseModel):
    """What every kind may carry."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, coerce_numbers_to_str=True, use_attribute_docstrings=True
    )

    reward: str
    """The reward kind (the table above); default `tests` for a folder with `tests/`, else
    `exact` (task folders) or `math` (prompt rows)."""
    banned_patterns: list[str] = Field(default_factory=list)
    """Plain substrings, case-insensitive (TRL's `p.lower() in text.lower()`), looked for in
    everything the model wrote; a hit makes the reward `-banned_penalty`."""
    banned_penalty: float = 1.0
    """The penalty of a banned pattern (reward `-banned_penalty`)."""
    answer_file: str | None = None
    """The answer is this file in the sandbox, read (up to 64 KiB) at the end of the episode
    when `submit` carried no answer."""
    result_format: str | None = None
    """How the tests report (see the task.toml keys)."""
    agent_command: str | list[str] | None = None
    """An external agent run per episode through the gateway: argv, or a shell string."""
    agent_timeout_s: float | None = Field(default=None, gt=0)
    """Wall-clock limit of the external agent."""
    agent_env: dict[str, str | int | float | bool] | None = None
    """Environment of the external agent (docs/gateway.md)."""

    @field_validator("agent_command")
    @classmethod
    def _non_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        if value is not None and not (value.strip() if isinstance(value, str) else value):
            raise ValueError("agent_command must not be empty")
        return value

    def as_dict(self) -> dict[str, Any]:
        """The JSON the task files used and the store keeps: the keys that were given."""
        return self.model_dump(mode="json", exclude_unset=True) | {"reward": self.reward}

    # Read-only dict access, as earlier releases' ``Task.reference`` (a dict) offered; the
    # code reads the typed fields.
    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.as_dict().get(key, default)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Mapping):
            return self.as_dict() == dict(other)
        return super().__eq__(other)


class _Answered(_Reference):
    answer: str | None = None
    """The gold answer (none: nothing to compare with, the reward is 0)."""


class MathReference(_Answered):
    reward: Literal["math"] = "math"


class ExactReference(_Answered):
    reward: Literal["exact"] = "exact"


class StrictReference(_Answered):
    reward: Literal["strict"] = "strict"


class ChoiceReference(_Answered):
    reward: Literal["choice"] = "choice"


class ReasoningGymReference(_Answered):
    """An item of a reasoning-gym dataset, scored by that dataset's own ``score_answer``. The
    item is generated again in the reward worker from ``dataset``, ``config`` (with its
    ``seed`` and ``size``) and ``index``, so the scorer sees exactly the entry the library
    made; ``answer`` is the item's gold answer, kept for people reading the task."""

    reward: Literal["reasoning_gym"] = "reasoning_gym"
    dataset: str
    """The reasoning-gym dataset's registered name (`countdown`, ...)."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The dataset's config, its `seed` and `size` included."""
    index: int = Field(ge=0)
    """The item's index in that dataset (item `i` is seeded with `seed + i`)."""


PYTHON_PREFIX = "python:"


class PythonReference(_Reference):
    """Your own reward function (:mod:`sandpiper.collector.rewards.custom`), named in the
    task file as ``reward = "python:MODULE:FUNCTION"``."""

    reward: Literal["python"] = "python"
    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    """``MODULE:FUNCTION``, imported in the reward worker."""
    prompt: str | list[dict[str, Any]] | None = None
    """The row's prompt as the row gave it (text or chat messages): TRL's ``prompts``."""
    row: dict[str, Any] = Field(default_factory=dict)
    """The row's other fields, passed as TRL and verl pass them."""

    def as_dict(self) -> dict[str, Any]:
        return super().as_dict() | {"reward": PYTHON_PREFIX + self.function}


class RougeReference(_Answered):
    reward: Literal["rouge"] = "rouge"
    rouge_type: str = "rougeL"
    """`rouge1`, `rouge2`, `rougeL`, ... (rouge-score's names; F-measure)."""


class LlmInSandboxReference(_Answered):
    reward: Literal["llm_in_sandbox"] = "llm_in_sandbox"
    domain: str = ""
    """The peer's domain (which of its scorers applies)."""
    qa_type: str | None = None
    """The peer's question type (multiple choice or not)."""


class TestsReference(_Reference):
    reward: Literal["tests"] = "tests"


class NoReward(_Reference):
    reward: Literal["none"] = "none"


class BrokenReference(_Reference):
    """A task file's reference that failed its checks (an unknown kind, a wrong type).

    Loading goes on, as it always has for a row's reward data: each episode of the task is
    then invalid with this error (``task_error``), never a valid 0 and never an abort of the
    whole task file. The file's keys are kept as given (:meth:`as_dict`)."""

    error: str
    raw: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.raw)


Reference = Annotated[
    MathReference | ExactReference | StrictReference | ChoiceReference | RougeReference
    | LlmInSandboxReference | ReasoningGymReference | PythonReference | TestsReference
    | NoReward,
    Field(discriminator="reward"),
]  # fmt: skip
"""One task's reward reference (discriminated by ``reward``)."""

TaskReference = Reference | BrokenReference
"""What a :class:`~sandpiper.collector.tasks.model.Task` holds: its reference, or why it is not one."""

_KINDS: dict[str, type[_Reference]] = {
    cls.model_fields["reward"].default: cls
    for cls in (MathReference, ExactReference, StrictReference, ChoiceReference,
                RougeReference, LlmInSandboxReference, ReasoningGymReference, PythonReference,
                TestsReference, NoReward)
}  # fmt: skip
REWARD_KINDS = tuple(_KINDS)
REFERENCE_KEYS = tuple(dict.fromkeys(f for cls in _KINDS.values() for f in cls.model_fields))
"""Every key some kind reads (``reward`` first); a task file's other keys are not the reference's."""
_ADAPTER: TypeAdapter[Reference] = TypeAdapter(Reference)


def parse_reference(
    data: Mapping[str, Any] | _Reference, *, default_kind: str = "exact", where: str = ""
) -> Reference:
    """The reference of a task file's keys: ``reward`` (``default_kind`` when absent) picks
    the kind, and the keys that kind reads are taken and checked; others are ignored.
    Raises :class:`TaskError` with what is wrong (a :class:`BrokenReference` raises its error)."""
    if isinstance(data, BrokenReference):
        raise TaskError(data.error)
    if isinstance(data, _Reference):
        return cast(Reference, data)  # every concrete _Reference is a member of the union
    kind = data.get("reward", default_kind)
    function = None
    if isinstance(kind, str) and kind.startswith(PYTHON_PREFIX):
        kind, function = "python", kind[len(PYTHON_PREFIX) :]
    elif kind == "python":
        kind = None  # the function must be named
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise TaskError(f"{where}{': ' if where else ''}unknown reward kind {kind!r}; "
                        f"expected one of {REWARD_KINDS} ('python' as "
                        f"'{PYTHON_PREFIX}MODULE:FUNCTION')")  # fmt: skip
    picked = {k: v for k, v in data.items() if k in cls.model_fields}
    picked["reward"] = kind
    if function is not None:
        picked["function"] = function
    try:
        return _ADAPTER.validate_python(picked)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'][1:]) or 'reference'}: {err['msg']}"
            for err in e.errors()
        )
        raise TaskError(
            f"{where}{': ' if where else ''}bad reward reference ({problems})"
        ) from None


def task_reference(
    data: Mapping[str, Any] | _Reference, *, default_kind: str = "exact", where: str = ""
) -> TaskReference:
    """:func:`parse_reference`, or a :class:`BrokenReference` holding its error."""
    if isinstance(data, BrokenReference):
        return data
    try:
        return parse_reference(data, default_kind=default_kind, where=where)
    except TaskError as e:
        raw = data.as_dict() if isinstance(data, _Reference) else dict(data)
        return BrokenReference(reward=str(raw.get("reward", default_kind)), error=str(e), raw=raw)
