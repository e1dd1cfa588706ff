"""The shell's state between commands: the working directory and the exported environment.

Each command reports them when it exits (:data:`PRELUDE`, on a pipe of its own), and
:func:`parse_state` reads that report back; shell functions, aliases and options are not
kept. The image's base environment (:data:`BASE_ENV`) starts every sandbox and every reset."""

import re

WORKSPACE = "/workspace"
BASE_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "TERM": "dumb",
    "PAGER": "cat",
    "GIT_PAGER": "cat",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
}
# Runs before the command inside bash: state is reported on the state pipe at exit (the
# working directory, then ``declare -px``: builtins only, no fork; a ``$(compgen -e)`` loop
# cost 0.6 ms of CPU per command, half of what bash itself costs); the command's processes
# volunteer to be the OOM killer's first choice.
PRELUDE = r"""
echo 1000 > /proc/self/oom_score_adj 2>/dev/null
__sp_report() {
  __sp_rc=$?
  { builtin printf '%s\0' "$PWD"; builtin declare -px; } >&"$__sp_fd" 2>/dev/null
  exit $__sp_rc
}
trap __sp_report EXIT
set -a
__sp_fd=$1; __sp_cmd=$2; shift 2
eval "$__sp_cmd"
"""
_DECLARED = re.compile(
    rb"declare -[a-zA-Z]+ ([A-Za-z_][A-Za-z0-9_]*)"
    rb"""(?:=("(?:[^"\\]|\\.)*"|\$'(?:[^'\\]|\\.)*'))?""",
    re.S,
)
"""One line of bash's ``declare -px`` for a scalar: a name, then its value double-quoted
(``\\`` before ``"``, ``\\``, ``$`` and a backquote) or, when it holds a byte the locale
cannot print (a newline always), ANSI-C quoted (``$'...'``), so a value never spans lines;
an exported variable without a value has no ``=``. Arrays (``=(...)``) are never passed to a
program's environment and are skipped."""
_ANSI_C = {
    b"a": b"\a", b"b": b"\b", b"e": b"\x1b", b"E": b"\x1b", b"f": b"\f", b"n": b"\n",
    b"r": b"\r", b"t": b"\t", b"v": b"\v",
}  # fmt: skip


def _ansi_c_escape(m: "re.Match[bytes]") -> bytes:
    code = m.group(1)
    if code[:1] in b"01234567":
        return bytes([int(code, 8) & 0xFF])
    if code[:1] == b"x":
        return bytes([int(code[1:], 16)])
    return _ANSI_C.get(code, code)  # \\ \' \" and anything else: the character itself


def declared_value(quoted: bytes) -> bytes:
    """The bytes of one value as ``declare -p`` quoted it."""
    if quoted.startswith(b"$'"):
        return re.sub(rb"\\([0-7]{1,3}|x[0-9A-Fa-f]{1,2}|.)", _ansi_c_escape, quoted[2:-1],
                      flags=re.S)  # fmt: skip
    return re.sub(rb'\\([\\"$`])', rb"\1", quoted[1:-1])


class State:
    """The working directory and environment the next command starts with."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.cwd = WORKSPACE
        self.env = dict(BASE_ENV)


def parse_state(blob: bytes, state: State) -> None:
    """Update ``state`` from a command's report (left as it was when the report is cut)."""
    cwd, sep, declared = blob.partition(b"\0")
    if not sep or declared[-1:] not in (b"", b"\n"):
        return  # killed before (or while) reporting: keep the previous state
    env = {}
    for line in declared[:-1].split(b"\n") if declared else ():
        m = _DECLARED.fullmatch(line)
        if m is None:
            continue  # an array
        name, quoted = m.groups()
        if quoted is not None and not name.startswith(b"__sp_"):
            env[name.decode()] = declared_value(quoted).decode("utf-8", "surrogateescape")
    state.cwd = cwd.decode("utf-8", "surrogateescape")
    state.env = env
