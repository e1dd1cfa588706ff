"""The agent process of bench/gateway_bench.py (started by it, not run by hand).

It plays an unmodified agent: plain ``httpx`` (the ``openai`` client's transport), one
conversation per episode with the run's tool schemas, each later call sending the previous
reply and a tool result back. Per call it times the gateway's answer and asks the bench's
control routes for the direct call of the same ids; with ``--vllm`` (the bench's
``--agent-direct``) it also calls vLLM itself with the very body the gateway's client sent,
and reads vLLM's own time of each call from its metrics. ``--api`` picks the wire API the
agent speaks (``chat``: Chat Completions, ``responses``: OpenAI Responses, ``messages``:
Anthropic Messages) and ``--stream`` asks for the streamed form (timed to its last byte);
the conversation is the same in each (a system prompt, the task, the run's tools, each reply
sent back with a tool result).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import time
import uuid
from typing import Any

import httpx

from sandpiper.collector.episode.tools import offered_schemas
from sandpiper.collector.inference.vllm_client import GENERATE_PATH

SETTLE_S = 0.02
"""``--agent-direct``: the pause between reading vLLM's metrics and a timed call."""


async def _e2e_ms(http, vllm: str) -> tuple[float, float]:
    """(sum in ms, count) of vLLM's own end-to-end request latency histogram: the delta over
    one call is that call's time inside vLLM's engine client (arrival to last output)."""
    total = count = 0.0
    for line in (await http.get(f"{vllm}/metrics")).text.splitlines():
        if line.startswith("vllm:e2e_request_latency_seconds_sum{"):
            total += float(line.rsplit(" ", 1)[1]) * 1000
        elif line.startswith("vllm:e2e_request_latency_seconds_count{"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def _timed_vllm_call(http, vllm: str | None, call) -> tuple[float, float, Any]:
    """(latency ms, vLLM's own time of the call in ms or NaN, response) of ``call()``."""
    before = None
    if vllm:
        before = await _e2e_ms(http, vllm)
        await asyncio.sleep(SETTLE_S)  # the server's work on the scrape is done
    t0 = time.perf_counter()
    r = await call()
    ms = (time.perf_counter() - t0) * 1000
    r.raise_for_status()
    inside = float("nan")
    if before is not None:
        after = await _e2e_ms(http, vllm)
        if after[1] - before[1] == 1:  # exactly this call finished meanwhile
            inside = after[0] - before[0]
    return ms, inside, r


SYSTEM = "You are an agent in a Linux sandbox."
ROUTES = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}
"""Each API's route under the episode's ``/v1`` base URL."""


class Conversation:
    """One episode's history in the wire form of one API: the request of the next call, and
    the reply of the last one (streamed or not) sent back with a tool result."""

    def __init__(self, api: str, task: str) -> None:
        self.api = api
        self.tools = offered_schemas(["execute_bash", "str_replace_editor", "submit"], "brief")
        self.history: list[dict[str, Any]] = [{"role": "user", "content": task}]
        if api == "chat":
            self.history.insert(0, {"role": "system", "content": SYSTEM})

    def body(self, stream: bool) -> dict[str, Any]:
        functions = [t["function"] for t in self.tools]
        body: dict[str, Any]
        if self.api == "chat":
            body = {"model": "policy", "messages": self.history, "tools": self.tools}
        elif self.api == "responses":
            body = {"model": "policy", "instructions": SYSTEM, "input": self.history,
                    "tools": [{"type": "function", **f} for f in functions]}  # fmt: skip
        else:
            body = {"model": "policy", "max_tokens": 1024, "system": SYSTEM,
                    "messages": self.history,
                    "tools": [{"name": f["name"], "description": f["description"],
                               "input_schema": f["parameters"]} for f in functions]}  # fmt: skip
        return {**body, "stream": True} if stream else body

    def reply(self, r: httpx.Response, stream: bool) -> Any:
        """The reply of a call: the chat message, the output items or the content blocks."""
        if not stream:
            answer = r.json()
            return {"chat": lambda: answer["choices"][0]["message"],
                    "responses": lambda: answer["output"],
                    "messages": lambda: answer["content"]}[self.api]()  # fmt: skip
        events = [json.loads(line[5:]) for line in r.text.splitlines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]  # fmt: skip
        if self.api == "chat":
            return _chat_message(events)
        if self.api == "responses":
            (done,) = [e for e in events if e["type"] in ("response.completed",
                                                           "response.incomplete")]  # fmt: skip
            return done["response"]["output"]
        return _message_blocks(events)

    def absorb(self, reply: Any, turn: int) -> None:
        """Append the reply and a tool result (or a user message when no tool was called)."""
        output = f"out {turn}"
        if self.api == "chat":
            self.history.append(reply)
            call_id = (reply.get("tool_calls") or [{"id": "none"}])[0]["id"]
            self.history.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif self.api == "responses":
            self.history += reply
            calls = [item for item in reply if item["type"] == "function_call"]
            self.history.append(
                {"type": "function_call_output", "call_id": calls[0]["call_id"], "output": output}
                if calls else {"role": "user", "content": output}
            )  # fmt: skip
        else:
            self.history.append({"role": "assistant", "content": reply})
            uses = [b for b in reply if b["type"] == "tool_use"]
            self.history.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": uses[0]["id"], "content": output}
            ] if uses else output})  # fmt: skip


def _chat_message(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message of a streamed chat completion."""
    content, calls = "", dict[int, dict[str, Any]]()
    for chunk in chunks:
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                into = calls.setdefault(call["index"], {"id": "", "type": "function",
                                                        "function": {"name": "", "arguments": ""}})  # fmt: skip
                into["id"] = call.get("id") or into["id"]
                for key in ("name", "arguments"):
                    into["function"][key] += (call.get("function") or {}).get(key) or ""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[k] for k in sorted(calls)]
    return message


def _message_blocks(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The content blocks of a streamed Messages reply."""
    blocks: list[dict[str, Any]] = []
    partial: dict[int, str] = {}
    for event in events:
        if event["type"] == "content_block_start":
            blocks.append(dict(event["content_block"]))
        elif event["type"] == "content_block_delta":
            block, delta = blocks[event["index"]], event["delta"]
            if delta["type"] == "text_delta":
                block["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                block["signature"] = delta["signature"]
            elif delta["type"] == "input_json_delta":
                partial[event["index"]] = partial.get(event["index"], "") + delta["partial_json"]
    for index, text in partial.items():
        blocks[index]["input"] = json.loads(text or "{}")
    return blocks


async def _agent_episode(http, args: argparse.Namespace, i: int) -> list[tuple[float, ...]]:
    r = await http.post(f"{args.gateway}/episodes", json={})
    r.raise_for_status()
    opened = r.json()
    url, eid = opened["base_url"], opened["episode_id"]
    conversation = Conversation(args.api, f"Task {i} of {args.tag}: list the files in /workspace.")
    vllm = args.vllm if args.concurrency == 1 else None  # one call at a time: its own e2e

    async def agent_direct(body: dict[str, Any]) -> tuple[float, float]:
        """The agent calls vLLM itself with the very body the gateway's client sent."""
        body = {**body, "request_id": f"agent-direct-{uuid.uuid4().hex}"}
        ms, inside, _ = await _timed_vllm_call(
            http, vllm, functools.partial(http.post, vllm + GENERATE_PATH, json=body)
        )
        return ms, inside

    rows: list[tuple[float, ...]] = []
    for turn in range(args.turns):
        body = conversation.body(args.stream)
        # Which of the pair goes first alternates: the second finds the server's prefix
        # cache holding the whole prompt and the engine just awake, the first does not.
        # (Chat only: the bench builds a direct-first pair's ids from a chat body.)
        direct_first = args.api == "chat" and not args.stream and (i + turn) % 2 == 1
        own = (float("nan"), float("nan"))
        if direct_first:  # the same ids, made here from the same history (not timed)
            d = await http.post(f"{args.control}/direct-first/{eid}", json=body)
            d.raise_for_status()
            if vllm:
                own = await agent_direct(d.json()["body"])
        via_gateway_ms, gateway_inside, r = await _timed_vllm_call(
            http, vllm, functools.partial(http.post, url + ROUTES[args.api], json=body)
        )
        reply = conversation.reply(r, args.stream)
        if not direct_first:
            t0 = time.perf_counter()
            d = await http.post(f"{args.control}/direct/{eid}")
            control_ms = (time.perf_counter() - t0) * 1000  # a bare HTTP hop around the call
            d.raise_for_status()
            if vllm:
                own = await agent_direct(d.json()["body"])
        else:
            control_ms = float("nan")  # that route renders too: not a bare hop
        rows.append((via_gateway_ms, d.json()["direct_ms"], float(direct_first), control_ms,
                     gateway_inside, *own))  # fmt: skip
        conversation.absorb(reply, turn)
    v = await http.post(f"{args.control}/verify/{eid}")
    v.raise_for_status()
    (await http.post(f"{args.gateway}/episodes/{eid}/close")).raise_for_status()
    # each call's own time in the PolicyClient (what the gateway spent calling vLLM)
    return [(*row, model_ms) for row, model_ms in zip(rows, v.json()["model_ms"], strict=True)]


async def agent_main(args: argparse.Namespace) -> None:
    """Run the episodes, print [[gateway_ms, direct_ms, direct_first, control_ms,
    gateway_inside_ms, agent_direct_ms, agent_direct_inside_ms, model_ms], ...] as JSON."""
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:

        async def one(i: int):
            async with sem:
                return await _agent_episode(http, args, i)

        await one(-1)  # warm-up: connections, tokenizer caches, server prefix cache
        await http.post(f"{args.control}/start")
        results = await asyncio.gather(*(one(i) for i in range(args.episodes)))
    print(json.dumps([p for r in results for p in r]))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", required=True, help="The gateway's URL.")
    p.add_argument("--control", required=True, help="The bench's control routes.")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--episodes", type=int, default=40)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--tag", default="", help="Makes this run's tasks its own.")
    p.add_argument("--vllm", help="Also call this vLLM server directly (one at a time only).")
    p.add_argument("--api", choices=sorted(ROUTES), default="chat", help="The wire API.")
    p.add_argument("--stream", action="store_true", help="Ask for streamed replies.")
    return p.parse_args()


if __name__ == "__main__":
    asyncio.run(agent_main(parse_args()))
