#!/bin/bash
# Three checks of add(). The agent's code never runs here, with the tests' rights: the subject
# phase (subject_command in task.toml) ran it as the agent and left what it printed in
# $SUBJECT_OUT/stdout; these tests only read that. The pass count goes to the result file.
python3 - <<'PY'
import json
import os

want = [3, 4, 5]
passed = 0
try:
    with open(os.path.join(os.environ["SUBJECT_OUT"], "stdout")) as f:
        got = json.loads(f.read().strip().splitlines()[-1])
    passed = sum(type(g) is int and g == w for g, w in zip(got, want))
except (OSError, ValueError, IndexError, TypeError):
    pass
with open(os.environ["SANDPIPER_RESULT_FILE"], "w") as f:
    json.dump({"passed": passed, "total": len(want)}, f)
PY
