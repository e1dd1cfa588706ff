"""The shell's state report (``declare -px`` parsed by ``supervisor.state.parse_state``) keeps
every exported value byte-exact, compared with what a program started by that bash sees in
its environment: the exact answer, whatever the value holds."""

from __future__ import annotations

import os
import random
import subprocess

from sandpiper.collector.sandbox.supervisor import state as sup

NASTY = [
    "", "plain", "two words", 'q"uote', "back\\slash", "dol$lar", "back`tick", "it's",
    "new\nline", "\n", "tab\there", "\x01ctrl\x1f", "esc\x1bseq", "\x7f", "caf\u00e9", "\u202e",
    "\\n not a newline", "$'ansi'", "trailing\\", "=equals=", "\\0", "\\x41", "\\101",
]  # fmt: skip


def report(exports: dict[str, bytes]) -> tuple[sup.State, dict[bytes, bytes]]:
    """Run the prelude with ``exports`` set in the command; return the parsed state and the
    environment a child of that bash received (``env -0``, the ground truth)."""
    assignments = "".join(f'export {k}="${{SRC_{k}}}"; unset SRC_{k}; ' for k in exports)
    src = {f"SRC_{k}".encode(): v for k, v in exports.items()}
    r, w = os.pipe()
    proc = subprocess.run(
        ["/bin/bash", "-c", sup.PRELUDE, "bash", str(w), assignments + "env -0"],
        env={b"PATH": b"/usr/bin:/bin", b"LANG": b"C.UTF-8", **src},
        pass_fds=(w,), capture_output=True, check=True,
    )  # fmt: skip
    os.close(w)
    with os.fdopen(r, "rb") as f:
        blob = f.read()
    state = sup.State()
    sup.parse_state(blob, state)
    seen = dict(item.partition(b"=")[::2] for item in proc.stdout.split(b"\0") if item)
    return state, seen


def test_every_nasty_value_round_trips_byte_exact():
    exports = {f"V{i}": v.encode() for i, v in enumerate(NASTY)}
    exports["RAW"] = bytes(range(1, 256))  # every byte but NUL, invalid UTF-8 included
    state, seen = report(exports)
    for key, value in exports.items():
        assert state.env[key].encode("utf-8", "surrogateescape") == value, key
        assert seen[key.encode()] == value
    assert not any(k.startswith("__sp_") for k in state.env)
    # ``_`` is the path bash sets for each program it starts, not a variable of the shell
    assert set(state.env) == {k.decode() for k in seen if not k.startswith(b"__sp_")} - {"_"}


def test_random_values_round_trip():
    rng = random.Random(17)
    for _ in range(20):
        exports = {
            f"R{i}": bytes(rng.choice([*range(1, 128), *range(1, 256)]) for _ in range(24))
            for i in range(8)
        }
        state, seen = report(exports)
        for key, value in exports.items():
            assert state.env[key].encode("utf-8", "surrogateescape") == value, (key, value)
            assert seen[key.encode()] == value


def test_arrays_and_unset_exports_are_skipped_and_a_cut_report_keeps_the_state():
    state = sup.State()
    state.cwd, state.env = "/before", {"KEEP": "1"}
    blob = b'/w\0declare -ax a=([0]="1")\ndeclare -x U\ndeclare -x X="1"\n'
    sup.parse_state(blob, state)
    assert (state.cwd, state.env) == ("/w", {"X": "1"})
    sup.parse_state(b'/w2\0declare -x Y="1"\ndeclare -x Z="tru', state)  # killed mid-write
    assert (state.cwd, state.env) == ("/w", {"X": "1"})
    sup.parse_state(b"", state)  # killed before reporting
    assert (state.cwd, state.env) == ("/w", {"X": "1"})
