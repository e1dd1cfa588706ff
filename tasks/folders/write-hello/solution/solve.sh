# Reference solution: run in /workspace as the agent, before submit.
echo hello > hello.txt
