"""The standalone gateway stores every episode when it ends: closed by its client (with a
reward), past its time limit, or still open when the gateway stops; a scripted policy and a
writer that keeps what it is given."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.gateway.server import GatewaySettings
from sandpiper.collector.gateway.standalone import StoringGateway
from sandpiper.store.records import GroupSampling, StopReason
from sandpiper.testing import FAKE_TOOL_SCHEMAS, ScriptedPolicy


class _Writer:
    def __init__(self) -> None:
        self.groups: list = []

    def put(self, group) -> None:
        self.groups.append(group)


async def _call(base_url: str) -> None:
    async with openai.AsyncOpenAI(base_url=base_url, api_key="x") as client:
        await client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "hi"}]
        )


def test_every_episode_is_stored_with_its_stop_reason(tiny_tokenizer):
    writer = _Writer()

    async def main():
        gw = StoringGateway(
            client=ScriptedPolicy(tiny_tokenizer, ["a"], cycle=True),
            renderer=ChatRenderer(tiny_tokenizer, FAKE_TOOL_SCHEMAS),
            settings=GatewaySettings(model_names=("policy",)),
            writer=writer, run_id="r", sampling=GroupSampling(), max_calls=1,
        )  # fmt: skip
        url = await gw.serve()
        async with httpx.AsyncClient(base_url=url) as http:
            opened = {}
            for eid, body in [("done", {"task_id": "t"}), ("slow", {"time_limit_s": 0.3}),
                              ("left", {}), ("spent", {})]:  # fmt: skip
                r = await http.post("/episodes", json={"episode_id": eid, **body})
                opened[eid] = r.json()["base_url"]
                await _call(opened[eid])
            with pytest.raises(openai.BadRequestError):
                await _call(opened["spent"])  # past max_turns: refused
            closed = await http.post("/episodes/done/close", json={"reward": 0.5})
            bad = await http.post("/episodes/spent/close", json={"reward": "high"})
            await http.post("/episodes/spent/close")
            await asyncio.sleep(0.6)  # "slow" runs past its limit
            late = await http.post(opened["slow"] + "/chat/completions", json={})
            again = await http.post("/episodes", json={"episode_id": "done"})
        await gw.aclose()
        n = await gw.finish_all(StopReason.CANCELLED, "stopped")
        return closed, bad, late, again, n

    closed, bad, late, again, n = asyncio.run(main())
    assert closed.json()["stop_reason"] == "submitted" and len(closed.json()["calls"]) == 1
    assert bad.status_code == 400 and late.status_code == 404 and again.status_code == 409
    assert n == 1
    by_id = {g.episodes[0].episode_id: g for g in writer.groups}
    assert set(by_id) == {"done", "slow", "left", "spent"}
    stops = {k: g.episodes[0].stop_reason for k, g in by_id.items()}
    assert stops == {"done": StopReason.SUBMITTED, "slow": StopReason.TIME_LIMIT,
                     "left": StopReason.CANCELLED, "spent": StopReason.MAX_TURNS}  # fmt: skip
    assert by_id["done"].group_id == "r/t/gateway-done" and by_id["done"].episodes[0].reward == 0.5
    left = by_id["left"].episodes[0]
    assert not left.valid and left.error == "stopped" and len(left.turns) == 2  # its call kept
    assert by_id["slow"].episodes[0].valid and "time limit" in by_id["slow"].episodes[0].error
