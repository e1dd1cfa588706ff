"""Rewards: every scorer of an episode's answer or test run.

- :mod:`.reference` — a task's reward reference (the tagged union on ``reward``).
- :mod:`.compute` — ``compute_reward``: reference + answer → reward and breakdown.
- :mod:`.answer_scores` — exact match, math equivalence, ROUGE.
- :mod:`.llm_in_sandbox_scores` — the LLM-in-Sandbox-RL peer's scorers, by domain.
- :mod:`.result_formats` — the reward of a test run, read in the format the task declares.
- :mod:`.worker` — ``score_answer``: the slow kinds scored in a worker process, with a deadline.

Nothing here imports the episode loop, the tasks or the daemon (``.importlinter``).
"""
