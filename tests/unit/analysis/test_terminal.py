"""analysis.terminal: what a policy writes is shown as visible escapes, never acted on."""

from __future__ import annotations

import json

import pytest

from sandpiper.analysis.terminal import json_safe, neutralize

ATTACKS = {
    "window title (OSC 0)": "\x1b]0;owned\x07",
    "window title (OSC 2, ST)": "\x1b]2;owned\x1b\\",
    "clipboard (OSC 52)": "\x1b]52;c;cm0gLXJmIH4K\x07",
    "hyperlink (OSC 8)": "\x1b]8;;http://evil/\x1b\\click\x1b]8;;\x1b\\",
    "cursor up and erase": "\x1b[3A\x1b[2K",
    "conceal": "\x1b[8mhidden\x1b[0m",
    "bell": "\x07",
    "carriage return overwrite": "rm -rf /\rls",
    "C1 CSI": "\x9b2J",
    "right-to-left override": "\u202eexe.txt",
    "lone surrogate": "\ud800",
    "DEL and backspace": "a\x7f\x08b",
}


@pytest.mark.parametrize("text", list(ATTACKS.values()), ids=list(ATTACKS))
def test_no_character_a_terminal_acts_on_is_left(text: str) -> None:
    shown = neutralize(text)
    assert not any(ord(c) < 0x20 and c not in "\t\n" for c in shown), shown
    assert not any(0x7F <= ord(c) <= 0x9F for c in shown), shown
    assert "\u202e" not in shown and "\ud800" not in shown
    shown.encode("utf-8")  # printable on any UTF-8 terminal


def test_escapes_are_visible_and_the_rest_is_kept() -> None:
    assert neutralize("\x1b]0;owned\x07") == "\\x1b]0;owned\\x07"
    assert neutralize("\u202eexe.txt") == "\\u202eexe.txt"
    assert neutralize("\x9b") == "\\x9b"
    plain = "line 1\n\tindented — ünïcode ✓ 数学 [red]not markup[/red]"
    assert neutralize(plain) == plain


def test_json_safe_is_lossless_and_escapes_c1_and_bidi() -> None:
    value = {"out": "a\x1b[2Jb\x9b1m\u202ec\x7f", "n": 1}
    text = json_safe(json.dumps(value, ensure_ascii=False))
    assert json.loads(text) == value
    assert not any(0x7F <= ord(c) <= 0x9F or c == "\u202e" or ord(c) < 0x20 for c in text)
