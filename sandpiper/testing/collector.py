"""Collector test doubles: a scripted policy, a fake toolbox, store, writer and pool.

- :class:`ScriptedPolicy` implements ``PolicyClient``: each ``generate`` call pops the next
  scripted reply text, tokenizes it (plus the end-of-turn token) and returns it with fake
  logprobs and the current version; it records every prompt it was sent.
- :func:`scripted_sandbox`: the one fake sandbox (:class:`sandpiper.testing.sandbox.FakeSandbox`) with canned
  command results (``ran: <command>``); it can be told to die.
- :class:`FakeToolbox` mimics ``collector.episode.tools.Toolbox``'s observable behaviour for the loop:
  ``execute_bash``, ``submit`` (with a fixed test reward) and unknown-tool errors.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from sandpiper.collector.episode.tools.base import ToolResult
from sandpiper.collector.inference.base import Generation, SamplingParams
from sandpiper.errors import InferenceError
from sandpiper.store.records import ToolErrorKind
from sandpiper.testing.sandbox import FakeSandbox

if TYPE_CHECKING:
    from sandpiper.collector.daemon.store_role import CollectorStore
    from sandpiper.collector.sandbox.base import SandboxSource, ToolSandbox
    from sandpiper.store.records import GroupRecord
    from sandpiper.store.writer import GroupSink, OnOutcome

FAKE_TOOL_SCHEMAS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} tool",
            "parameters": {"type": "object", "properties": props, "required": list(props)},
        },
    }
    for name, props in [
        ("execute_bash", {"command": {"type": "string"}, "timeout": {"type": "integer"}}),
        ("submit", {"answer": {"type": "string"}}),
    ]
]


class ScriptedPolicy:
    """A PolicyClient that replies with scripted texts (cycled when ``cycle`` is set)."""

    def __init__(
        self,
        tokenizer: Any,
        replies: list[str | Exception],
        *,
        version: int = 0,
        cycle: bool = False,
        delay_s: float = 0.0,
    ) -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.version = version
        self.cycle = cycle
        self.delay_s = delay_s
        self.prompts: list[list[int]] = []
        self.params: list[SamplingParams] = []
        self._next = 0
        self.eos_id = int(tokenizer.convert_tokens_to_ids(tokenizer.eos_token))

    @property
    def policy_version(self) -> int:
        return self.version

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        self.params.append(params)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self._next >= len(self.replies):
            if not self.cycle:
                raise InferenceError("script exhausted")
            self._next = 0
        reply = self.replies[self._next]
        self._next += 1
        if isinstance(reply, Exception):
            raise reply
        ids = [*self.tokenizer.encode(reply, add_special_tokens=False), self.eos_id]
        finish = "stop"
        if len(ids) > params.max_tokens:
            ids, finish = ids[: params.max_tokens], "length"
        # asked for top logprobs: the sampled token first, then ids 0, 1, ... less likely
        top = tuple(
            tuple([(i, -0.5), *((j, -1.0 - j) for j in range(params.top_logprobs) if j != i)])[
                : params.top_logprobs
            ]
            for i in ids
        )
        return Generation(
            token_ids_T=np.asarray(ids, dtype=np.int32),
            logprobs_T=np.full(len(ids), -0.5, dtype=np.float32),
            policy_versions_T=np.full(len(ids), self.version, dtype=np.int32),
            finish_reason=finish,
            top_logprobs=top if params.top_logprobs else None,
        )


def scripted_sandbox(sandbox_id: str | None = None) -> FakeSandbox:
    """The fake sandbox answering ``ran: <command>`` (tests of the loop, not of the tools)."""
    return FakeSandbox(sandbox_id, scripted=True)


class FakeToolbox:
    """``execute_bash`` runs in the fake sandbox; ``submit`` returns ``test_reward``."""

    def __init__(
        self, sandbox: FakeSandbox, *, test_reward: float | None = None, tool_delay_s: float = 0
    ) -> None:
        self.sandbox = sandbox
        self.test_reward = test_reward
        self.tool_delay_s = tool_delay_s
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        self.calls.append((name, arguments))
        if self.tool_delay_s:
            await asyncio.sleep(self.tool_delay_s)
        if name == "execute_bash":
            if not isinstance(arguments.get("command"), str):
                return ToolResult("Error: `command` must be a string", ToolErrorKind.BAD_ARGUMENTS)
            if self.sandbox.dead:
                return ToolResult("sandbox died", ToolErrorKind.SANDBOX_DIED)
            result = await self.sandbox.exec(arguments["command"])
            return ToolResult(result.stdout, exit_code=result.exit_code, duration_ms=1.0)
        if name == "submit":
            answer = arguments.get("answer")
            return ToolResult(
                "submitted",
                submitted=True,
                answer=answer if isinstance(answer, str) else None,
                test_reward=self.test_reward,
                test_details={"passed": 1, "total": 1} if self.test_reward is not None else {},
            )
        return ToolResult(f"Error: unknown tool {name!r}", ToolErrorKind.UNKNOWN_TOOL)


class FakeStore:
    """The slice of ``store.Store`` the daemon uses, in memory, by room as the real store
    composes them: ``slots`` (:class:`FakeSlots`: free slots first by (seq, rank), else a new
    round of the least-sampled tasks, as in the real store), ``claims`` (group counts and
    ids), ``policy_versions`` (the latest policy)."""

    def __init__(self) -> None:
        from sandpiper.store.records import GroupStatus

        self.counts = {s: 0 for s in GroupStatus}
        self.policy = None
        self.committed: list[str] = []
        self.polls = 0
        self.heartbeats: list[str] = []
        self.announced: list[tuple[str, int]] = []
        """(collector id, policy version) of heartbeats that named a version."""
        self.stopped: list[str] = []
        self.slots = FakeSlots(self)
        self.claims = FakeClaims(self)
        self.policy_versions = FakePolicyVersions(self)


class FakeClaims:
    """The collector's reads of ``store.claims`` (``store/claims.py:Claims``)."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store

    def group_ids(self, run_id: str, status=None) -> list[str]:
        return list(self.store.committed)

    def group_counts(self, run_id: str):
        self.store.polls += 1
        return dict(self.store.counts)


class FakePolicyVersions:
    """The collector's read of ``store.policy_versions`` (``store/policies.py:PolicyVersions``)."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store

    def latest(self, run_id: str):
        return self.store.policy


class FakeSlots:
    """``store.slots`` (``store/slots.py:Slots``) as the running collector calls it."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.table: dict[tuple[str, int], dict] = {}
        """(task_id, seq) -> {"split", "rank", "status", "holder", "lease"}."""

    def heartbeat(self, collector_id: str, *, policy_version=None) -> bool:
        self.store.heartbeats.append(collector_id)
        if policy_version is not None:
            self.store.announced.append((collector_id, policy_version))
        return collector_id not in self.store.stopped

    def stop(self, collector_id: str) -> int:
        self.store.stopped.append(collector_id)
        mine = [
            s
            for s in self.table.values()
            if s["holder"] == collector_id and s["status"] == "leased"
        ]
        for slot in mine:
            slot["status"] = "free"
        return len(mine)

    def claim(self, *, run_id, collector_id, tasks, ttl_s, n=1, split, only=None):
        from sandpiper.store.records import SlotLease

        leases: list[SlotLease] = []
        while len(leases) < n:
            free = sorted(
                (s["seq"], s["rank"], t)
                for (t, _), s in self.table.items()
                if s["status"] == "free" and s["split"] == split and (only is None or t in only)
            )
            if not free:
                wanted = [(t, r) for t, r in tasks if only is None or t in only]
                nxt = {
                    t: 1 + max((q for (u, q) in self.table if u == t), default=-1)
                    for t, _ in wanted
                }
                low = min(nxt.values())
                for t, r in wanted:
                    if nxt[t] == low:
                        self.table[(t, low)] = {"seq": low, "rank": r, "split": split,
                                                "status": "free", "holder": None, "lease": 0}  # fmt: skip
                continue
            seq, _, task_id = free[0]
            slot = self.table[(task_id, seq)]
            slot.update(status="leased", holder=collector_id, lease=slot["lease"] + 1)
            leases.append(SlotLease(run_id, task_id, seq, slot["lease"], collector_id))
        return leases

    def release(self, lease) -> bool:
        slot = self.table[(lease.task_id, lease.seq)]
        if slot["lease"] != lease.lease or slot["status"] != "leased":
            return False
        slot["status"] = "free"
        return True


class FakeWriter:
    """Acknowledges groups and "commits" them into a FakeStore at once, reporting outcomes
    (idempotent by group id; a slot whose lease changed is superseded)."""

    spool: Path | None = None
    """No spool: a put is committed at once."""

    def __init__(self, store: FakeStore) -> None:
        self.store = store
        self.groups: list[GroupRecord] = []
        self.on_outcome: OnOutcome | None = None

    def put(self, group: GroupRecord) -> None:
        from sandpiper.store.records import GroupStatus, Split, WriteOutcome

        seq = int(group.group_id.rpartition("/")[2])
        slot = self.store.slots.table.get((group.task_id, seq))
        if group.group_id in self.store.committed:
            outcome = WriteOutcome.REPLAYED
        elif slot is not None and slot["lease"] != group.slot_lease:
            outcome = WriteOutcome.SUPERSEDED
        else:
            outcome = WriteOutcome.STORED
            if slot is not None:
                slot["status"] = "done"
            self.store.committed.append(group.group_id)
            self.groups.append(group)
            if group.split is Split.TRAIN:
                self.store.counts[GroupStatus.READY] += 1
        if self.on_outcome is not None:
            self.on_outcome(group, outcome)

    def pending(self) -> int:
        return 0

    def flush(self, timeout_s: float | None = None) -> None:
        pass

    def close(self) -> None:
        pass


class FakePool:
    """Hands out FakeSandboxes; records releases."""

    def __init__(self, fail: Exception | None = None) -> None:
        self.fail = fail
        """Raised by every ``acquire`` (a missing image, a failing start)."""
        self.acquired = 0
        self.released: list[tuple[str, bool]] = []
        self.images: list[str | None] = []
        self.started = self.closed = False
        self.config: Any = None
        self._boxes: list[FakeSandbox] = []

    async def start(self) -> None:
        self.started = True

    async def close(self) -> None:
        """Remove every sandbox's folder, as the real pool removes its containers."""
        self.closed = True
        boxes, self._boxes = self._boxes, []
        for box in boxes:
            await box.close()

    async def acquire(
        self, *, episode_id: str, task_id: str, image: str | None = None
    ) -> FakeSandbox:
        if self.fail is not None:
            raise self.fail
        self.acquired += 1
        self.images.append(image)
        box = scripted_sandbox(f"box-{self.acquired}")
        self._boxes.append(box)
        return box

    async def release(self, sandbox: ToolSandbox, *, broken: bool = False) -> None:
        self.released.append((sandbox.id, broken))

    @contextlib.asynccontextmanager
    async def session(self, *, episode_id: str, task_id: str) -> AsyncIterator[FakeSandbox]:
        box = await self.acquire(episode_id=episode_id, task_id=task_id)
        try:
            yield box
        except BaseException:
            await self.release(box, broken=True)
            raise
        await self.release(box)


class ReloadablePolicy(ScriptedPolicy):
    """A ScriptedPolicy with ``reload`` (records the checkpoints it was given)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reloads: list[tuple[str, int]] = []

    async def reload(self, checkpoint_dir: str, version: int) -> None:
        self.reloads.append((str(checkpoint_dir), version))
        self.version = version


if TYPE_CHECKING:  # mypy holds the fakes to the Protocols the daemon's doors are typed with
    _FAKE_STORE: CollectorStore = FakeStore()
    _FAKE_WRITER: GroupSink = FakeWriter(FakeStore())
    _FAKE_POOL: SandboxSource = FakePool()
