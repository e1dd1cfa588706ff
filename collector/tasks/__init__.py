"""Tasks: what the collector runs an episode on.

- :mod:`.model` — the :class:`~sandpiper.collector.tasks.model.Task` and the primitives every
  source shares (field names, prompts, ids, splits).
- :mod:`.loading` — the sources the collector accepts (JSONL, task folders, folders of them)
  and their splits.
- :mod:`.importer` — ``sandpiper tasks import``: peers' data into task folders.
- :mod:`.formats` — one module per peer format (open-instruct, LLM-in-Sandbox-RL,
  TRL + Daytona, Aviato).
"""
