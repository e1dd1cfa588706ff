#!/usr/bin/env bash
# Run a command beside a neighbour: one busy loop on one core for the command's whole run
# (docs/testing.md: `make test` must stay under 13 minutes so, 10 without it).
#
#   scripts/neighbour.sh make test
#
# The loop is this script's child, tracked by its pid and stopped when the command ends
# (or this script is interrupted); the command's exit status is this script's.
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: $0 COMMAND [ARGS...]" >&2; exit 2; }
bash -c 'while :; do :; done' &
loop=$!
trap 'kill "$loop" 2>/dev/null || true' EXIT
echo "[neighbour] busy loop pid $loop beside: $*" >&2
started=$(date +%s)
status=0
"$@" || status=$?
echo "[neighbour] '$*' took $(( $(date +%s) - started )) s beside the busy loop (exit $status)" >&2
exit "$status"
