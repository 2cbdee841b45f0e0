"""A wheel holds every package of the source tree (an editable install would hide a gap)."""

from __future__ import annotations

from pathlib import Path

import tomllib

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
