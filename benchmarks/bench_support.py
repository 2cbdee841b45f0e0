"""What the benchmark scripts share: machine info, JSON output, random networks."""

from __future__ import annotations

import json
import os
import platform
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fusekit._version import __version__
from fusekit.core.checkpoint import Checkpoint, write_atomic
from fusekit.core.spec import infer_spec, permute
from fusekit.engine.native import core_status


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


def status_mb(field: str, pid: int | str = "self") -> float:
    """A memory line of a process's /proc status (Linux), such as its resident size
    (VmRSS) or resident peak (VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field} line")


def add_output_arguments(parser: Any, json_out: Path, rerender: str | None = None) -> None:
    """The options every benchmark that writes RESULTS.md shares: where its raw rows go
    (``--json-out``), the RESULTS.md it writes (``--results-md``, ``--no-write``), and, with
    ``rerender`` (what is re-rendered), ``--from-json`` to re-render without runs."""
    parser.add_argument("--json-out", type=Path, default=json_out)
    parser.add_argument("--results-md", type=Path, default=Path(__file__).parent / "RESULTS.md")
    parser.add_argument("--no-write", action="store_true", help="do not touch RESULTS.md")
    if rerender is not None:
        parser.add_argument("--from-json", type=Path, default=None,
                            help=f"re-render {rerender} from a saved JSON, no runs")


def write_json(path: str | os.PathLike[str], payload: dict[str, Any]) -> None:
    """Write a benchmark's results, creating the folder; says where on stdout."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(payload, indent=2).encode())
    print(f"wrote {path}")


def write_section(path: str | os.PathLike[str], section: str, begin: str, end: str) -> None:
    """Put ``section`` between the ``begin``/``end`` marker lines of a markdown file (appended
    when the markers are missing), atomically; the rest of the file is kept."""
    path = Path(path)
    block = f"{begin}\n{section.strip()}\n{end}\n"
    text = path.read_text() if path.exists() else "# fusekit benchmark results\n\n"
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        after = rest.split(end, 1)[1].lstrip("\n")
        text = before + block + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + block
    write_atomic(path, text.encode())


def save_figure(fig: Any, path: str | os.PathLike[str], dpi: int = 120) -> None:
    """Lay out a matplotlib figure, write it as PNG atomically, and close it."""
    import io

    import matplotlib.pyplot as plt

    fig.tight_layout()
    image = io.BytesIO()
    fig.savefig(image, format="png", dpi=dpi)
    plt.close(fig)
    write_atomic(path, image.getvalue())


def random_mlp(width: int = 100, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"net.0.weight": rng.normal(0, 784 ** -0.5, (width, 784)),
            "net.0.bias": rng.normal(0, 0.1, width),
            "net.2.weight": rng.normal(0, width ** -0.5, (10, width)),
            "net.2.bias": rng.normal(0, 0.1, 10)}


def random_cnn(channels: Sequence[int] = (64, 96, 128), seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    state: dict[str, np.ndarray] = {}
    prev, size = 3, 32
    for i, width in enumerate(channels):
        conv, norm = f"net.{4 * i}", f"net.{4 * i + 1}"
        state[f"{conv}.weight"] = rng.normal(0, (prev * 9) ** -0.5, (width, prev, 3, 3))
        state[f"{conv}.bias"] = rng.normal(0, 0.05, width)
        state[f"{norm}.weight"] = rng.uniform(0.5, 1.5, width)
        state[f"{norm}.bias"] = rng.normal(0, 0.1, width)
        state[f"{norm}.running_mean"] = rng.normal(0, 0.1, width)
        state[f"{norm}.running_var"] = rng.uniform(0.5, 2.0, width)
        prev, size = width, size // 2
    head = f"net.{4 * len(channels) + 1}"
    state[f"{head}.weight"] = rng.normal(0, (prev * size * size) ** -0.5, (10, prev * size**2))
    state[f"{head}.bias"] = rng.normal(0, 0.05, 10)
    return state


def permuted_copies(state: dict[str, np.ndarray], n_clients: int, noise: float, seed: int,
                    widths: Sequence[int] | None = None) -> list[Checkpoint]:
    """Noisy, permuted copies of one network; with ``widths`` the first hidden layer of
    client s keeps only ``widths[s]`` of its neurons (or duplicates some, when wider)."""
    rng = np.random.default_rng(seed)
    spec = infer_spec(state)
    clients = []
    for s in range(n_clients):
        copy = permute(state, spec, [rng.permutation(w) for w in spec.hidden_widths])
        if widths is not None:
            keep = rng.choice(spec.hidden_widths[0], widths[s],
                              replace=widths[s] > spec.hidden_widths[0])
            for ref in spec.group(0):
                copy[ref.tensor] = np.take(copy[ref.tensor], keep, axis=ref.axis)
        copy = {k: v if "running" in k else v + noise * v.std() * rng.standard_normal(v.shape)
                for k, v in copy.items()}
        clients.append(Checkpoint.from_state_dict(copy, {"fusekit.num_samples": "100"}))
    return clients
