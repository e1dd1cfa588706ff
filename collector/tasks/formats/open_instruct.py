"""open-instruct ``SWERLSandboxEnv`` task folders, as open-instruct lays them out::

    <task_id>/instruction.md          the task (stripped, as open-instruct reads it)
    <task_id>/environment/seeds/      seed files, copied to /workspace/ before the episode
    <task_id>/tests/test.sh           entry point, run as ``bash /tests/test.sh`` at submit;
                                      writes its reward to /logs/verifier/reward.txt
    <task_id>/setup.sh                optional, run after seeding
    <task_id>/image.txt               optional image tag for this task

``tests/`` is copied to ``/tests`` only at submit (as the versions of open-instruct that defer
it "to prevent peeking" do; older ones copy it at reset, where the agent could read or change
it). The reward is read only from ``reward.txt`` (``float(text.strip())``, clamped to [0, 1],
as open-instruct reads it), with **no** exit-status fallback
(their ``test.sh`` exits 0 whether the answer passes or not, so the fallback would pay wrong
answers); a missing ``test.sh`` is a broken task (an invalid episode), not a reward of 0;
``image.txt`` names a local podman image (a missing one makes each episode invalid).

open-instruct's *dataset rows* point at those folders: ``messages`` (the prompt the model
sees: system and user messages), ``ground_truth`` (the task id), ``dataset`` (``passthrough``:
the environment's reward only) and ``env_config``, in any of the three shapes its
``_normalize_env_config_column`` accepts — ``{"env_name": "swerl_sandbox", "task_id": ...,
"image": ...}``, ``{"env_configs": [that], "max_steps": N}`` or a list of entries. The
entry's ``task_id`` names the folder ``{task_data_dir}/{task_id}`` and its ``image`` wins over
``image.txt`` (``SWERLSandboxEnv._do_reset``: the per-sample image, then ``image.txt``). As in
open-instruct the prompt is the row's messages (the environment's reset observation,
``instruction.md``, is discarded there); ``instruction.md`` is the prompt only for a row
without messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sandpiper.collector.rewards.reference import TestsReference
from sandpiper.collector.tasks.model import Task, row_prompt, safe_id
from sandpiper.errors import TaskError

SEEDS = "environment/seeds"
TESTS_DEST = "/tests"
TEST_SCRIPT = "test.sh"
REWARD_FILE = "/logs/verifier/reward.txt"
ENV_NAME = "swerl_sandbox"
"""``config_name`` of open-instruct's ``SWERLSandboxEnv``: the env_config entry read here."""


def is_folder(folder: Path) -> bool:
    """An open-instruct task folder (and not a Sandpiper one, which has task.toml or files/)."""
    if not (folder / "instruction.md").is_file():
        return False
    if (folder / "task.toml").exists() or (folder / "files").exists():
        return False
    return (
        (folder / SEEDS).is_dir()
        or (folder / "tests" / TEST_SCRIPT).is_file()
        or (folder / "image.txt").is_file()
    )


def image(folder: Path) -> str | None:
    """The tag in ``image.txt`` (None when absent or blank, as open-instruct treats it)."""
    path = folder / "image.txt"
    if not path.is_file():
        return None
    return path.read_text().strip() or None


def folder_task(
    folder: Path,
    *,
    task_id: str | None = None,
    instruction: str | None = None,
    system_prompt: str | None = None,
    image_tag: str | None = None,
) -> Any:
    """The :class:`~sandpiper.collector.tasks.model.Task` of one open-instruct folder; a dataset
    row's prompt and image replace the folder's ``instruction.md`` and ``image.txt``."""
    if instruction is None:
        instruction_file = folder / "instruction.md"
        if not instruction_file.is_file():
            raise TaskError(f"{folder}: no instruction.md (and no prompt in a dataset row)")
        instruction = instruction_file.read_text().strip()
    return Task(
        task_id=safe_id(task_id or folder.name, str(folder)),
        instruction=instruction,
        reference=TestsReference(result_format="reward_file"),
        source=folder.parent.name,
        format="open_instruct",
        data_dir=folder,
        image=image_tag or image(folder),
        files_subdir=SEEDS,
        test_script=TEST_SCRIPT,
        tests_dest=TESTS_DEST,
        reward_file=REWARD_FILE,
        result_format="reward_file",
        system_prompt=system_prompt,
    )


def is_row(row: dict[str, Any]) -> bool:
    """An open-instruct dataset row with an ``env_config``."""
    return row.get("env_config") is not None


def env_entry(row: dict[str, Any], where: str) -> dict[str, Any]:
    """The ``swerl_sandbox`` entry of a row's ``env_config`` (any of open-instruct's shapes)."""
    config = row["env_config"]
    if isinstance(config, list):
        entries = config
    elif isinstance(config, dict):
        entries = config.get("env_configs") or ([config] if "env_name" in config else [])
    else:
        raise TaskError(
            f"{where}: field 'env_config' must be an object or a list of objects, "
            f"not {type(config).__name__}"
        )
    for entry in entries:
        if isinstance(entry, dict) and entry.get("env_name") == ENV_NAME:
            return entry
    names = [e.get("env_name") for e in entries if isinstance(e, dict)]
    raise TaskError(
        f"{where}: env_config has no {ENV_NAME!r} entry (it has {names or 'none'}); only "
        f"open-instruct's SWERL sandbox tasks (env_name {ENV_NAME!r}) can be imported"
    )


def row_task(row: dict[str, Any], where: str, task_data_dir: Path) -> Any:
    """The task one open-instruct dataset row names (see the module docstring)."""
    entry = env_entry(row, where)
    task_id = entry.get("task_id")
    if not isinstance(task_id, str) or not task_id.strip():
        raise TaskError(f"{where}: the env_config entry {ENV_NAME!r} has no 'task_id'")
    folder = (Path(task_data_dir) / task_id).resolve()
    if not folder.is_dir():
        raise TaskError(
            f"{where}: no task folder {folder} for task_id {task_id!r}; point --task-data-dir "
            "at the folder holding open-instruct's task data (its extracted task-data.tar.gz)"
        )
    image_tag = entry.get("image")
    if image_tag is not None and not isinstance(image_tag, str):
        raise TaskError(f"{where}: env_config image must be an image name, got {image_tag!r}")
    instruction = system = None
    if any(row.get(k) for k in ("messages", "prompt")):
        instruction, system = row_prompt(row, where)
    return folder_task(
        folder,
        task_id=task_id,
        instruction=instruction,
        system_prompt=system,
        image_tag=(image_tag or "").strip() or None,
    )
