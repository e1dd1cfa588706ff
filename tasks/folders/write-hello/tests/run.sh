#!/bin/bash
# Reward 1 when the workspace's hello.txt holds exactly "hello" (a trailing newline is fine),
# written to the result file the grader reads ($SANDPIPER_RESULT_FILE, out of the agent's reach).
if [ "$(cat "$WORKSPACE/hello.txt" 2>/dev/null)" = "hello" ]; then
  echo '{"passed": 1, "total": 1}' > "$SANDPIPER_RESULT_FILE"
else
  echo '{"passed": 0, "total": 1}' > "$SANDPIPER_RESULT_FILE"
fi
