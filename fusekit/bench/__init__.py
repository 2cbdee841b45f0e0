"""Benchmark code shared by ``fusekit bench`` and the scripts in benchmarks/."""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import numpy as np

from fusekit._native import core_status
from fusekit._version import __version__
from fusekit.checkpoint import write_atomic


def machine_info(**extra: Any) -> dict[str, Any]:
    """What every benchmark's JSON records about the machine, versions and backend."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "fusekit": __version__,
        "core": core_status(),
        **extra,
    }


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    """Write a benchmark's results, creating the folder; says where on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(payload, indent=2).encode())
    print(f"wrote {path}")
