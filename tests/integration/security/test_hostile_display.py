"""Terminal escapes and markup in stored tool output never reach the operator's terminal or
the HTML report: ``sandpiper show``, ``sandpiper sql`` (table, CSV, JSON) and ``sandpiper
report`` run for real on a DuckDB store holding one episode whose model text, tool name,
tool output, arguments, error and reward breakdown are hostile. The store keeps them raw.
Cost: one small synthetic store, ~10 s (the report draws its plots)."""

from __future__ import annotations

import dataclasses
import json
import os
import pty
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from sandpiper.analysis import api
from sandpiper.cli import app

pytestmark = pytest.mark.integration

HOSTILE = (
    "\x1b]0;PWNED-TITLE\x07\x1b]52;c;cm0gLXJmIH4K\x07\x1b[2J\x1b[H\x1b[8mconcealed\x1b[0m"
    "\x07\x9b31m\u202eabc\rOVERWRITE [link=http://evil/]click[/link] [/bad] [red]x"
)
ACTING = ("\x1b", "\x07", "\x9b", "\u202e", "\r")
"""Characters a terminal acts on: none may be printed."""


def _hostile(episode):
    turns = list(episode.turns)
    for i, turn in enumerate(turns):
        calls = tuple(
            dataclasses.replace(c, name=HOSTILE, output=HOSTILE, arguments_json=json.dumps(
                {"command": HOSTILE}, ensure_ascii=False)) for c in turn.tool_calls
        )  # fmt: skip
        turns[i] = dataclasses.replace(turn, text=turn.text + HOSTILE, tool_calls=calls)
    return dataclasses.replace(
        episode, turns=tuple(turns), error=HOSTILE,
        reward_breakdown={**episode.reward_breakdown, "test_details": {"output": HOSTILE}},
    )  # fmt: skip


@pytest.fixture(scope="module")
def hostile_store(tmp_path_factory):
    from sandpiper.store import Store
    from sandpiper.testing.synthetic import populate, synthetic_run

    run = synthetic_run(seed=1, num_versions=1, groups_per_version=2, group_size=2)
    for version, groups in run.groups_by_version.items():
        run.groups_by_version[version] = [
            dataclasses.replace(g, episodes=tuple(_hostile(e) for e in g.episodes)) for g in groups
        ]
    url = f"duckdb:///{tmp_path_factory.mktemp('hostile') / 'store.duckdb'}"
    store = Store(url)
    store.init()
    populate(store, run)
    store.close()
    with_calls = [e for e in run.episodes if any(t.tool_calls for t in e.turns)]
    return url, with_calls[0].episode_id


def _cli(url: str, *args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--store.url", url, "--tracking.enabled", "false"])
    assert result.exit_code == 0, result.output
    return result.stdout


def _assert_shown_escaped(text: str) -> None:
    for char in ACTING:
        assert char not in text, (char, text[:2000])
    assert "\\x1b]0;PWNED-TITLE\\x07" in text  # shown, visibly


def test_the_store_keeps_the_raw_text(hostile_store):
    url, episode_id = hostile_store
    rows = api.query(url, f"SELECT output FROM tool_calls WHERE episode_id = '{episode_id}'")
    assert rows["output"][0] == HOSTILE


def test_show_prints_hostile_text_escaped_and_never_as_markup(hostile_store):
    url, episode_id = hostile_store
    out = _cli(url, "show", episode_id, "--max-output-chars", "100000")
    _assert_shown_escaped(out)
    assert "[link=http://evil/]" in out and "[/bad]" in out  # text, not markup (no crash)


@pytest.mark.parametrize("fmt", ["table", "csv", "json"])
def test_sql_output_is_escaped(hostile_store, fmt):
    url, _ = hostile_store
    query = "SELECT name, output, arguments FROM tool_calls LIMIT 3"
    out = _cli(url, "sql", query, "--format", fmt)
    for char in ("\x07", "\x9b", "\u202e", "\r") if fmt == "csv" else ACTING:
        # csv to a pipe is data (raw, as stored); to a terminal it is escaped (below)
        assert char not in out or fmt == "csv", (char, out[:2000])
    if fmt == "json":
        assert json.loads(out)[0]["output"] == HOSTILE  # escaped losslessly
    elif fmt == "table":
        assert "\\x1b" in out
        tail = _cli(url, "sql", "SELECT substr(output, strpos(output, '[link')) FROM tool_calls")
        assert "[link=http://evil/]click[/link] [/bad]" in tail  # text, not markup


def test_sql_csv_to_a_terminal_is_escaped(hostile_store):
    """The real CLI with its stdout on a pseudo-terminal."""
    url, _ = hostile_store
    leader, follower = pty.openpty()
    proc = subprocess.run(
        [sys.executable, "-m", "sandpiper.cli", "sql", "SELECT output FROM tool_calls LIMIT 1",
         "-f", "csv", "--store.url", url, "--tracking.enabled", "false"],
        stdout=follower, stderr=subprocess.PIPE, env={**os.environ, "TERM": "dumb"},
        timeout=120, check=False,
    )  # fmt: skip
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    assert proc.returncode == 0, proc.stderr.decode()[-2000:]
    out = b"".join(chunks).decode("utf-8", "replace").replace("\r\n", "\n")  # the tty's CRLF
    _assert_shown_escaped(out)


def test_report_html_shows_hostile_text_escaped(hostile_store, tmp_path):
    url, _ = hostile_store
    _cli(url, "report", "--out", str(tmp_path), "--no-mlflow")
    html = (tmp_path / "index.html").read_text()
    assert "PWNED-TITLE" in html  # the hostile tool name is in the tool-usage table
    _assert_shown_escaped(html.replace("\r", ""))
