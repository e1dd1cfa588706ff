"""``sandpiper report``: one self-contained HTML page about a run, with PNG plots.

:func:`build_report` reads every analysis view in one read-only connection, draws the
figures of :mod:`sandpiper.analysis.plots`, writes each as a PNG into the output folder and embeds the
same bytes as ``data:`` URIs in ``index.html`` (so the page can be mailed or attached on its
own). :func:`log_to_mlflow` uploads the folder as an MLflow artifact.

Stored strings (task ids, tool names the policy made up) are shown through
:func:`sandpiper.analysis.terminal.neutralize`, then HTML-escaped: control and bidirectional
characters appear as visible escapes in the page.
"""

from __future__ import annotations

import base64
import dataclasses
import io
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandpiper.analysis import plots
from sandpiper.analysis.api import read_view
from sandpiper.analysis.query import QueryError, fetch, open_store, reader
from sandpiper.analysis.terminal import neutralize
from sandpiper.analysis.views import BAD_SAMPLER_OUTPUT

if TYPE_CHECKING:
    import polars as pl

    from sandpiper.config import TrackingConfig
    from sandpiper.store import Store

TEMPLATE = "report.html.j2"
TOP_FAILING = 10
FOLD_ROWS = 12
"""Tables longer than this are folded (``<details>``) so the plots stay within a scroll."""


@dataclass(frozen=True, slots=True)
class ReportResult:
    """Where the report went."""

    html_path: Path
    png_paths: dict[str, Path]
    """Section key -> PNG file next to the page."""


@dataclass(frozen=True, slots=True)
class _Section:
    key: str
    title: str
    image: str | None = None
    """data: URI of the PNG."""
    table: str | None = None
    """HTML table."""
    note: str | None = None
    table_rows: int = 0
    """Rows of ``table``; past :data:`FOLD_ROWS` the page shows it folded."""


def load_frames(store: Store | str, run_id: str | None) -> dict[str, pl.DataFrame]:
    """Every view the report uses for one run, read in one short read-only connection.

    ``run_id`` None picks the store's only run (QueryError when it holds several).
    """
    views = [
        "episode_summary", "reward_by_version", "reward_by_time", "pass_rate_by_task",
        "tool_usage", "failure_kinds", "staleness_histogram", "importance_weights",
        "zero_variance_share",
    ]  # fmt: skip
    with reader(store) as conn:
        runs = fetch(conn, "SELECT run_id FROM runs ORDER BY created_at")["run_id"].to_list()
        run_id = _pick_run(runs, run_id)
        frames = {v: read_view(conn, v, run_id) for v in views}
        where = "" if run_id is None else " WHERE run_id = :run_id"
        frames["dead_groups"] = fetch(
            conn, "SELECT group_id, source, attempts, error FROM dead_groups" + where,
            {"run_id": run_id},
        )  # fmt: skip
    return frames


def _safe_url(url: str) -> str:
    """The store URL without its password (the page may be shared)."""
    import sqlalchemy as sa

    return sa.make_url(url).render_as_string(hide_password=True)


def _pick_run(runs: list[str], run_id: str | None) -> str | None:
    """The run to report on: the one asked for, or the only one (plots never mix runs)."""
    if run_id is not None:
        if run_id not in runs:
            raise QueryError(f"no run {run_id!r} in the store (runs: {', '.join(runs) or 'none'})")
        return run_id
    if len(runs) > 1:
        raise QueryError(
            f"the store holds {len(runs)} runs ({', '.join(runs)}); pick one with --run"
        )
    return runs[0] if runs else None


def _png(fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _table(key: str, title: str, df: pl.DataFrame, columns: list[str], **kw: Any) -> _Section:
    """A section holding ``df``'s ``columns`` as an HTML table."""
    return _Section(key, title, table=_html_table(df, columns), table_rows=df.height, **kw)


def _html_table(df: pl.DataFrame, columns: list[str]) -> str:
    from html import escape

    head = "".join(f"<th>{escape(neutralize(c))}</th>" for c in columns)
    rows = []
    for row in df.select(columns).iter_rows():
        cells = "".join(f"<td>{escape(neutralize(_fmt(v)))}</td>" for v in row)
        rows.append(f"<tr>{cells}</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _shown(value: Any) -> Any:
    """Every ``{{ value }}`` of the template: stored text neutralized (markup we built, such
    as the tables, is already)."""
    import markupsafe

    if isinstance(value, str) and not isinstance(value, markupsafe.Markup):
        return neutralize(value)
    return value


def _fmt(value: object) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _cards(f: dict[str, pl.DataFrame]) -> list[tuple[str, str]]:
    eps = f["episode_summary"]
    valid = eps.filter(eps["valid"]) if eps.height else eps
    zero = f["zero_variance_share"]
    n_groups = int(zero["n_groups"].sum() or 0)
    zero_share = (int(zero["n_zero_variance"].sum() or 0) / n_groups) if n_groups else None
    bad_sampler = eps.filter(eps["stop_reason"] == BAD_SAMPLER_OUTPUT).height if eps.height else 0
    return [
        ("episodes", str(eps.height)),
        ("invalid (infra)", str(eps.height - valid.height)),
        ("bad sampler output", str(bad_sampler)),
        ("mean reward", _fmt(valid["reward"].mean() if valid.height else None)),
        ("pass rate", _fmt(valid["passed"].mean() if valid.height else None)),
        ("learner steps", str(f["importance_weights"].height)),
        ("zero-variance groups", "—" if zero_share is None else f"{zero_share:.0%}"),
        # loud: groups the store or the learner could not take (`sandpiper store dead`)
        ("DEAD groups (set aside)", str(f["dead_groups"].height if "dead_groups" in f else 0)),
    ]


def _sections(f: dict[str, pl.DataFrame]) -> list[tuple[_Section, Any]]:
    """(section, figure) pairs in page order."""
    tasks = f["pass_rate_by_task"]
    failing = (
        tasks.filter(tasks["n_valid"] > 0)
        .sort(["pass_rate", "n_valid"], descending=[False, True])
        .head(TOP_FAILING)
    )
    iw_cols = [
        "step",
        "policy_version",
        "n_groups",
        "is_weight_mean",
        "is_weight_min",
        "is_weight_max",
        "ess",
        "clipped_frac",
        "masked_frac",
        "kl_sampler_learner",
    ]
    tool_cols = [
        "tool",
        "n_calls",
        "n_errors",
        "n_timeouts",
        "n_nonzero_exit",
        "duration_ms_p50",
        "duration_ms_p95",
        "n_truncated",
    ]
    task_cols = ["task_id", "n_episodes", "n_valid", "n_invalid", "pass_rate", "reward_mean"]
    return [
        (_table("reward_by_version", "Reward by policy version", f["reward_by_version"], [
                  "policy_version", "n_episodes", "n_invalid", "reward_mean", "pass_rate"],
                note="Bands: 95 % intervals (t-interval of the mean reward, Wilson interval of "
                "the pass rate), clipped to [0, 1]."),
         plots.reward_by_version(f["reward_by_version"])),
        (_Section("reward_over_time", "Reward over time"), plots.reward_over_time(f["reward_by_time"], f["episode_summary"])),
        (_Section("pass_rate_by_task", "Pass rate per task"),
         plots.pass_rate_by_task(tasks)),
        (_table("top_failing_tasks", f"Top {TOP_FAILING} failing tasks", failing, task_cols),
         None),
        (_Section("staleness", "Staleness of consumed groups",
                  note="Versions between the policy that sampled a group's oldest token and "
                  "the policy the learner trained from."),
         plots.staleness(f["staleness_histogram"])),
        (_table("importance_weights", "Importance-weight statistics",
                f["importance_weights"], iw_cols),
         plots.importance_weights(f["importance_weights"])),
        (_table("tool_usage", "Tool usage", f["tool_usage"], tool_cols),
         plots.tool_usage(f["tool_usage"])),
        (_Section("failures", "Failure breakdown",
                  note="Red bars are infrastructure failures (episodes excluded, never 0)."),
         plots.failure_breakdown(f["failure_kinds"])),
        (_Section("episode_lengths", "Episode length distributions"),
         plots.episode_lengths(f["episode_summary"])),
    ]  # fmt: skip


REPLAY_COLUMNS = ["variant", "steps", "ess", "masked_frac", "truncated_frac", "grad_norm",
                  "grad_rel_var", "cos_ref"]  # fmt: skip


def load_replay(path: str | Path) -> pl.DataFrame:
    """The per-variant summary of a ``sandpiper replay`` result file (``replay.json``)."""
    import json

    import polars as pl

    try:
        data = json.loads(Path(path).read_text())
        return pl.DataFrame(data["summary"], infer_schema_length=None)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise QueryError(
            f"{path} is not a replay result (sandpiper replay writes one): {e}"
        ) from None


def _replay_section(path: Path) -> tuple[_Section, Any]:
    summary = load_replay(path)
    note = (
        f"From {path.name}: each loss/correction variant evaluated on the stored batches "
        "against the policy that trained them (docs/replay.md explains the columns)."
    )
    columns = [c for c in REPLAY_COLUMNS if c in summary.columns]
    return _table("replay", "Estimator replay", summary, columns, note=note), plots.replay(summary)


def build_report(
    store: Store | str,
    out_dir: str | Path,
    *,
    run_id: str | None = None,
    replay: str | Path | None = None,
) -> ReportResult:
    """Write ``index.html`` and one PNG per plot into ``out_dir``; returns their paths.

    ``run_id`` None reports on the store's only run (QueryError when it holds several).
    ``replay``: a ``sandpiper replay`` result file whose comparison gets its own section.
    """
    import jinja2

    store = open_store(store)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    frames = load_frames(store, run_id)
    run_label = (
        frames["episode_summary"]["run_id"].first() if frames["episode_summary"].height else run_id
    )
    sections, pngs = [], {}
    extra = [_replay_section(Path(replay))] if replay is not None else []
    for section, fig in _sections(frames) + extra:
        if fig is not None:
            data = _png(fig)
            path = out / f"{section.key}.png"
            path.write_bytes(data)
            pngs[section.key] = path
            uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
            section = dataclasses.replace(section, image=uri)
        sections.append(section)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True,
        finalize=_shown,
    )
    html = env.get_template(TEMPLATE).render(
        run_label=run_label or "(no episodes yet)",
        store_url=_safe_url(store.url),
        generated_at=datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        cards=_cards(frames),
        sections=sections,
        fold_rows=FOLD_ROWS,
    )
    html_path = out / "index.html"
    html_path.write_text(html)
    return ReportResult(html_path, pngs)


def log_to_mlflow(
    result: ReportResult, tracking: TrackingConfig, *, runs_dir: str, run_id: str | None
) -> str:
    """Log the report folder as artifact ``report/`` of an MLflow run; returns its run id.

    The MLflow run is tagged ``sandpiper.run_id`` so reports of one run sit together.
    """
    import mlflow

    uri = tracking.tracking_uri or f"sqlite:///{Path(runs_dir).resolve() / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    if mlflow.get_experiment_by_name(tracking.experiment) is None:
        # Without a location a SQLite-backed MLflow puts artifacts in ./mlruns of whatever
        # folder the command ran in; keep them with the runs instead.
        artifacts = (Path(runs_dir) / "mlartifacts").resolve().as_uri()
        mlflow.create_experiment(tracking.experiment, artifact_location=artifacts)
    mlflow.set_experiment(tracking.experiment)
    with mlflow.start_run(run_name=f"report-{run_id or 'all'}") as active:
        mlflow.set_tag("sandpiper.run_id", run_id or "all")
        mlflow.set_tag("sandpiper.kind", "report")
        mlflow.log_artifacts(str(result.html_path.parent), artifact_path="report")
        return active.info.run_id
