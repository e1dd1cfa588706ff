"""Peers' task formats, read as the peers write them, and their rewards.

One module per peer format; each turns the peer's records into Sandpiper task folders (or
``Task`` objects) and, where the peer scores answers its own way, owns that scoring function
(called by :func:`sandpiper.collector.rewards.compute_reward`, so that graders elsewhere can call it
too):

- :mod:`.open_instruct` — open-instruct ``SWERLSandboxEnv`` task folders.
- :mod:`.llm_in_sandbox` — LLM-in-Sandbox-RL rows and the rllm JSON array; reward by domain.
- :mod:`.trl_daytona` — TRL + Daytona code tasks (tests, banned substrings, penalty -1).

``docs/tasks.md`` has one row per format: fields, reward, what is not supported and why.
"""
