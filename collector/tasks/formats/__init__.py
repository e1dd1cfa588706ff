"""Peers' task formats, read as the peers write them.

One module per peer format; each turns the peer's records into Sandpiper task folders (or
``Task`` objects). Where the peer scores answers its own way, that scorer is in
:mod:`sandpiper.collector.rewards` with the others (LLM-in-Sandbox-RL:
:mod:`sandpiper.collector.rewards.llm_in_sandbox_scores`), so that the rewards never import
the task formats. The formats:

- :mod:`.open_instruct` — open-instruct ``SWERLSandboxEnv`` task folders.
- :mod:`.llm_in_sandbox` — LLM-in-Sandbox-RL rows and the rllm JSON array; scored by domain.
- :mod:`.aviato` — Aviato's TRL GRPO rows (code run in a fresh sandbox: 1.0 when it exits 0).
- :mod:`.trl_daytona` — TRL + Daytona code tasks (tests, banned substrings, penalty -1).

``docs/tasks.md`` has one row per format: fields, reward, what is not supported and why.
"""
