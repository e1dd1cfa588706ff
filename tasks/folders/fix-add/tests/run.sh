#!/bin/bash
# Three checks of add(); prints the pass fraction as a JSON reward line.
cd /workspace && python3 - <<'PY'
import json
cases = [((1, 2), 3), ((0, 0), 0), ((-4, 9), 5)]
passed = 0
try:
    from calc import add
    passed = sum(add(*args) == want for args, want in cases)
except Exception:
    pass
print(json.dumps({"reward": passed / len(cases), "passed": passed, "total": len(cases)}))
PY
