"""10,000 hostile model turns through the parser and the toolbox (fake sandbox): nothing
raises, every call comes back as a result, and everything that would be stored is valid
UTF-8 (issue 14; the same generator drives the real daemon in
tests/integration/security/test_fuzz_daemon.py). About 10 s on the 2-core CI machine."""

from __future__ import annotations

import asyncio
from pathlib import Path

from sandpiper.collector.episode.loop import tool_record
from sandpiper.collector.episode.parsers import parse_tool_calls
from sandpiper.collector.episode.tools import Toolbox
from sandpiper.collector.sandbox.base import ExecOutcome, ExecResult
from sandpiper.store.records import ToolErrorKind
from sandpiper.testing import FakeSandbox
from tests.fixtures.fuzz import HostileTurns

N_TURNS = 10_000


class _ContainedFake(FakeSandbox):
    """Commands are echoed, never run on the host; ``..`` never leaves the fake's root."""

    def __init__(self) -> None:
        super().__init__(handler=self._echo)

    @staticmethod
    def _echo(command: str, env) -> ExecResult:
        out = f"ran {len(command)} bytes\n"
        return ExecResult(out, "", 0, ExecOutcome.OK, 0.1, len(out), 0)

    def host_path(self, path: str) -> Path:
        return super().host_path(path.replace("..", "__"))


def _storable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def test_ten_thousand_hostile_turns_through_parser_and_toolbox():
    turns = HostileTurns(seed=14)
    kinds: dict[ToolErrorKind, int] = {}

    async def go() -> int:
        n_calls = 0
        box = _ContainedFake()
        try:
            toolbox = Toolbox(box, tests_dir=None, test_command=None, test_timeout_s=5,
                              exec_timeout_s=5)  # fmt: skip
            for _ in range(N_TURNS):
                turn = turns.next()
                text = bytes(turn).decode("utf-8", "replace") if isinstance(turn, list) else turn
                parsed = parse_tool_calls(text)
                for index, call in enumerate(parsed.tool_calls):
                    n_calls += 1
                    if call.ok:
                        result = await toolbox.call(call.name, call.arguments)
                    else:
                        assert call.error and call.arguments is None, call
                        continue
                    record = tool_record(index, call, result)
                    kinds[record.error_kind] = kinds.get(record.error_kind, 0) + 1
                    for text in (record.name, record.arguments_json, record.output):
                        assert _storable(text), (call.name, call.arguments_json[:200])
                    assert record.error_kind is not ToolErrorKind.SANDBOX_DIED, record.output
        finally:
            await box.close()
        return n_calls

    n_calls = asyncio.run(go())
    assert n_calls > N_TURNS  # several calls per turn sometimes
    assert set(turns.kinds) >= {"surrogates", "deep", "numbers", "bad_bytes", "huge", "editor"}
    # the hostile classes were refused as data, and plenty of calls still ran
    assert kinds[ToolErrorKind.NONE] > 1000 and kinds[ToolErrorKind.BAD_ARGUMENTS] > 100
    assert kinds[ToolErrorKind.TOOL_ERROR] > 100 and kinds[ToolErrorKind.UNKNOWN_TOOL] > 100
