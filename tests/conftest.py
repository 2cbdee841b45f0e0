"""Small real models, written as checkpoints, for the tests."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from torch import nn

# torch and fusekit are imported where they are used: pytest-xdist's controller process loads
# this file too and runs no test (importing torch would cost it 2 s of CPU).


def mlp(widths=(6, 5, 3), batchnorm=False, seed=0) -> nn.Sequential:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers += [nn.BatchNorm1d(b)] if batchnorm else []
            layers.append(nn.ReLU())
    return _with_random_stats(nn.Sequential(*layers))


def cnn(channels=(4, 6), hidden=8, classes=3, seed=0) -> nn.Sequential:
    """Conv-BN-ReLU-MaxPool blocks on 1x8x8 images, then a linear head."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    c_in = 1
    for c in channels:
        layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.MaxPool2d(2)]
        c_in = c
    side = 8 // 2 ** len(channels)
    layers += [nn.Flatten(), nn.Linear(c_in * side * side, hidden), nn.ReLU(),
               nn.Linear(hidden, classes)]
    return _with_random_stats(nn.Sequential(*layers))


def _with_random_stats(model: nn.Module) -> nn.Module:
    """BatchNorm with non-trivial statistics, so tests see whether they are handled."""
    import torch
    from torch import nn

    for module in model.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
            module.weight.data.uniform_(0.5, 1.5)
            module.bias.data.normal_()
            module.num_batches_tracked.fill_(int(torch.randint(1, 100, ()).item()))
    return model.eval()


def write(path: Path, model_or_sd, **metadata) -> Path:
    from torch import nn

    from fusekit.core.checkpoint import save_checkpoint

    sd = model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd
    meta = {f"fusekit.{k}": str(v) for k, v in metadata.items()}
    return save_checkpoint(path, sd, meta)


def write_raw(path: Path, model_or_sd, **metadata) -> Path:
    """Like :func:`write`, through safetensors alone: for hostile files that
    ``save_checkpoint`` refuses to write (NaN weights, odd shapes)."""
    import safetensors.numpy
    from torch import nn

    sd = model_or_sd.state_dict() if isinstance(model_or_sd, nn.Module) else model_or_sd
    arrays = {k: np.asarray(v.detach().numpy() if hasattr(v, "detach") else v)
              for k, v in sd.items()}
    safetensors.numpy.save_file(arrays, path, {f"fusekit.{k}": str(v) for k, v in metadata.items()})
    return Path(path)


def numpy_state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def file_digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture
def small_synthetic_args() -> list[str]:
    """The CLI's data flags for a small synthetic set: 300 samples, 5 features, 3 classes."""
    return ["--data", "synthetic", "--samples", "300", "--features", "5", "--classes", "3"]


@pytest.fixture
def mlp_clients(tmp_path) -> list[Path]:
    """Three 6-5-3 MLP clients with BatchNorm and sample/class counts."""
    counts = [[5, 3, 2], [1, 8, 1], [0, 2, 8]]
    return [
        write(tmp_path / f"client{i}.safetensors", mlp(batchnorm=True, seed=i),
              num_samples=sum(c), class_counts=str(c))
        for i, c in enumerate(counts)
    ]


@contextlib.contextmanager
def made_once(tmp_path_factory, name: str) -> Iterator[tuple[Path, bool]]:
    """``(folder, made)``: a folder every pytest-xdist worker of this run shares, held under
    a lock; ``made`` says whether a worker already made what it holds (else the caller
    makes it, and it counts as made once the block ends without an error)."""
    root = tmp_path_factory.getbasetemp()
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    folder, done = root / name, root / f"{name}.made"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        made = done.exists()
        folder.mkdir(exist_ok=True)
        yield folder, made
        done.touch()


@pytest.fixture(scope="session")
def foreign(tmp_path_factory):
    """Models fusekit did not train (:mod:`foreign`), trained once per run (the first
    worker to need a kind trains it, the others read its files), by kind:
    ``foreign(kind)`` -> :class:`foreign.Family`."""
    import foreign as own

    families: dict[str, own.Family] = {}

    def family(kind: str) -> own.Family:
        if kind not in families:
            with made_once(tmp_path_factory, f"foreign-{kind}") as (folder, made):
                families[kind] = (own.load_family(kind, folder) if made else
                                  own.make_family(kind, folder))
        return families[kind]

    return family


# -- running the suite ------------------------------------------------------------------------
# `make test` runs it on five pytest-xdist workers (`-n 5 --dist loadgroup`) on two cores:
# a Flower federation mostly waits (Flower polls every 3 s, and gives up a killed SuperNode
# only once its heartbeats have lapsed), so each of the two runs on a worker of its own
# beside three workers kept busy with the rest (each worker costs about 7 s of CPU to start and
# collect the suite: no more of them than keep the cores busy). A test that uses one of
# these module-scoped servers runs on the worker that already holds it, so that each is
# started once, and so do the tests that use a module-scoped fixture of their module
# (trained models), unless marked `spread` (a long test whose module fixtures are cheap to
# make again: one that starts servers of its own); every other test goes to whichever
# worker is free.
SHARED_SERVERS = ("service", "big_service", "browser")


def pytest_configure(config) -> None:
    _build_each_cli_once()
    # A worker of `make test` shares the cores with the others: one torch thread each, as
    # more would oversubscribe them (torch's threads then wait on one another), and one
    # OpenMP thread in each process the tests start (a command, a server's worker, a
    # SuperNode): on 2 busy cores the page's 20-epoch training took 62 s of CPU with two
    # spinning OpenMP threads, 6 s with one.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import torch

        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"


# A worker holds torch's objects and the suite's (about 400,000 once it has collected):
# the collector's full passes traverse every one of them, and Python's shutdown runs several
# (1-2 s of CPU a worker, at the end of the run). Frozen, they are left out of every pass;
# none of them is garbage (modules, the collected tests, what their imports made).
def pytest_collection_finish(session) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        gc.freeze()  # and what the tests left, before the shutdown's passes


def _build_each_cli_once() -> None:
    """typer's CliRunner builds the click command of the whole app again on every invoke
    (10 ms of CPU, and `fuse` its options from every method's declarations again; the CLI
    tests invoke it hundreds of times): each Typer app is built once per process here (a
    click command keeps no state between invocations)."""
    import typer.testing

    build, built = typer.testing._get_command, {}

    def get_command(app):
        if id(app) not in built:  # the app is kept with its command: its id stays its own
            built[id(app)] = (app, build(app))
        return built[id(app)][1]

    typer.testing._get_command = get_command


def pytest_report_header(config) -> list[str]:
    return ["some tests start real processes on 127.0.0.1 and stop them all: fusion servers "
            "with their workers, and (marked flower_e2e) Flower federations of a SuperLink "
            "and SuperNodes; deselect those with -m 'not flower_e2e'"]


def uses_module_fixture(item) -> bool:
    """Whether the test uses a module-scoped fixture of its own module (a trained model, a
    server): the tests that do run on one worker, which makes it once."""
    module = item.nodeid.split("::")[0]
    return any(fixturedef.scope in ("module", "class") and fixturedef.baseid == module
               for fixturedefs in item._fixtureinfo.name2fixturedefs.values()
               for fixturedef in fixturedefs[-1:])


@pytest.hookimpl(trylast=True)  # after pytest has ordered the tests by their fixtures
def pytest_collection_modifyitems(config, items) -> None:
    """The federations first, then the long tests marked `spread`, then the tests on a
    shared server, then the rest (each kept in its order): the longest work starts first,
    so that no worker is left with it at the end. xdist hands every worker a second unit
    of work at the start, which a federation's worker runs only once its federation has
    ended: short single tests come right after the federations, so that no long test
    waits behind one."""
    for item in items:
        if item.get_closest_marker("spread"):
            assert not any(name in item.fixturenames for name in SHARED_SERVERS), (
                f"{item.nodeid}: marked spread, it would start its module's server again")
            continue
        if (any(name in item.fixturenames for name in SHARED_SERVERS)
                or uses_module_fixture(item)):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
    kinds: dict[str, list] = {"federation": [], "spread": [], "grouped": [], "single": []}
    for item in items:
        kind = ("federation" if item.get_closest_marker("flower_e2e") else
                "spread" if item.get_closest_marker("spread") else
                "grouped" if item.get_closest_marker("xdist_group") else "single")
        kinds[kind].append(item)
    federations, spread, grouped, single = kinds.values()
    behind = 2 * int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    items[:] = federations + single[:behind] + spread + grouped + single[behind:]
