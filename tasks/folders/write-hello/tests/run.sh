#!/bin/bash
# Reward 1 when /workspace/hello.txt holds exactly "hello" (a trailing newline is fine).
if [ "$(cat /workspace/hello.txt 2>/dev/null)" = "hello" ]; then
  echo '{"reward": 1.0, "passed": 1, "total": 1}'
else
  echo '{"reward": 0.0, "passed": 0, "total": 1}'
fi
