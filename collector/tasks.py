"""Task sources: JSONL prompts, task folders (Sandpiper and open-instruct); splits.

Sources the collector accepts (``collector.tasks`` in the config):

- **JSONL** — one task per line. Prompt tasks: ``prompt`` (or ``question`` / ``problem`` /
  ``instruction`` / ``messages``; text or a list of chat messages) and ``answer`` (or
  ``ground_truth`` / ``solution``), optional ``id``, ``reward`` (``math`` default, ``exact``,
  ``rouge``), ``banned_patterns``, ``split``. A line with ``data_dir`` points at a task folder
  (relative to the file; ``instruction``, ``system`` and ``image`` in that line replace the
  folder's own). An open-instruct dataset row (``env_config``) names an open-instruct folder
  next to the file. Peers' rows that need files in the sandbox (LLM-in-Sandbox-RL, TRL +
  Daytona, Aviato) are converted first by ``sandpiper tasks import``
  (:mod:`sandpiper.collector.task_import`).
- **Task folder** (one per task)::

      <task_id>/instruction.md   what the agent is asked
      <task_id>/files/           seed files, copied into /workspace before the episode
      <task_id>/tests/run.sh     test script; it reports in the declared result format
                                 (collector.tools.reward); tests/ reaches the sandbox only at
                                 submit, and runs as a uid the agent never has
      <task_id>/setup.sh         optional, run in /workspace before the episode
      <task_id>/task.toml        optional: image, reward, answer, banned_patterns,
                                 test_command, result_format, subject_command,
                                 tests_see_agent_processes, split

  or an open-instruct folder (``environment/seeds/``, ``tests/test.sh`` writing
  ``/logs/verifier/reward.txt``, ``image.txt``: :mod:`sandpiper.collector.task_formats.open_instruct`).
- **A folder of task folders**, or a folder with a ``tasks.jsonl`` index.

A task that cannot run as declared (``Task.check``) is not refused here: each of its episodes
is invalid with ``task_error`` (a task's failure is data). Splits are deterministic: a task
whose id hashes below ``validation_fraction`` is a validation task, unless it states its split.
"""

from __future__ import annotations

from sandpiper.collector.task_import import convert_llm_in_sandbox, import_tasks  # noqa: F401
from sandpiper.collector.task_loading import (  # noqa: F401 (the public API of task sources)
    OVERRIDE_KEYS,
    load_task_folder,
    load_tasks,
    needs_import,
    task_from_row,
)
from sandpiper.collector.task_model import (  # noqa: F401
    DEFAULT_TESTS_DEST,
    Task,
    assign_split,
    missing_field,
    split_of,
)
