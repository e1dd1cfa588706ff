"""``sandpiper sandbox …``: build the image, prove the limits, list and clean up containers."""

from __future__ import annotations

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config
from sandpiper.commands._preflight import check_podman
from sandpiper.errors import SandpiperError


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
                run_gc(store, ttl_s=cfg.collector.heartbeat_ttl_s, grace_s=grace_s, dry_run=dry_run)
            )
        verb = "would remove" if dry_run else "removed"
        typer.echo(f"{verb} {len(removed)} container(s)" + "".join(f"\n  {n}" for n in removed))


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
