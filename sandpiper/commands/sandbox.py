"""``sandpiper sandbox …``: build the image, prove the limits, list and clean up containers."""

from __future__ import annotations

from typing import NoReturn

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config
from sandpiper.commands._preflight import check_podman
from sandpiper.errors import SandpiperError, SetupError


def register(app: typer.Typer) -> None:
    sandbox_app = typer.Typer(help="Podman sandboxes: image, host checks, containers.")
    app.add_typer(sandbox_app, name="sandbox")

    @command(sandbox_app, "build-image")
    def build_image(
        ctx: typer.Context,
        config: ConfigOption = None,
        force: bool = typer.Option(False, help="Rebuild even when the recipe hash matches."),
    ) -> None:
        """Build the base image (debootstrap + podman import), unless its recipe is cached."""
        from sandpiper.collector.sandbox.image_build import ImageRecipe, ensure_image

        cfg = resolve_config(config, ctx)
        with cli_errors():
            check_podman()
            recipe = ImageRecipe(python_packages=tuple(cfg.sandbox.python_packages))
            tag = ensure_image(cfg.sandbox.image, recipe, force=force)
        typer.echo(f"{cfg.sandbox.image} = {tag}")

    @command(sandbox_app, "check")
    def check(ctx: typer.Context, config: ConfigOption = None) -> None:
        """Prove on this host that every limit holds (fork bomb, OOM, network, uid, ...)."""
        import asyncio

        from sandpiper.collector.sandbox.check import run_checks, save_passing

        cfg = resolve_config(config, ctx)

        async def check_and_cache() -> list:
            results = await run_checks(cfg.sandbox)
            await save_passing(cfg.sandbox, results)
            return results

        with cli_errors():
            check_podman(cfg.sandbox.image)
            results = asyncio.run(check_and_cache())
        for r in results:
            mark = typer.style("ok  ", fg="green") if r.passed else typer.style("FAIL", fg="red")
            typer.echo(f"{mark} {r.name:24} {r.detail}")
        if not all(r.passed for r in results):
            raise typer.Exit(1)

    @command(sandbox_app, "ls")
    def ls(
        ctx: typer.Context,
        config: ConfigOption = None,
        all_: bool = typer.Option(False, "--all", help="Also show stopped containers."),
    ) -> None:
        """List sandbox containers with their run, collector, episode and task.

        With a reachable store (-c run.toml or --store.url URL) it also shows what
        `sandbox gc` would decide for each container (live, dead, unknown, other store)."""
        import asyncio

        from sandpiper.collector.sandbox.containers import read_registry
        from sandpiper.collector.sandbox.janitor import list_containers, verdicts

        cfg = resolve_config(config, ctx)
        with cli_errors():
            check_podman()
            try:
                store = _open_store(cfg)
                judged = asyncio.run(verdicts(store, ttl_s=cfg.collector.heartbeat_ttl_s))
                rows = [(c, str(v)) for c, v in judged]
            except SandpiperError as e:
                typer.secho(f"(no store, collectors not judged: {e})", err=True)
                rows = [(c, "?") for c in asyncio.run(list_containers())]
        typer.echo(f"{'NAME':24} {'STATE':9} {'RUN':16} {'COLLECTOR':44} {'EPISODE':14} TASK")
        for c, verdict in rows:
            if not all_ and c.state != "running":
                continue
            reg = read_registry(c.name)
            typer.echo(
                f"{c.name:24} {c.state:9} {c.labels.get('sandpiper.run', '-'):16} "
                f"{c.collector + ' (' + verdict + ')':44} {reg.get('episode') or '-':14} "
                f"{reg.get('task') or '-'}"
            )

    @command(sandbox_app, "gc")
    def gc(
        ctx: typer.Context,
        config: ConfigOption = None,
        dry_run: bool = typer.Option(False, help="Only list what would be removed."),
        grace_s: float = typer.Option(
            3600.0, help="Keep containers of collectors the store does not know this long."
        ),
    ) -> None:
        """Remove sandbox containers whose collector is gone, judged by the STORE's heartbeats.

        Needs the run's store (-c run.toml, or --store.url URL; without either, the default
        config's store): a container is removed when its collector's heartbeat there is
        older than collector.heartbeat_ttl_s or it stopped; a collector the store does not
        know counts only after --grace-s; containers of another store are kept. Pids are
        never used (collectors may live in other PID namespaces or hosts). Without a
        reachable store it removes nothing and exits 1."""
        import asyncio

        from sandpiper.collector.sandbox.janitor import gc as run_gc

        cfg = resolve_config(config, ctx)
        with cli_errors():
            check_podman()
            try:
                store = _open_store(cfg)
            except SandpiperError as e:
                raise SandpiperError(
                    f"{e}\nsandbox gc decides by the collectors' heartbeats in the store, so it "
                    "removed nothing; pass the run's config (-c run.toml) or --store.url URL"
                ) from None
            removed = asyncio.run(
                run_gc(
                    store,
                    ttl_s=cfg.collector.heartbeat_ttl_s,
                    grace_s=grace_s,
                    state_dir=cfg.sandbox.host_state_dir,
                    dry_run=dry_run,
                )
            )
        verb = "would remove" if dry_run else "removed"
        typer.echo(f"{verb} {len(removed)} container(s)" + "".join(f"\n  {n}" for n in removed))

    @command(sandbox_app, "mcp")
    def mcp(
        ctx: typer.Context,
        tasks: str = typer.Argument(
            ..., help="Task source: a JSONL file, a task folder or a folder of them."
        ),
        task_id: str | None = typer.Option(
            None, "--task-id", "-t", help="The task to serve (needed when TASKS holds several)."
        ),
        http: str | None = typer.Option(
            None,
            "--http",
            metavar="HOST:PORT",
            help="Serve streamable HTTP at http://HOST:PORT/mcp (PORT 0: any free port) "
            "instead of stdio.",
        ),
        config: ConfigOption = None,
    ) -> None:
        """Serve one task's sandbox tools (execute_bash, str_replace_editor, submit) over MCP.

        Starts a podman sandbox for the task (its files and setup.sh, as an episode gets
        them), then serves the native tools with their native limits over the Model
        Context Protocol: on stdio by default (stdout is the protocol; logs go to stderr),
        or streamable HTTP with --http. `submit` runs the task's tests and reward and
        answers with the reward; the episode is then over. The container is removed when
        stdin ends (stdio), or on SIGINT / SIGTERM. See docs/gateway.md."""
        import asyncio
        import signal

        from sandpiper.collector.gateway.mcp_server import serve_task

        cfg = resolve_config(config, ctx)
        with cli_errors():
            address = _host_port(http) if http is not None else None
            task = _one_task(tasks, task_id)
            check_podman(task.image or cfg.sandbox.image)

            async def main():  # -> Submission | None
                stop = asyncio.Event()
                loop = asyncio.get_running_loop()
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, stop.set)
                submission = await serve_task(
                    cfg.sandbox, task, test_timeout_s=cfg.collector.test_timeout_s,
                    http=address, labels={"sandpiper.run": cfg.name}, stop=stop,
                    offered=cfg.collector.tools, descriptions=cfg.collector.tool_descriptions,
                    max_argument_bytes=cfg.collector.max_argument_bytes,
                )  # fmt: skip
                _report(task.task_id, submission)
                if stop.is_set() and http is None:
                    # stdio's reader thread may still block on stdin, and asyncio.run
                    # would wait for it: the sandbox is gone, nothing is left to do
                    _exit_now()

            asyncio.run(main())


def _report(task_id: str, submission) -> None:
    """The episode's end on stderr (stdout may be the MCP transport)."""
    done = f"submitted, reward {submission.reward}" if submission else "not submitted"
    typer.secho(f"task {task_id}: {done}", err=True)


def _exit_now() -> NoReturn:
    """Exit at once, after flushing the logs and the standard streams."""
    import contextlib
    import logging
    import os
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


def _host_port(value: str):
    """``HOST:PORT`` of ``--http`` (``[::1]:8000`` for IPv6)."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise SetupError(f"--http {value!r}: give HOST:PORT, e.g. 127.0.0.1:8765 (0: any port)")
    return host, int(port)


def _one_task(source: str, task_id: str | None):
    """The task ``task_id`` of ``source`` (its only task when None)."""
    from sandpiper.collector.tasks.loading import load_tasks
    from sandpiper.commands._preflight import SOURCE_HINT, check_tasks

    check_tasks(source, field="TASKS", hint=SOURCE_HINT)
    tasks = load_tasks(source)
    if task_id is None:
        if len(tasks) == 1:
            return tasks[0]
        raise SetupError(
            f"TASKS {source!r} holds {len(tasks)} tasks: pick one with --task-id "
            f"({', '.join(t.task_id for t in tasks[:5])}{', ...' if len(tasks) > 5 else ''})"
        )
    for task in tasks:
        if task.task_id == task_id:
            return task
    shown = ", ".join(t.task_id for t in tasks[:5]) + (", ..." if len(tasks) > 5 else "")
    raise SetupError(f"--task-id {task_id!r}: no such task in {source!r} (it has {shown})")


def _open_store(cfg):
    """The config's store, opened without creating anything (a missing one is an error)."""
    from sandpiper.errors import StoreError
    from sandpiper.store import Store

    store = Store(cfg.store.url, lock_timeout_s=cfg.store.lock_timeout_s)
    try:
        version = store.schema_version()
    except StoreError:
        raise
    except Exception as e:  # a server that is down, a wrong password, ...
        raise StoreError(f"cannot reach the store {cfg.store.url}: {e}") from None
    if version == 0:
        raise StoreError(f"the store {cfg.store.url} has no schema (no collector ever used it)")
    return store
