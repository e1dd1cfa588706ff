# Reference solution: run in /workspace as the agent, before submit.
sed -i 's/return a - b/return a + b/' calc.py
