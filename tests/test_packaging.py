"""A wheel holds every package of the source tree (an editable install would hide a gap)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_every_package_in_the_source_tree_is_listed_for_the_wheel():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    dirs = {"fusekit": ROOT / "fusekit", **{name: ROOT / path
                                             for name, path in config["package-dir"].items()}}
    found = set()
    for top, folder in dirs.items():
        for init in folder.rglob("__init__.py"):
            parts = init.parent.relative_to(folder).parts
            found.add(".".join((top, *parts)))
    assert found == listed


def test_demos_install_only_when_what_the_install_builds_from_changed(tmp_path):
    """`make demo`/`make flower-demo` skip pip when the install stamp is newer than
    pyproject.toml, setup.py and csrc/ and the C++ core exists; `make install` always runs."""
    import os
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    shutil.copy(ROOT / "Makefile", tmp_path)
    sources = ["pyproject.toml", "setup.py", "fusekit/_version.py", "csrc/lap.cpp",
               "fusekit/_core.cpython-311-x86_64-linux-gnu.so", ".venv/bin/python"]
    for name in sources:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    stamp = tmp_path / ".venv/.fusekit-installed"

    def installs(target="demo"):
        dry = subprocess.run(["make", "-n", target], cwd=tmp_path, capture_output=True,
                             text=True, timeout=60, check=True)
        return "pip install" in dry.stdout

    assert installs() and installs("flower-demo")  # never installed
    stamp.touch()
    os.utime(stamp, (2e9, 2e9))
    assert not installs() and not installs("flower-demo") and installs("install")
    for name in ("setup.py", "csrc/lap.cpp", "pyproject.toml"):
        os.utime(tmp_path / name, (2e9 + 1, 2e9 + 1))
        assert installs(), name
        os.utime(tmp_path / name, (1e9, 1e9))
    assert not installs()
    (tmp_path / sources[4]).unlink()  # the C++ core is gone
    assert installs()


@pytest.mark.xdist_group("packaging")
def test_a_grouped_test_carries_its_group_under_loadgroup(request):
    """`make test`'s --dist loadgroup runs a group's tests on one worker only if
    pytest-xdist can tag their ids with it (pytest 9.2 no longer lets it: each module's
    servers and trained fixtures were then made on every worker)."""
    if not getattr(request.config.option, "loadgroup", False):  # set in a worker only
        pytest.skip("not run by pytest-xdist with --dist loadgroup")
    assert request.node.nodeid.endswith("@packaging"), (
        f"pytest {pytest.__version__}: pytest-xdist could not tag {request.node.nodeid} with "
        "its group (pyproject.toml's test extra names the pytest it can)")
