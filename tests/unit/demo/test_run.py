"""The demo's scripted teacher answers like a policy: a tool call, then the end-of-turn token."""

from __future__ import annotations

import asyncio

import pytest

from sandpiper.collector.episode.parsers import parse_tool_calls
from sandpiper.collector.episode.render import ChatRenderer
from sandpiper.collector.episode.tools import offered_schemas
from sandpiper.collector.inference.base import SamplingParams
from sandpiper.demo.run import Demonstrator
from sandpiper.demo.tasks import COMPUTE_COMMAND, DEMO_TOOLS, INSTRUCTION, SYSTEM_PROMPT
from sandpiper.errors import SandpiperError

PARAMS = SamplingParams(max_tokens=72)


def _renderer(tokenizer) -> ChatRenderer:
    return ChatRenderer(tokenizer, offered_schemas(DEMO_TOOLS, "brief"))


def _first_call(renderer: ChatRenderer, demonstrator: Demonstrator) -> tuple[list[int], dict]:
    messages = [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": INSTRUCTION},
    ]
    context = renderer.prompt_ids(messages)
    first = asyncio.run(demonstrator.generate(context, PARAMS))
    assert first.finish_reason == "stop"
    assert first.token_ids_T[-1] == renderer.stop_token_ids[0]
    assert len(first.logprobs_T) == len(first.policy_versions_T) == len(first.token_ids_T)
    call = parse_tool_calls(renderer.decode(first.token_ids_T)).tool_calls[0]
    assert call.name == "execute_bash"
    return [*context, *first.token_ids_T.tolist()], call.arguments


def test_computes_in_the_given_fraction_of_episodes_then_submits(tiny_tokenizer) -> None:
    renderer = _renderer(tiny_tokenizer)
    teacher = Demonstrator(tiny_tokenizer, compute_fraction=0.3)
    commands = [_first_call(renderer, teacher)[1]["command"] for _ in range(20)]
    assert sum(c == COMPUTE_COMMAND for c in commands) == 6
    assert all(c.startswith("echo ") for c in commands if c != COMPUTE_COMMAND)

    context, _ = _first_call(renderer, teacher)
    context += renderer.tool_delta_ids([{"role": "tool", "name": "execute_bash", "content": ""}])
    second = asyncio.run(teacher.generate(context, PARAMS))
    call = parse_tool_calls(renderer.decode(second.token_ids_T)).tool_calls[0]
    assert (call.name, call.arguments) == ("submit", {})
    assert teacher.episodes == 21  # the second turn is not a new episode


@pytest.mark.parametrize("fraction", [0.0, 1.0])
def test_always_or_never_computes(tiny_tokenizer, fraction: float) -> None:
    renderer = _renderer(tiny_tokenizer)
    teacher = Demonstrator(tiny_tokenizer, compute_fraction=fraction)
    commands = {_first_call(renderer, teacher)[1]["command"] == COMPUTE_COMMAND for _ in range(5)}
    assert commands == {bool(fraction)}


def test_refuses_prompts_that_are_not_demo_tasks(tiny_tokenizer) -> None:
    ids = _renderer(tiny_tokenizer).prompt_ids([{"role": "user", "content": "Fix the bug."}])
    with pytest.raises(SandpiperError, match="demo tasks"):
        asyncio.run(Demonstrator(tiny_tokenizer).generate(ids, PARAMS))


def test_fresh_deletes_the_earlier_demo_and_never_a_shared_store(tmp_path) -> None:
    from sandpiper.config import load_config
    from sandpiper.demo.run import reset

    runs = tmp_path / "runs"
    url = f"duckdb:///{runs}/d/store.duckdb"
    config = load_config(None, ["--runs_dir", str(runs), "--name", "d", "--store.url", url])
    kept = [runs / "other" / "x", runs / "d-sft-2" / "x", runs / "store.duckdb"]
    gone = [runs / "d" / "tasks" / "t", runs / "d-sft" / "policies" / "v1",
            runs / "d" / "store.duckdb", runs / "d" / "store.duckdb.spool" / "0001.arrow"]  # fmt: skip
    for path in kept + gone:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("x")
    assert reset(config) == [runs / "d", runs / "d-sft"]
    assert all(p.exists() for p in kept) and not any(p.exists() for p in gone)
    assert reset(config) == []

    for shared in (f"duckdb:///{runs}/store.duckdb", "postgresql+psycopg://u@h/db"):
        config.store.url = shared
        with pytest.raises(SandpiperError, match="new --name"):
            reset(config)
    assert (runs / "store.duckdb").exists()
