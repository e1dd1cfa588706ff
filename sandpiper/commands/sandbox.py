"""``sandpiper sandbox …``: build the image, prove the limits, list and clean up containers."""

from __future__ import annotations

import typer

from sandpiper.commands._common import ConfigOption, cli_errors, command, resolve_config


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
        from collector.sandbox.image import ensure_image

        cfg = resolve_config(config, ctx)
        with cli_errors():
            tag = ensure_image(cfg.sandbox.image, force=force)
        typer.echo(f"{cfg.sandbox.image} = {tag}")

    @command(sandbox_app, "check")
    def check(ctx: typer.Context, config: ConfigOption = None) -> None:
        """Prove on this host that every limit holds (fork bomb, OOM, network, uid, ...)."""
        import asyncio

        from collector.sandbox.check import run_checks, save_passing

        cfg = resolve_config(config, ctx)

        async def check_and_cache() -> list:
            results = await run_checks(cfg.sandbox)
            await save_passing(cfg.sandbox, results)
            return results

        with cli_errors():
            results = asyncio.run(check_and_cache())
        for r in results:
            mark = typer.style("ok  ", fg="green") if r.passed else typer.style("FAIL", fg="red")
            typer.echo(f"{mark} {r.name:24} {r.detail}")
        if not all(r.passed for r in results):
            raise typer.Exit(1)

    @sandbox_app.command("ls")
    def ls(all_: bool = typer.Option(False, "--all", help="Also show stopped containers.")) -> None:
        """List sandbox containers with their run, collector, episode and task."""
        import asyncio

        from collector.sandbox.janitor import collector_alive, list_containers
        from collector.sandbox.pool import read_registry

        with cli_errors():
            rows = asyncio.run(list_containers())
        typer.echo(f"{'NAME':24} {'STATE':9} {'RUN':16} {'COLLECTOR':22} {'EPISODE':14} TASK")
        for c in rows:
            if not all_ and c.state != "running":
                continue
            reg = read_registry(c.name)
            collector = c.collector + ("" if collector_alive(c.collector) else " (gone)")
            typer.echo(
                f"{c.name:24} {c.state:9} {c.labels.get('sandpiper.run', '-'):16} "
                f"{collector:22} {reg.get('episode') or '-':14} {reg.get('task') or '-'}"
            )

    @sandbox_app.command("gc")
    def gc(dry_run: bool = typer.Option(False, help="Only list what would be removed.")) -> None:
        """Remove sandbox containers whose collector process is gone."""
        import asyncio

        from collector.sandbox.janitor import gc as run_gc

        with cli_errors():
            removed = asyncio.run(run_gc(dry_run=dry_run))
        verb = "would remove" if dry_run else "removed"
        typer.echo(f"{verb} {len(removed)} container(s)" + "".join(f"\n  {n}" for n in removed))
