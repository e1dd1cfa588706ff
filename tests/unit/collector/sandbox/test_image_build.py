"""Pinned Python packages in the sandbox image (collector/sandbox/image_build.py): recorded in the
recipe hash, installed as wheels for the image's own Python. The shared image is never rebuilt
here: the build steps are checked with the commands stubbed, and pip's part for real into a
stand-in rootfs."""

from __future__ import annotations

import hashlib
import json
import subprocess
from dataclasses import asdict
from pathlib import Path

from sandpiper.collector.sandbox import image_build
from sandpiper.collector.sandbox.image_build import ImageRecipe, pip_install_argv


def test_packages_are_in_the_recipe_hash_and_the_default_hash_is_unchanged():
    default = ImageRecipe()
    old_fields = {k: v for k, v in asdict(default).items() if k != "python_packages"}
    old = hashlib.sha256(json.dumps(old_fields, sort_keys=True).encode()).hexdigest()
    assert default.digest() == old  # images built before the field keep their tag
    one = ImageRecipe(python_packages=("reasoning-gym==0.1.25",))
    other = ImageRecipe(python_packages=("reasoning-gym==0.1.24",))
    assert len({default.digest(), one.digest(), other.digest()}) == 3


def _rootfs(tmp_path: Path) -> Path:
    rootfs = tmp_path / "rootfs"
    (rootfs / "usr" / "lib" / "python3.11").mkdir(parents=True)
    return rootfs


def test_the_build_installs_the_packages_before_the_import(tmp_path, monkeypatch):
    calls: list[list[str]] = []

    def run(argv, **kwargs):
        calls.append(argv)
        if argv[0] == "debootstrap":
            _rootfs(Path(argv[-2]).parent)
        return subprocess.CompletedProcess(argv, 0, b"", b"")

    monkeypatch.setattr(image_build.shutil, "which", lambda name: "/usr/sbin/" + name)
    monkeypatch.setattr(image_build, "_run", run)
    imported = []
    monkeypatch.setattr(image_build, "_import", lambda rootfs, tag, recipe: imported.append(tag))
    image_build.build_image("localhost/x:1", ImageRecipe(python_packages=("tabulate==0.9.0",)))
    assert calls[0][0] == "debootstrap" and imported == ["localhost/x:1"]
    pip = calls[1]
    assert pip[1:4] == ["-m", "pip", "install"] and pip[-1] == "tabulate==0.9.0"
    assert pip[pip.index("--python-version") + 1] == "3.11" and "--only-binary=:all:" in pip
    assert pip[pip.index("--target") + 1].endswith("usr/local/lib/python3.11/dist-packages")
    calls.clear()
    image_build.build_image("localhost/x:2", ImageRecipe())
    assert [c[0] for c in calls] == ["debootstrap"]  # no packages: no pip step


def test_pip_installs_a_pinned_wheel_into_the_rootfs(tmp_path):
    rootfs = _rootfs(tmp_path)
    done = subprocess.run(pip_install_argv(rootfs, ("tabulate==0.9.0",)), capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    site = rootfs / "usr" / "local" / "lib" / "python3.11" / "dist-packages"
    assert (site / "tabulate" / "__init__.py").is_file()
    assert list(site.glob("tabulate-0.9.0.dist-info"))
