"""``sandpiper gateway``: the gateway on its own, in front of the run's vLLM servers, storing
every episode in the run's store.

The collector starts a gateway itself for external-agent tasks; this serves one for agents
driven from elsewhere (a harness of your own). It starts the run's servers (or uses
``inference.server_urls``, loading the run's latest policy there), then serves until stopped:

- ``POST /episodes`` (optional ``{"episode_id", "task_id", "time_limit_s"}``) →
  ``{"episode_id", "base_url", "time_limit_s"}``;
- the agent uses ``base_url`` as its OpenAI base URL, model ``policy``;
- ``POST /episodes/<id>/close`` (optional ``{"reward": number}``) → the stop reason and
  every call's prompt ids, sampled ids, logprobs, per-token policy versions and how it
  joined the previous call (JSON).

**Nothing is lost.** Every episode becomes a stored group of one episode
(``{run}/{task_id}/gateway-{episode_id}``, through the run's :class:`GroupWriter`, as the
collector stores its groups) when it ends, whichever way: closed by its client (stop reason
``submitted``, or ``max_turns``/``max_tokens`` when a call was refused for the budget), past
its time limit (``time_limit``: closed by the gateway, graded as it stands), or still open
when the gateway stops (``cancelled``: an infrastructure stop, stored invalid with its
calls). On SIGTERM the server first finishes the calls in flight, then closes and stores the
open episodes, then flushes the writer.

It serves the same renderer, parsers and client as the collector.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from sandpiper.collector.gateway import openai_api as api
from sandpiper.collector.gateway.assembly import assemble
from sandpiper.collector.gateway.server import Gateway, _call_json, _not_found
from sandpiper.config import CollectorSettings
from sandpiper.store.records import (
    INFRA_STOPS,
    EpisodeRecord,
    GroupRecord,
    GroupSampling,
    PolicyRecord,
    Split,
    StopReason,
    utcnow,
)

if TYPE_CHECKING:
    from sandpiper.store.writer import GroupSink, GroupWriter

log = logging.getLogger(__name__)

DEFAULT_TIME_LIMIT_S = 600.0
"""An episode's time limit when its opener gives none (an external agent's default too)."""


class PolicyReader(Protocol):
    """The part of ``store.policy_versions`` (``store/policies.py:PolicyVersions``) the
    gateway reads."""

    def latest(self, run_id: str) -> PolicyRecord | None: ...


class GatewayStore(Protocol):
    """The part of ``store.Store`` the ``sandpiper gateway`` process calls: a writer on a spool
    of its own, and the latest policy when it serves servers it did not start."""

    def default_spool_dir(self) -> str: ...

    def writer(self, *, spool_dir: str | None = ...) -> GroupWriter: ...

    @property
    def policy_versions(self) -> PolicyReader: ...


DEFAULT_TASK_ID = "gateway"


@dataclass(slots=True)
class _Open:
    task_id: str
    started_at: datetime
    t0: float
    timer: asyncio.Task | None = None


class StoringGateway(Gateway):
    """A :class:`Gateway` whose episodes are stored when they end (see the module doc)."""

    def __init__(
        self,
        *,
        writer: GroupSink,
        run_id: str,
        sampling: GroupSampling,
        time_limit_s: float = DEFAULT_TIME_LIMIT_S,
        max_calls: int | None = None,
        max_completion_tokens: int | None = None,
        **gateway: Any,
    ) -> None:
        super().__init__(**gateway)
        self.writer, self.run_id, self.sampling = writer, run_id, sampling
        self.time_limit_s = time_limit_s
        self.budgets = (max_calls, max_completion_tokens)
        """The run's ``max_turns`` and ``max_episode_tokens``, as an external agent gets."""
        self._open_meta: dict[str, _Open] = {}
        self.stored: dict[str, StopReason] = {}
        """Stop reason of each episode this gateway stored (their groups are in the writer)."""

    async def _open(self, request: Request) -> Response:
        try:
            body = api.parse_body(await request.body() or b"{}")
            episode_id = str(body.get("episode_id") or uuid.uuid4().hex)
            task_id = body.get("task_id", DEFAULT_TASK_ID)
            if not isinstance(task_id, str) or not task_id or "/" in task_id:
                raise api.APIError(400, "task_id must be a non-empty string without '/'",
                                   param="task_id")  # fmt: skip
            limit = body.get("time_limit_s", self.time_limit_s)
            if (
                not isinstance(limit, int | float)
                or isinstance(limit, bool)
                or not (math.isfinite(limit) and limit > 0)
            ):
                raise api.APIError(400, "time_limit_s must be a positive number",
                                   param="time_limit_s")  # fmt: skip
            if episode_id in self._episodes or episode_id in self.stored:
                raise api.APIError(409, f"episode {episode_id} is already open or stored",
                                   code="conflict")  # fmt: skip
        except api.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        url = self.open_episode(
            episode_id, max_calls=self.budgets[0], max_completion_tokens=self.budgets[1]
        )
        meta = _Open(task_id=task_id, started_at=utcnow(), t0=time.perf_counter())
        meta.timer = asyncio.create_task(self._expire(episode_id, float(limit)))
        self._open_meta[episode_id] = meta
        return JSONResponse({"episode_id": episode_id, "base_url": url, "time_limit_s": limit})

    async def _close(self, request: Request) -> Response:
        eid = request.path_params["eid"]
        try:
            body = api.parse_body(await request.body() or b"{}")
            reward = body.get("reward")
            if reward is not None and (
                not isinstance(reward, int | float) or isinstance(reward, bool)
                or not math.isfinite(reward)
            ):  # fmt: skip
                raise api.APIError(400, "reward must be a finite number", param="reward")
        except api.APIError as e:
            return JSONResponse(e.body(), status_code=e.status)
        done = await self.finish(eid, reward=reward)
        if done is None:
            return _not_found(eid)
        record, calls = done
        return JSONResponse({"episode_id": eid, "stop_reason": str(record.stop_reason),
                             "calls": calls})  # fmt: skip

    async def _expire(self, episode_id: str, limit_s: float) -> None:
        await asyncio.sleep(limit_s)
        error = f"the episode ran past its time limit of {limit_s:g} s"
        await self.finish(episode_id, stop=StopReason.TIME_LIMIT, error=error)

    async def finish(
        self,
        episode_id: str,
        *,
        stop: StopReason | None = None,
        error: str | None = None,
        reward: float | None = None,
    ) -> tuple[EpisodeRecord, list[dict[str, Any]]] | None:
        """Close ``episode_id`` (after its call in flight, if any), store it as a group of one
        and return its record and calls' JSON; None when it is not open."""
        episode = self._episodes.get(episode_id)
        meta = self._open_meta.get(episode_id)
        if episode is None or meta is None:
            return None
        async with episode.lock:  # a call in flight is recorded before the episode closes
            if self._open_meta.pop(episode_id, None) is None:
                return None  # closed meanwhile by another path
            session = self.close_episode(episode_id)
        if meta.timer is not None and meta.timer is not asyncio.current_task():
            meta.timer.cancel()
        await session.settle()
        turns, stats = assemble(session.calls, self.renderer.decode)
        stop = stop or session.budget_spent or StopReason.SUBMITTED
        valid = stop not in INFRA_STOPS
        record = EpisodeRecord(
            episode_id=episode_id, sample_index=0, stop_reason=stop, valid=valid,
            trainable=True, reward=float(reward) if reward is not None and valid else None,
            reward_breakdown={"gateway": stats.as_json()}, turns=turns,
            started_at=meta.started_at, duration_ms=(time.perf_counter() - meta.t0) * 1000,
            sandbox_id=None, error=error,
        )  # fmt: skip
        group = GroupRecord(
            group_id=f"{self.run_id}/{meta.task_id}/gateway-{episode_id}", run_id=self.run_id,
            task_id=meta.task_id, split=Split.TRAIN, sampling_params=self.sampling,
            episodes=(record,),
        )  # fmt: skip
        await asyncio.to_thread(self.writer.put, group)  # acknowledged: durable in the spool
        self.stored[episode_id] = stop
        log.info("episode %s stored (%s, %d calls)", episode_id, stop, len(session.calls))
        return record, [_call_json(c) for c in session.calls]

    async def finish_all(self, stop: StopReason, error: str) -> int:
        """Close and store every open episode (at shutdown); returns how many."""
        open_ids = list(self._open_meta)
        for episode_id in open_ids:
            await self.finish(episode_id, stop=stop, error=error)
        return len(open_ids)


async def serve(
    config: CollectorSettings,
    *,
    host: str,
    port: int,
    stop: asyncio.Event,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
) -> None:
    from pathlib import Path

    from transformers import AutoTokenizer

    from sandpiper.collector.episode.render import renderer_for
    from sandpiper.collector.gateway.server import GatewaySettings
    from sandpiper.collector.inference.vllm_client import VLLMPolicyClient
    from sandpiper.collector.run_setup import open_store, start_run_servers

    tokenizer = AutoTokenizer.from_pretrained(config.model)
    renderer = renderer_for(tokenizer, config)  # the collector's: template, action format
    limits = config.sampling
    store: GatewayStore = await asyncio.to_thread(open_store, config)
    # a spool of its own: a collector of the same run keeps its own
    spool = Path(config.store.spool_dir or store.default_spool_dir()) / "gateway"
    writer = await asyncio.to_thread(store.writer, spool_dir=str(spool))
    try:
        async with contextlib.AsyncExitStack() as stack:
            servers = await start_run_servers(config, stack)
            urls = config.inference.server_urls or [s.url for s in servers]
            client = VLLMPolicyClient.from_config(config.inference, urls)
            stack.push_async_callback(client.aclose)
            if config.inference.server_urls:
                latest = await asyncio.to_thread(store.policy_versions.latest, config.name)
                await client.reload(
                    latest.checkpoint_uri if latest else config.model,
                    latest.version if latest else 0,
                )
            gateway = StoringGateway(
                client=client, renderer=renderer,
                settings=GatewaySettings.for_run(limits, run_id=config.name), writer=writer,
                run_id=config.name, sampling=GroupSampling.from_limits(limits),
                time_limit_s=time_limit_s,
                max_calls=limits.max_turns, max_completion_tokens=limits.max_episode_tokens,
            )  # fmt: skip
            url = await gateway.serve(host=host, port=port)
            print(f"gateway serving at {url} (POST {url}/episodes to open an episode)", flush=True)
            try:
                await stop.wait()
            finally:
                await gateway.aclose()  # no new calls; the ones in flight finish first
                n = await gateway.finish_all(
                    StopReason.CANCELLED, "the gateway stopped with the episode open"
                )
                log.info("gateway stopped: %d open episodes stored as cancelled", n)
    finally:
        await asyncio.to_thread(writer.close)  # commits every acknowledged group
