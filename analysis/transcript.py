"""Render one episode (:class:`sandpiper.analysis.api.EpisodeDetail`) as a readable rich transcript.

Shown: a header (task, outcome, reward, validity, stop reason, infra error, policy versions,
token counts, timings, sandbox), the reward breakdown, then every turn in order with its
role, token count, policy-version spans (``v3×40 → v4×12`` when a weight update landed
mid-turn) and duration, and below each assistant turn its tool calls: arguments, exit code,
error kind, time-out, duration, and the output the agent saw (with its total size).

Every stored string is written by the policy or its sandbox: each goes through
:func:`sandpiper.analysis.terminal.neutralize` and reaches rich as plain ``Text`` (never markup, so a
``[link=…]`` in a tool output is shown, not turned into a terminal hyperlink).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sandpiper.analysis.terminal import neutralize

if TYPE_CHECKING:
    from rich.console import Console, RenderableType

    from sandpiper.analysis.api import EpisodeDetail

ROLE_STYLE = {"system": "magenta", "user": "cyan", "assistant": "green", "tool": "yellow"}


def version_spans(versions: list[int] | None) -> list[tuple[int, int]]:
    """Run-length encoding of per-token policy versions: ``[(version, n_tokens), ...]``."""
    spans: list[tuple[int, int]] = []
    for v in versions or []:
        if spans and spans[-1][0] == v:
            spans[-1] = (v, spans[-1][1] + 1)
        else:
            spans.append((int(v), 1))
    return spans


def format_spans(versions: list[int] | None) -> str:
    return " → ".join(f"v{v}×{n}" for v, n in version_spans(versions))


def _header(summary: dict[str, Any]) -> RenderableType:
    from rich.markup import escape
    from rich.table import Table

    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold")
    table.add_column()
    # Stored strings may contain [brackets]; only our own markup may style the header.
    summary = {k: escape(neutralize(v)) if isinstance(v, str) else v for k, v in summary.items()}
    reward = summary["reward"]
    fields = [
        ("episode", summary["episode_id"]),
        ("run / group", f"{summary['run_id']} / {summary['group_id']} #{summary['sample_index']}"),
        ("task", f"{summary['task_id']} ({summary['task_format']})"),
        ("outcome", f"{summary['outcome']}  (stop: {summary['stop_reason']})"),
        ("reward", "— (not scored)" if reward is None else f"{reward:.4g}"),
        ("valid", "yes" if summary["valid"] else "[red]no — infra failure, excluded[/red]"),
        ("policy versions", f"{summary['min_policy_version']} … {summary['max_policy_version']}"),
        ("tokens", f"{summary['completion_tokens']} sampled / {summary['total_tokens']} total"),
        (
            "turns / tool calls",
            f"{summary['n_turns']} / {summary['n_tool_calls']} "
            f"({summary['n_tool_errors']} errors, {summary['n_tool_timeouts']} timed out)",
        ),
        ("started", str(summary["started_at"])),
        (
            "duration",
            f"{summary['duration_ms'] / 1000:.2f} s (tools {summary['tool_ms'] / 1000:.2f} s)",
        ),
        ("sandbox", summary["sandbox_id"] or "—"),
        ("group status", f"{summary['group_status']} (step {summary['consumed_by_step']})"),
    ]
    if summary.get("error"):
        fields.append(("error", f"[red]{summary['error']}[/red]"))
    for name, value in fields:
        table.add_row(name, str(value))
    return table


def _breakdown(breakdown: dict[str, Any]) -> RenderableType:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="reward breakdown", show_header=False, title_justify="left")
    for key, value in sorted(breakdown.items()):  # test output and names are the policy's
        table.add_row(Text(neutralize(str(key))), Text(neutralize(str(value))))
    return table


def _tool_call(call: dict[str, Any], max_output_chars: int) -> RenderableType:
    from rich.panel import Panel
    from rich.text import Text

    output = call["output"]
    if len(output) > max_output_chars:
        output = output[:max_output_chars] + f"\n… ({len(output) - max_output_chars} more chars)"
    status = f"exit {call['exit_code']}" if call["exit_code"] is not None else "no exit code"
    if call["timed_out"]:
        status += ", TIMED OUT"
    if call["error_kind"] != "none":
        status += f", error: {call['error_kind']}"
    title = Text(
        f"tool call {call['call_index']}: {neutralize(call['name'])} · {status} · "
        f"{call['duration_ms']:.0f} ms · output {call['output_bytes_total']} bytes"
    )
    body = Text.assemble(("args ", "bold"), neutralize(call["arguments"]), "\n", neutralize(output))
    style = "red" if call["error_kind"] != "none" or call["timed_out"] else "blue"
    return Panel(body, title=title, title_align="left", border_style=style)


def render(detail: EpisodeDetail, console: Console, *, max_output_chars: int = 2000) -> None:
    """Print the whole transcript of ``detail`` on ``console``."""
    from rich.panel import Panel
    from rich.text import Text

    console.print(Panel(_header(detail.summary), title="episode", title_align="left"))
    if detail.reward_breakdown:
        console.print(_breakdown(detail.reward_breakdown))
    calls_by_turn: dict[int, list[dict[str, Any]]] = {}
    for call in detail.tool_calls.iter_rows(named=True):
        calls_by_turn.setdefault(call["turn_index"], []).append(call)
    for turn in detail.turns.iter_rows(named=True):
        role = turn["role"]
        spans = format_spans(turn["policy_versions"])
        title = f"turn {turn['turn_index']} · {role} · {turn['n_tokens']} tokens"
        if spans:
            title += f" · {spans}"
        title += f" · {turn['duration_ms']:.0f} ms"
        if turn["trainable"]:
            title += " · trained"
        style = ROLE_STYLE.get(role, "white")
        console.print(
            Panel(
                Text(neutralize(turn["text"])), title=title, title_align="left", border_style=style
            )
        )
        for call in calls_by_turn.get(turn["turn_index"], []):
            console.print(_tool_call(call, max_output_chars))
