"""Answers refused before a family library's scorer evaluates them as code.

Several reasoning-gym ``score_answer`` methods run the answer through ``eval`` or
``sympy.parse_expr`` (an ``eval``). Code in the answer would run in the reward worker and
could patch the scorer and set its own reward. Before such a scorer sees an answer, the
answer must parse (``ast.parse``, which runs nothing) into a tree made only of the nodes
that family's right answers need: numbers and + - * / for countdown and puzzle24, literal
lists of numbers or strings for the list families, and named sympy functions for the
algebra families. Such a tree evaluates without calling anything the answer names, so
evaluating it is safe. A refused answer is scored as no answer (``score_answer(None)``):
the library's score for a wrong answer, never more.

A family whose scorer's module evaluates strings and that has no gate here is refused
(:func:`check_family`): a new library version cannot add an unguarded ``eval`` silently.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable
from functools import cache
from typing import Any

MAX_LEN = 4096

_ARITH_OPS = (ast.Add, ast.Sub, ast.Mult, ast.Div)
_SYMPY_NAMES = frozenset({"sin", "cos", "tan", "cot", "sec", "csc", "asin", "acos", "atan",
                          "sinh", "cosh", "tanh", "exp", "log", "ln", "sqrt", "Abs",
                          "pi", "E", "C"})  # fmt: skip


def _arith(node: ast.AST) -> bool:
    """Integers with + - * / and unary signs; no power (``9**9**9`` would not finish)."""
    if isinstance(node, ast.Expression):
        return _arith(node.body)
    if isinstance(node, ast.BinOp):
        return isinstance(node.op, _ARITH_OPS) and _arith(node.left) and _arith(node.right)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.UAdd | ast.USub) and _arith(node.operand)
    return isinstance(node, ast.Constant) and type(node.value) is int


def _literal(node: ast.AST) -> bool:
    """Lists and tuples of ints, signed ints and plain strings: what ``eval`` evaluates
    without calling anything."""
    if isinstance(node, ast.Expression):
        return _literal(node.body)
    if isinstance(node, ast.List | ast.Tuple):
        return all(_literal(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.UAdd | ast.USub) and _literal(node.operand)
    return isinstance(node, ast.Constant) and type(node.value) in (int, str)


def _sympy(variables: frozenset[str]) -> Callable[[ast.AST], bool]:
    """Numbers, the item's variable, ``C`` and named elementary functions; powers whose
    exponent is small numbers only (bounded work)."""
    names = _SYMPY_NAMES | variables

    def ok(node: ast.AST, exponent: bool = False) -> bool:
        if isinstance(node, ast.Expression):
            return ok(node.body)
        if isinstance(node, ast.BinOp):
            if isinstance(node.op, ast.Pow):
                return (
                    not exponent
                    and not _has_pow(node.left)
                    and ok(node.left)
                    and ok(node.right, True)
                )
            return (
                isinstance(node.op, _ARITH_OPS)
                and ok(node.left, exponent)
                and ok(node.right, exponent)
            )
        if isinstance(node, ast.UnaryOp):
            return isinstance(node.op, ast.UAdd | ast.USub) and ok(node.operand, exponent)
        if isinstance(node, ast.Call):
            return (isinstance(node.func, ast.Name) and node.func.id in _SYMPY_NAMES
                    and not node.keywords and len(node.args) <= 2
                    and all(ok(a, exponent) for a in node.args))  # fmt: skip
        if isinstance(node, ast.Name):
            return node.id in names and not exponent
        if isinstance(node, ast.Constant):
            value = node.value
            return (
                isinstance(value, int | float)
                and not isinstance(value, bool)
                and (not exponent or abs(value) <= 100)
            )
        return False

    return ok


def _has_pow(node: ast.AST) -> bool:
    """A power inside a power's base (``(9**99)**99**...``) is refused: bounded work."""
    return any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow) for n in ast.walk(node))


def _no_vars(entry: dict[str, Any]) -> frozenset[str]:
    return frozenset()


def _entry_var(entry: dict[str, Any]) -> frozenset[str]:
    var = entry.get("metadata", {}).get("variable")
    return frozenset({var}) if isinstance(var, str) else frozenset()


def _poly_vars(entry: dict[str, Any]) -> frozenset[str]:
    found = re.findall(r"[A-Za-z_]\w*", str(entry.get("answer", "")))
    return frozenset(n for n in found if len(n) == 1)


_Check = Callable[[ast.AST], bool]
GATES: dict[str, Callable[[dict[str, Any]], _Check]] = {
    "countdown": lambda e: _arith,
    "puzzle24": lambda e: _arith,
    "spiral_matrix": lambda e: _literal,
    "binary_matrix": lambda e: _literal,
    "n_queens": lambda e: _literal,
    "string_insertion": lambda e: _literal,
    "polynomial_multiplication": lambda e: _sympy(_poly_vars(e)),
    "simple_integration": lambda e: _sympy(_entry_var(e)),
    "intermediate_integration": lambda e: _sympy(_entry_var(e)),
}
"""Families whose ``score_answer`` evaluates the answer, and the tree each admits."""

REVIEWED = frozenset({"bitwise_arithmetic", "basic_arithmetic", "number_sorting", "codeio",
                      "propositional_logic"})  # fmt: skip
"""Families whose module evaluates strings, read and found to evaluate only the library's
own text (the problem, the gold answer, generated code), never the answer."""

_EVALUATES = re.compile(r"\beval\s*\(|\bexec\s*\(|parse_expr|sympify|\bS\s*\(|literal_eval")


class UnsafeFamily(Exception):
    """The family's scorer evaluates strings and has no gate."""


def check_family(name: str, cls: type) -> None:
    """Refuse ``name`` when a reasoning-gym module of its class evaluates strings and the
    family is neither gated nor reviewed (the verdict is cached: the reward worker reaches
    it first outside its guard, which refuses file opens)."""
    reason = _verdict(name, cls)
    if reason:
        raise UnsafeFamily(reason)


@cache
def _verdict(name: str, cls: type) -> str:
    if name in GATES or name in REVIEWED:
        return ""
    for klass in cls.__mro__:
        module = inspect.getmodule(klass)
        if module is None or not module.__name__.startswith("reasoning_gym"):
            continue
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            return f"reasoning-gym {name}: the scorer's source cannot be read"
        if _EVALUATES.search(source) or module.__name__ == "reasoning_gym.composite":
            return (f"reasoning-gym {name}: its scorer may evaluate the answer as code and "
                    "sandpiper has no gate for it (docs/security.md)")  # fmt: skip
    return ""


def admitted(name: str, answer: str | None, entry: dict[str, Any]) -> bool:
    """True when ``answer`` may reach family ``name``'s scorer."""
    gate = GATES.get(name)
    if gate is None or answer is None:
        return True
    if len(answer) > MAX_LEN or "\\" in answer or "\0" in answer:
        return False
    text = answer.strip()
    if not text or text in _known(entry):
        return True  # the library's own text (a gold answer): compared, not run, first
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        # ``eval`` cannot run text Python cannot parse either (spiral_matrix's right answer
        # "1 2 3" is such a text), but sympy rewrites tokens first ("f(x)!" becomes a call)
        return name not in _PARSE_EXPR
    return gate(entry)(tree)


def _known(entry: dict[str, Any]) -> set[str]:
    known = {str(entry.get("answer", "")).strip()}
    valid = entry.get("metadata", {}).get("valid_answers")
    if isinstance(valid, list):
        known.update(str(v).strip() for v in valid)
    return known


_PARSE_EXPR = frozenset({"countdown", "puzzle24", "polynomial_multiplication",
                         "simple_integration", "intermediate_integration"})  # fmt: skip
