"""Run a command in the episode's sandbox from an external agent (the host side of exec).

    python -m sandpiper.collector.gateway.exec_client 'ls -la /workspace'

prints the command's output and exits with its exit status (124 on a timeout, 125 when the
gateway refused or could not be reached). The episode comes from ``SANDPIPER_EXEC_URL``,
which the collector sets for the agent process. :func:`run` is the same as a function.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any


def run(command: str, *, timeout_s: float = 30.0, url: str | None = None) -> dict[str, Any]:
    """``{"output", "returncode", "timed_out", "error_kind"}`` of ``command`` in the sandbox."""
    url = url or os.environ.get("SANDPIPER_EXEC_URL")
    if not url:
        raise RuntimeError("SANDPIPER_EXEC_URL is not set (the collector sets it per episode)")
    body = json.dumps({"command": command, "timeout_s": timeout_s}).encode()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s + 60) as response:
        return json.loads(response.read())


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    try:
        result = run(" ".join(args))
    except (OSError, urllib.error.URLError, RuntimeError) as e:
        print(f"exec_client: {e}", file=sys.stderr)
        return 125
    sys.stdout.write(result.get("output", ""))
    if result.get("timed_out"):
        return 124
    return int(result.get("returncode", 1)) & 0xFF


if __name__ == "__main__":
    raise SystemExit(main())
