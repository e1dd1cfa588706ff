"""Build the sandbox base image locally (no registry): debootstrap → ``podman import``.

The image is content-addressed: the recipe (suite, mirror, packages, pinned Python
packages, post-steps, and this builder's version) is hashed, the image is tagged ``<repo>:<hash12>`` with the label
``sandpiper.recipe=<hash>`` and also tagged with the configured name (``...:latest``).
``ensure_image`` rebuilds only when no image carries the current hash.

A task may extend the base image with its own setup script (:func:`extend_image`), which
runs ``podman build --pull=never`` on top of the local base image.

Run ``sandpiper sandbox build-image`` (or ``python -m sandpiper.collector.sandbox.image_build``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from sandpiper.errors import SandboxError

log = logging.getLogger(__name__)

RECIPE_LABEL = "sandpiper.recipe"
BUILDER_VERSION = 1
"""Bump when the build steps below change in a way the recipe fields do not capture."""


@dataclass(frozen=True)
class ImageRecipe:
    """Everything that determines the base image's content (hashed into its tag)."""

    suite: str = "bookworm"
    mirror: str = "http://deb.debian.org/debian"
    variant: str = "minbase"
    packages: tuple[str, ...] = ("python3", "bash", "bash-static", "coreutils", "procps", "git")
    """``bash-static``: the shell each agent command starts in (see ``supervisor/run.py: command_shell``)."""
    mount_points: tuple[str, ...] = ("/workspace", "/tmp", "/.sandpiper")
    """Directories created mode 1777 in the rootfs (tmpfs and bind-mount targets)."""
    env: tuple[str, ...] = ("LANG=C.UTF-8", "PYTHONDONTWRITEBYTECODE=1")
    builder_version: int = BUILDER_VERSION
    extra: dict[str, str] = field(default_factory=dict)
    python_packages: tuple[str, ...] = ()
    """Pinned PyPI packages (``NAME==VERSION``, ``sandbox.python_packages``) installed into the
    image's ``/usr/local/lib/python3.X/dist-packages`` at build time, with their
    dependencies, as wheels for the image's Python (:func:`pip_install_argv`), so a task's
    tests can import a scorer's libraries."""

    def digest(self) -> str:
        fields = asdict(self)
        if not fields["python_packages"]:  # the recipes built before this field hash as before
            del fields["python_packages"]
        blob = json.dumps(fields, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()


def pip_install_argv(rootfs: Path, packages: tuple[str, ...]) -> list[str]:
    """The host's pip installing ``packages`` into ``rootfs`` for the rootfs's own Python:
    binary wheels only (nothing is compiled on the host for another interpreter), from the
    package index the host's pip is configured for."""
    versions = sorted(p.name for p in (rootfs / "usr" / "lib").glob("python3.*") if p.is_dir())
    if not versions:
        raise SandboxError(f"no python3 in the image's rootfs ({rootfs}/usr/lib/python3.*)")
    version = versions[-1].removeprefix("python")
    target = rootfs / "usr" / "local" / "lib" / f"python{version}" / "dist-packages"
    platforms = ["manylinux_2_36_x86_64", "manylinux_2_28_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "linux_x86_64"]  # fmt: skip
    argv = [sys.executable, "-m", "pip", "install", "--quiet", "--no-cache-dir", "--no-compile",
            "--target", str(target), "--only-binary=:all:", "--implementation", "cp",
            "--python-version", version]  # fmt: skip
    for platform in platforms:
        argv += ["--platform", platform]
    return [*argv, *packages]


def _run(argv: list[str], **kwargs) -> subprocess.CompletedProcess:
    log.debug("run %s", argv)
    return subprocess.run(argv, check=False, capture_output=True, **kwargs)


def image_recipe_hash(image: str) -> str | None:
    """The recipe hash label of a local image, or None when the image does not exist."""
    proc = _run(
        ["podman", "image", "inspect", "--format", f'{{{{index .Labels "{RECIPE_LABEL}"}}}}', image]
    )
    if proc.returncode != 0:
        return None
    return proc.stdout.decode().strip() or None


def _repo(image: str) -> str:
    name, _, tag = image.rpartition(":")
    return name if name and "/" not in tag else image


def ensure_image(image: str, recipe: ImageRecipe | None = None, *, force: bool = False) -> str:
    """Make sure ``image`` holds the current recipe; build it when missing or stale.

    Returns the content-addressed tag (``repo:hash12``).
    """
    recipe = recipe or ImageRecipe()
    digest = recipe.digest()
    hashed_tag = f"{_repo(image)}:{digest[:12]}"
    if not force and image_recipe_hash(hashed_tag) == digest:
        if image_recipe_hash(image) != digest:
            _tag(hashed_tag, image)
        return hashed_tag
    build_image(hashed_tag, recipe)
    _tag(hashed_tag, image)
    return hashed_tag


def _tag(src: str, dst: str) -> None:
    if src == dst:
        return
    proc = _run(["podman", "tag", src, dst])
    if proc.returncode != 0:
        raise SandboxError(f"podman tag {src} {dst} failed: {proc.stderr.decode()[-2000:]}")


def build_image(tag: str, recipe: ImageRecipe) -> None:
    """debootstrap a rootfs for ``recipe`` and import it as ``tag`` (about 1–3 minutes)."""
    if shutil.which("debootstrap") is None:
        raise SandboxError("debootstrap is not installed (apt-get install -y debootstrap)")
    with tempfile.TemporaryDirectory(prefix="sandpiper-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        argv = [
            "debootstrap",
            f"--variant={recipe.variant}",
            f"--include={','.join(recipe.packages)}",
            recipe.suite,
            str(rootfs),
            recipe.mirror,
        ]
        log.info("debootstrap: %s", " ".join(argv))
        proc = _run(argv)
        if proc.returncode != 0:
            raise SandboxError(f"debootstrap failed:\n{proc.stdout.decode()[-3000:]}")
        _post_process(rootfs, recipe)
        if recipe.python_packages:
            proc = _run(pip_install_argv(rootfs, recipe.python_packages))
            if proc.returncode != 0:
                raise SandboxError(f"pip install {' '.join(recipe.python_packages)} into the "
                                   f"image failed:\n{proc.stderr.decode()[-3000:]}")  # fmt: skip
        _import(rootfs, tag, recipe)


def _post_process(rootfs: Path, recipe: ImageRecipe) -> None:
    for sub in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for child in (rootfs / sub).glob("*"):
            if child.is_file():
                child.unlink()
    for mount_point in recipe.mount_points:
        path = rootfs / mount_point.lstrip("/")
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o1777)  # tmpfs mounted here keeps the mode; writable by any sandbox uid


def _import(rootfs: Path, tag: str, recipe: ImageRecipe) -> None:
    changes = ["WORKDIR /workspace", f"LABEL {RECIPE_LABEL}={recipe.digest()}"]
    changes += [f"ENV {kv}" for kv in recipe.env]
    argv = ["podman", "import"]
    for change in changes:
        argv += ["--change", change]
    argv += ["-", tag]
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    try:
        proc = subprocess.run(argv, stdin=tar.stdout, capture_output=True, check=False)
    finally:
        assert tar.stdout is not None
        tar.stdout.close()
        tar.wait()
    if proc.returncode != 0 or tar.returncode != 0:
        raise SandboxError(f"podman import failed: {proc.stderr.decode()[-2000:]}")


def extend_image(base: str, setup_script: Path, tag: str, *, network: bool = True) -> str:
    """Build ``tag`` = ``base`` + a task's setup script (run as root at build time).

    Cached like the base: tagged with the hash of base recipe + script content; returns the tag.
    """
    base_hash = image_recipe_hash(base)
    if base_hash is None:
        raise SandboxError(f"base image {base} does not exist; run `sandpiper sandbox build-image`")
    digest = hashlib.sha256(base_hash.encode() + setup_script.read_bytes()).hexdigest()
    if image_recipe_hash(tag) == digest:
        return tag
    with tempfile.TemporaryDirectory(prefix="sandpiper-extend-") as tmp:
        shutil.copy(setup_script, Path(tmp) / "setup.sh")
        (Path(tmp) / "Containerfile").write_text(
            f"FROM {base}\nCOPY setup.sh /.sandpiper-setup.sh\n"
            "RUN bash /.sandpiper-setup.sh && rm -f /.sandpiper-setup.sh\n"
            f"LABEL {RECIPE_LABEL}={digest}\n"
        )
        argv = ["podman", "build", "--pull=never", "-t", tag]
        if not network:
            argv.append("--network=none")
        proc = _run([*argv, tmp])
        if proc.returncode != 0:
            raise SandboxError(f"podman build failed: {proc.stderr.decode()[-3000:]}")
    return tag


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(ensure_image("localhost/sandpiper-sandbox:latest"))
