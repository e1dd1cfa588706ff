"""Text from a sandbox, made safe to show: one function for every place it is displayed.

Tool outputs, model text, tool names, file names and test output are written by the policy
(an adversary of its reward) and stored raw. Shown raw, they would drive the operator's
terminal: ``ESC ] 0 ;`` sets the window title, ``ESC ] 52 ;`` writes the clipboard,
``ESC [ … H`` moves the cursor over earlier lines, ``ESC [ 8 m`` conceals text, ``\\r``
overwrites a line, BEL rings, the C1 form ``\\x9b`` starts a CSI on some terminals, and
bidirectional overrides (``U+202E``) show text in another order than it is stored.

:func:`neutralize` replaces each such character with its visible Python escape
(``\\x1b``, ``\\u202e``), keeping newlines and tabs. ``sandpiper show``, ``sandpiper sql`` and
the HTML report pass every stored string through it; the store keeps the raw text.
:func:`json_safe` does the lossless equivalent for JSON output (``\\u`` escapes).
"""

from __future__ import annotations

import re

_UNSAFE = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f"  # C0 controls but tab and newline, DEL, C1 controls
    "\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069"  # bidirectional marks and overrides
    "\ud800-\udfff]"  # lone surrogates (cannot even be encoded for a terminal)
)
_JSON_UNSAFE = re.compile("[\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
"""What a JSON encoder may leave raw inside strings but a terminal would act on."""


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def neutralize(text: str) -> str:
    """``text`` with every control, bidirectional and surrogate character shown as an escape
    (``"\\x1b]0;title\\x07"`` → ``"\\\\x1b]0;title\\\\x07"``); newlines and tabs kept."""
    return _UNSAFE.sub(_escape, text)


def json_safe(text: str) -> str:
    """JSON text with the characters a terminal acts on written as ``\\u`` escapes: the
    same JSON value (lossless), safe to print. C0 controls are escaped by any encoder."""
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
