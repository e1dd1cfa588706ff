"""A mini-swe-agent environment whose commands run in the episode's Sandpiper sandbox.

mini-swe-agent (``pip install mini-swe-agent``) loads environments by dotted path, so an
unmodified ``mini`` runs against a Sandpiper episode with::

    mini --environment-class collector.gateway.minisweagent_env.SandboxEnvironment \\
         --model "openai/$SANDPIPER_MODEL" --task "$SANDPIPER_TASK" --yolo --exit-immediately

(``configs/agents/mini_swe_agent.yaml`` and docs/gateway.md have the whole example). Its
model calls go to ``OPENAI_BASE_URL`` (the episode's gateway URL); its commands go to
``SANDPIPER_EXEC_URL`` and run through the sandbox's ``execute_bash`` tool. The class has the
interface of mini-swe-agent's ``LocalEnvironment`` (``execute``, ``get_template_vars``,
``serialize``) and signals the end of the task the same way (the first output line
``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``). It imports nothing from mini-swe-agent at module
level except its ``Submitted`` exception, so it can be imported wherever mini-swe-agent is.
"""

from __future__ import annotations

import platform
from typing import Any

from pydantic import BaseModel

from sandpiper.collector.gateway.exec_client import run

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


class SandboxEnvironmentConfig(BaseModel):
    cwd: str = "/workspace"
    env: dict[str, str] = {}
    timeout: int = 30
    exec_url: str | None = None
    """Defaults to ``SANDPIPER_EXEC_URL``."""


class SandboxEnvironment:
    def __init__(self, *, config_class: type = SandboxEnvironmentConfig, **kwargs: Any) -> None:
        self.config = config_class(**kwargs)

    def execute(self, action: dict, cwd: str = "", *, timeout: int | None = None) -> dict:
        command = action.get("command", "") if isinstance(action, dict) else str(action)
        cwd = cwd or self.config.cwd
        exports = "".join(f"export {k}={_quote(v)}; " for k, v in self.config.env.items())
        full = f"cd {_quote(cwd)} && {exports}{command}" if cwd else f"{exports}{command}"
        try:
            result = run(full, timeout_s=timeout or self.config.timeout, url=self.config.exec_url)
            output = {
                "output": result.get("output", ""),
                "returncode": int(result.get("returncode", -1)),
                "exception_info": "the command timed out" if result.get("timed_out") else "",
            }
        except Exception as e:  # the agent sees it as an observation, as LocalEnvironment does
            output = {"output": "", "returncode": -1, "exception_info": f"exec failed: {e}"}
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict) -> None:
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == SUBMIT_MARKER and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted(
                {
                    "role": "exit",
                    "content": submission,
                    "extra": {"exit_status": "Submitted", "submission": submission},
                }
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {**self.config.model_dump(), **platform.uname()._asdict(), **kwargs}

    def serialize(self) -> dict:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json"),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }


def _quote(value: str) -> str:
    import shlex

    return shlex.quote(value)
