"""Your own reward function: ``reward = "python:MODULE:FUNCTION"`` in a row or ``task.toml``,
or ``collector.reward_function`` for every task of a run.

Two signatures are accepted, told apart by the function's parameter names:

- **verl's** ``compute_score(data_source, solution_str, ground_truth, extra_info)`` (a
  function with a ``solution_str`` parameter): called with keywords, as verl's reward
  managers call it, from verl's standard row fields (``data_source``,
  ``reward_model.ground_truth``, ``extra_info``, ``{}`` when the row has none) and the
  agent's answer as ``solution_str``. A float is the reward; a dict's ``"score"`` is the
  reward and its other keys go into the breakdown (verl's ``reward_extra_info``).
- **TRL's** ``(prompts, completions, **kwargs) -> list[float]`` (anything else): called as
  ``GRPOTrainer._calculate_rewards`` calls it, with a batch of one: ``prompts=[prompt]`` (the
  row's prompt as given: text, or chat messages), ``completions=[answer]`` (the answer text;
  ``[{"role": "assistant", "content": answer}]`` when the prompt is chat messages, as TRL
  does for conversational data), ``completion_ids=[None]`` (the answer is text a tool
  carried, not one sampled sequence), every other row field as a one-element list
  (``answer=[...]``; TRL leaves out only ``prompt``, ``completion`` and
  ``completion_ids``), ``trainer_state=None`` and no-op ``log_extra`` / ``log_metric``.
  ``None`` in the returned list is TRL's "no reward for this sample": here the episode has
  no reward (invalid, ``reward=None``), never a 0.

An exception, a result of the wrong shape, or a non-finite number is one invalid episode
(:class:`RewardFunctionError`, a ``TaskError``) whose error is the exception's last line.
It runs in the reward worker (:mod:`sandpiper.collector.rewards.worker`): bounded in time
and memory, away from the collector's event loop.
"""

from __future__ import annotations

import importlib
import inspect
import math
import numbers
from collections.abc import Callable, Mapping
from functools import cache
from typing import Any

from sandpiper.collector.rewards.reference import PythonReference
from sandpiper.errors import TaskError

TRL_EXCLUDED = ("prompt", "completion", "completion_ids")
"""Row fields TRL does not pass to a reward function (``_calculate_rewards``)."""


class RewardFunctionError(TaskError):
    """The task's reward function failed or returned no usable reward (an invalid episode)."""


@cache
def load_function(name: str) -> Callable[..., Any]:
    """``MODULE:FUNCTION`` imported (the module from the collector's ``sys.path``: its
    working folder first, then the installed packages)."""
    module_name, _, attr = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:
        raise RewardFunctionError(f"reward function {name}: cannot import {module_name}: "
                                  f"{_last_line(e)}") from None  # fmt: skip
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardFunctionError(f"reward function {name}: {module_name} has no function {attr}")
    return fn


def is_verl(fn: Callable[..., Any]) -> bool:
    """True for verl's ``compute_score`` signature (a ``solution_str`` parameter)."""
    try:
        return "solution_str" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: TRL's call
        return False


def score(ref: PythonReference, answer: str | None) -> tuple[float, dict[str, Any]]:
    """(reward, breakdown extras) of ``answer`` by the task's function; raises
    :class:`RewardFunctionError` (see the module docstring)."""
    fn = load_function(ref.function)
    text = answer if answer is not None else ""
    verl = is_verl(fn)
    try:
        result = _call_verl(fn, ref, text) if verl else _call_trl(fn, ref, text)
    except RewardFunctionError:
        raise
    except BaseException as e:  # SystemExit too: the worker must stay up
        raise RewardFunctionError(f"reward function {ref.function} raised "
                                  f"{type(e).__name__}: {_last_line(e)}") from None  # fmt: skip
    return _checked(result, ref.function, verl)


def _call_verl(fn: Callable[..., Any], ref: PythonReference, text: str) -> Any:
    model = ref.row.get("reward_model")
    ground_truth = model.get("ground_truth") if isinstance(model, Mapping) else None
    extra_info = ref.row.get("extra_info")
    return fn(
        data_source=ref.row.get("data_source"),
        solution_str=text,
        ground_truth=ground_truth,
        extra_info=dict(extra_info) if isinstance(extra_info, Mapping) else {},
    )


def _call_trl(fn: Callable[..., Any], ref: PythonReference, text: str) -> Any:
    conversational = isinstance(ref.prompt, list)
    completion: Any = [{"role": "assistant", "content": text}] if conversational else text
    kwargs: dict[str, Any] = {k: [v] for k, v in ref.row.items() if k not in TRL_EXCLUDED}
    kwargs.update(trainer_state=None, log_extra=_no_op, log_metric=_no_op)
    prompt = ref.prompt if ref.prompt is not None else ""
    return fn(prompts=[prompt], completions=[completion], completion_ids=[None], **kwargs)


def _checked(result: Any, name: str, verl: bool) -> tuple[float, dict[str, Any]]:
    extras: dict[str, Any] = {}
    if verl:
        if isinstance(result, Mapping):
            if "score" not in result:
                raise RewardFunctionError(f"reward function {name} returned a dict without "
                                          f"'score' (keys {sorted(map(str, result))})")  # fmt: skip
            extras = {str(k): v for k, v in result.items() if k != "score"}
            result = result["score"]
    else:
        if not isinstance(result, list | tuple) or len(result) != 1:
            raise RewardFunctionError(f"reward function {name} returned {_shown(result)}; "
                                      "expected a list of one reward per completion (one here)")  # fmt: skip
        result = result[0]
        if result is None:
            raise RewardFunctionError(f"reward function {name} returned None: no reward for "
                                      "this sample")  # fmt: skip
    if not isinstance(result, numbers.Real):  # bool too: TRL's tensor makes it 0/1
        raise RewardFunctionError(f"reward function {name} returned {_shown(result)}, "
                                  "not a number")  # fmt: skip
    value = float(result)
    if not math.isfinite(value):
        raise RewardFunctionError(f"reward function {name} returned {value}, not a finite number")
    return value, extras


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


def _last_line(e: BaseException) -> str:
    lines = [line for line in str(e).splitlines() if line.strip()]
    return lines[-1][:500] if lines else "(no message)"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:200] + "…"
