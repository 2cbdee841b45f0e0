"""Real Flower federations on 127.0.0.1: a SuperLink and SuperNodes (Flower's own processes,
deployment engine) and apps run with ``flwr run``. On two SuperNodes, four runs side by
side: the example app fused by PFNM, the nodes scoring its fused model at its widths (the
models it fused are also averaged in the test); the app the Flower page (docs/flower.md)
writes, file by file, over two rounds, each fused model calibrated with the statistics the
nodes send in a query round, the second round training the first's fused model; the
example with one node sampled, whose round cannot fuse (the initial model comes back); and
the example waiting for a third node, stopped at its timeout. On three SuperNodes: the
example app's BatchNorm MLP fused by PFNM, calibrated (its first BatchNorm from the input
moments the train replies carry, its second in a query round), aligned and refit, a node
lost in each kind of query round: the ClientApp of one failing the calibration round (and
answering the alignment round), one SuperNode killed (SIGKILL) in the alignment round, the
ClientApp of the third failing the first refit round and answering the later ones; the
global model is the protocol's, computed in this process. Each test checks that every
process the federation started has ended. Each test starts a federation of its own, so
that `make test` runs them side by side, and runs that do not depend on each other go on
side by side on one federation (they mostly wait: Flower polls every 3 s). A ClientApp is
a new process per message, forked from the warm process of its node's SuperExec
(fusekit.flower.superexec: Flower's runtime and torch imported once, not 3 s of CPU per
message); each test still asks as few nodes and rounds as its point needs, and each
federation's own processes (1-3 s of CPU a minute each) serve as many runs as can share
it. The longest, the lost nodes', waits once for the killed node's heartbeats to
lapse (37.5-60 s: Flower's SuperNode sends one every 17.5-22.5 s, its SuperLink gives a
node up 60 s after the last, neither has a setting for it); a failing ClientApp's error
comes back at once. Progress lines are printed as the runs go. Deselect with ``-m "not
flower_e2e"``."""

from __future__ import annotations

import functools
import importlib.util
import json
import re
import shutil
import signal
import subprocess
import textwrap
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="needs the [flower] extra")

import fusekit
from fusekit import protocol
from fusekit.core.checkpoint import Checkpoint
from fusekit.flower.local import LocalFederation, progress_lines
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.evaluate import Evaluator
from fusekit.toolkit.nn import build_model
from fusekit.toolkit.processes import descendant_groups, group_alive, groups_with_env
from test_flower_alignment import protocol_with_nodes_killed

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower"

pytestmark = pytest.mark.flower_e2e
T = TypeVar("T")
#: The example ClientApp's query handler, after which the tests' apps insert their faults.
QUERY_HANDLER = ("    data = task.dataset()\n    indices = task.node_indices(context.run_config, "
                 "context.node_config, data)\n    return Message(statistics_reply(")


@pytest.fixture
def progress(request):
    """Writes a line to the terminal at once, output capture or not (one line at a time:
    runs side by side write from their threads)."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin(
        "capturemanager")
    one_at_a_time = threading.Lock()

    def write(line: str) -> None:
        with one_at_a_time, capture.global_and_fixture_disabled():
            reporter.write_line(f"    [flower] {line}")

    return write


class Federation:
    """A LocalFederation whose every process is checked to have ended once it stops."""

    def __init__(self, workdir: Path, nodes: int, progress):
        self.progress = progress
        self.federation = LocalFederation(nodes=nodes, workdir=workdir)

    def __enter__(self) -> LocalFederation:
        self.progress(f"starting a SuperLink and {self.federation.nodes} SuperNode(s)")
        return self.federation.__enter__()

    def __exit__(self, *exc_info) -> None:
        federation = self.federation
        leaders = [p.pid for p in federation.processes]
        groups = set(leaders) | descendant_groups(leaders) | federation.leftover_groups()
        # The SuperLink's SuperExec has a session of its own.
        started_more = len(groups) > len(leaders)
        self.progress("stopping every process the federation started")
        federation.__exit__(*exc_info)
        if exc_info[0] is None:
            assert started_more
            assert not any(group_alive(group) for group in groups)
            assert not groups_with_env("FLWR_HOME", str(federation.home))


def run(federation: LocalFederation, app: Path, config: dict, progress, timeout=900,
        label: str = "", running: threading.Event | None = None):
    """The run's output; ``timeout`` only bounds a run that hangs: the Flower page's app
    took 467 s on two cores running five federations and other tests at a load of 25.
    ``label`` starts its progress lines (runs that go on side by side); ``running`` is set
    at the first line its ServerApp logs."""

    def line(text: str) -> None:
        if running is not None:
            running.set()
        progress(label + text)

    progress(f"{label}flwr run {app.name} {config}")
    return federation.run(app, config, timeout=timeout, on_line=progress_lines(line))


def side_by_side(*runs: Callable[..., T]) -> list[Future[T]]:
    """Independent runs on one federation, each in a thread of its own and called with
    ``running=`` (an Event), each started once the one before has its ServerApp running
    or has ended; their futures, in order, once every one has ended. One ServerApp starts
    at a time so: Flower 1.41 gives a launched app 30 s to take its task, then launches
    another for it, and three ServerApps starting together beside a booting federation
    took longer at a load of 25-30, so that more and more were launched."""
    futures: list[Future[T]] = []
    with ThreadPoolExecutor(len(runs)) as pool:
        for one in runs:
            if futures:
                # Bounded: a run ends by its timeout at the latest.
                while not started.wait(1) and not futures[-1].done():
                    pass
            started = threading.Event()
            futures.append(pool.submit(one, running=started))
    return futures


def readme_app(folder: Path) -> Path:
    """The files the Flower page gives (each block after a line naming it), written as they
    stand, and the empty package file it asks for."""
    page = (ROOT / "docs" / "flower.md").read_text()
    section = page[page.index("## Your own Flower app\n"):page.index("## What the strategy does")]
    blocks = re.findall(r"^`([\w./]+)`(?: \([^)]*\))?:\n\n```\w*\n(.*?)^```$", section,
                        re.M | re.S)
    names = [name for name, _ in blocks]
    assert names == ["pyproject.toml", "my_fusion/task.py", "my_fusion/server_app.py",
                     "my_fusion/client_app.py"]
    for name, block in blocks:
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(block.strip() + "\n")
    (folder / "my_fusion" / "__init__.py").write_text("")
    return folder


def test_two_nodes_run_the_example_and_the_pages_app_a_round_that_cannot_fuse_or_finish(
        tmp_path, progress):
    """Four runs side by side on one federation: the example app fused by PFNM, the
    nodes scoring its fused model (the models it fused are averaged here: avg on the same
    models, without a run of its own); the Flower page's app over two rounds; the example
    with one node of the two sampled (fraction-train 0.5), whose one reply is fewer than
    the two a round fuses: the round fails and the run hands back the initial model; and
    the example waiting for three nodes, of which two are started: its ServerApp would
    wait for ever, so the run is stopped on the SuperLink at its timeout, the others going
    on. Each starts once the one before has its ServerApp running."""
    page_app, page_model = readme_app(tmp_path / "readme-app"), tmp_path / "readme.safetensors"
    pfnm_file, pfnm_nodes = tmp_path / "pfnm.json", tmp_path / "pfnm-nodes"
    one_file, one_model = tmp_path / "one.json", tmp_path / "one.safetensors"
    with Federation(tmp_path / "federation", 2, progress) as federation:
        # The page's run, the longest, first.
        page, pfnm, one, waiting = side_by_side(
            functools.partial(run, federation, page_app, {"model-file": str(page_model)},
                              progress, label="page: "),
            functools.partial(run, federation, APP, {
                "method": "pfnm", "min-nodes": 2, "epochs": 10, "result-file": str(pfnm_file),
                "models-dir": str(pfnm_nodes)}, progress, label="pfnm: "),
            functools.partial(run, federation, APP, {
                "min-nodes": 1, "fraction-train": 0.5, "epochs": 1, "fraction-evaluate": 0.0,
                "result-file": str(one_file), "model-file": str(one_model)}, progress,
                label="one node: "),
            functools.partial(run, federation, APP, {"min-nodes": 3}, progress, timeout=20,
                              label="three nodes: "))
        pfnm.result()
        page_output, one_output = page.result().stdout, one.result().stdout
        with pytest.raises(subprocess.TimeoutExpired):
            waiting.result()
        assert sorted(r["status"] for r in federation.runs()) == [
            *["finished:completed"] * 3, "finished:stopped"]
    assert_pfnm_beats_avg(json.loads(pfnm_file.read_text()), pfnm_nodes)
    assert_the_pages_app_ran(page_output, page_model, page_app)
    # One node sampled of those connected (both, unless the run began before the second).
    assert re.search(r"configure_train: Sampled 1 nodes \(out of [12]\)", one_output)
    assert_the_initial_model_came_back(json.loads(one_file.read_text()), one_model)


def assert_pfnm_beats_avg(pfnm: dict, nodes_dir: Path) -> None:
    """The example app's results: PFNM's fused model wider than the nodes' and better on
    the test split than their average (fusekit's avg, as a FedAvg run fuses them, of the
    models the run fused), and scored by the nodes, which rebuilt it from the widths in
    the ConfigRecord."""
    assert pfnm["hidden_widths"] == [150]  # the default fused width: 1.5 × the widest node
    nodes = [fusekit.load_checkpoint(path) for path in sorted(nodes_dir.iterdir())]
    assert len(nodes) == 2 and all(node.arch["hidden"] == [100] for node in nodes)
    average = fusekit.fuse(nodes, method="avg")
    evaluator = Evaluator(load_dataset("digits"), "cpu")
    _, logits = evaluator.logits(Checkpoint.from_state_dict(average.state_dict,
                                                            average.metadata))
    assert pfnm["accuracy"] > evaluator.score(logits, "avg", "fused").accuracy + 0.05
    assert pfnm["left_out"] == {}
    round_one = pfnm["train_metrics"]["1"]
    assert round_one["pfnm.fused-replies"] == 2
    assert round_one["pfnm.fused-widths"] == pfnm["hidden_widths"]
    assert pfnm["client_evaluation"]["1"]["accuracy"] > 0.8


def assert_the_pages_app_ran(output: str, model_file: Path, app: Path) -> None:
    """The Flower page's app: fusekit's lines with their level, no evaluate failures,
    PFNM's width kept by the averaged second round (the nodes trained the 150-wide
    model), each round's model calibrated with both nodes' statistics."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in output.splitlines()]
    assert any(re.match(r"INFO\s*:\s+round 1: pfnm fused 2 models .* \[150\]$", line)
               for line in lines)
    assert any(re.match(r"INFO\s*:\s+round 2: avg fused 2 models .* \[150\]$", line)
               for line in lines)
    assert "No evaluate function registered" not in output
    assert "Received 2 results and 0 failures" in output
    for round_ in (1, 2):
        assert any(re.match(rf"INFO\s*:\s+round {round_}: calibrated with the statistics of "
                            r"2 node\(s\) over 1347 inputs \(one-pass, 1 query round", line)
                   for line in lines)
    assert "left out" not in output
    assert fusekit.load_checkpoint(model_file).tensors["0.weight"].shape == (150, 64)
    model = fusekit.load_fused(model_file, "cpu")
    digits = load_dataset("digits")
    with torch.no_grad():
        predicted = model(torch.as_tensor(digits.x_test)).argmax(dim=1).numpy()
    assert not model.training and (predicted == digits.y_test).mean() > 0.8
    assert_running_statistics_are_the_nodes_pooled(model, app)


def assert_running_statistics_are_the_nodes_pooled(model, app: Path) -> None:
    """The global model's BatchNorm holds the mean and (unbiased) variance of its input
    over the union of the two nodes' data, as one pass over it would give: its input,
    the first layer's output, is the same in both calibration modes."""
    spec = importlib.util.spec_from_file_location("readme_task", app / "my_fusion" / "task.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    x = torch.cat([task.node_data({"partition-id": i, "num-partitions": 2})[0]
                   for i in range(2)])
    assert len(x) == 1347
    with torch.no_grad():
        h = model.get_submodule("0")(x).double()
    norm = model.get_submodule("1")
    torch.testing.assert_close(norm.running_mean.double(), h.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.running_var.double(), h.var(0), rtol=1e-5, atol=1e-5)


def assert_the_initial_model_came_back(result: dict, model_file: Path) -> None:
    """A run whose one round could not fuse: no fused round, no train metrics, and the
    model written is the ServerApp's initial one, build_model(arch, seed=0) (the run
    config's seed)."""
    assert result["fused_rounds"] == 0 and result["train_metrics"] == {}
    assert result["hidden_widths"] == [100]
    initial = fusekit.load_checkpoint(model_file)
    assert initial.arch["hidden"] == [100]
    expected = build_model(initial.arch, seed=0).state_dict()
    for name, tensor in expected.items():
        assert (initial.tensor(name) == tensor.numpy()).all(), name


def fused_nodes(models_dir: Path, config: dict, count: int
                ) -> tuple[list[Checkpoint], list[np.ndarray], list[int]]:
    """The nodes' models the ServerApp wrote (node-<id>.safetensors, by file name), and
    for each its training inputs and partition, found by its class counts."""
    task = example_task()
    data = task.dataset()
    nodes = [fusekit.load_checkpoint(path) for path in sorted(models_dir.iterdir())]
    inputs, parts = [None] * len(nodes), [None] * len(nodes)
    for part in range(count):
        indices = task.node_indices(config, {"partition-id": part, "num-partitions": count},
                                    data)
        counts = np.bincount(data.y_train[indices], minlength=data.num_classes)
        (i,) = [i for i, n in enumerate(nodes) if (n.class_counts == counts).all()]
        inputs[i], parts[i] = data.x_train[indices], part
    return nodes, inputs, parts


def assert_same_model(model: Checkpoint, expected: dict) -> None:
    for name, value in expected.items():
        np.testing.assert_allclose(model.tensor(name), value, rtol=1e-4, atol=1e-5,
                                   err_msg=name)


#: The partition whose ClientApp fails the calibration query round (it raises) and
#: answers the later ones.
MISSES_CALIBRATION = 1
#: The partition whose SuperNode is killed (SIGKILL, with its process group) while it
#: computes its reply to the alignment query: the test's one heartbeat wait.
KILLED = 2
#: The partition whose ClientApp fails the first refit round (it raises) and answers the
#: later ones.
MISSES_REFIT = 0


def test_three_nodes_lose_one_in_each_kind_of_query_round_killed_or_failing(
        tmp_path, progress):
    """A BatchNorm MLP with two hidden layers from each node's own initial weights, fused
    by PFNM on three SuperNodes, then calibrated layer by layer: the first BatchNorm from
    the input moments the train replies carry (no query), the second in one query round;
    then one alignment round and a refit round per layer. Partition 1's ClientApp fails
    the calibration round and answers the alignment round: it is asked again, and
    re-fused. Partition 2's SuperNode is killed with SIGKILL (with its process group: the
    SuperExec and the ClientApp) while it computes its alignment reply: Flower answers for
    it with "Node Unavailable" once its heartbeats have lapsed, and it is asked no more.
    Partition 0's ClientApp fails the first refit round and answers the next two. A
    failing ClientApp's error comes back at once. The run finishes; each round goes on
    with the nodes that answered, the lost nodes are named in the log and in the result
    with their reason; the global model is what the protocol's steps give in this process
    over the same nodes' models and data: the first BatchNorm over all three nodes' inputs
    (their moments came with their models), the second without partition 1's statistics,
    the alignment and refit rounds over partitions 0 and 1, partition 0 back from the
    second refit round on."""
    config = {"method": "pfnm", "arch": "mlp:32,32", "batchnorm": True, "epochs": 5,
              "min-nodes": 3, "partition": "dirichlet", "alpha": 0.5, "seed": 0,
              "calibrate": True, "calibration-rounds": "layerwise", "alignment-rounds": 1,
              "input-moments": True, "fraction-evaluate": 0.0}
    app = tmp_path / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    client_app = app / "fusekit_digits" / "client_app.py"
    source = client_app.read_text()
    assert source.count(QUERY_HANDLER) == 1
    client_app.write_text(source.replace(QUERY_HANDLER, textwrap.indent(textwrap.dedent(f"""\
        import os, signal
        partition, query = context.node_config["partition-id"], msg.content["config"]
        if partition == {KILLED} and query["fusekit-stats-kind"] == "cross":
            os.killpg(os.getpgrp(), signal.SIGKILL)  # this SuperNode's group
        if partition == {MISSES_CALIBRATION} and query["fusekit-stats-kind"] == "channels":
            raise RuntimeError("partition {MISSES_CALIBRATION} misses the calibration round")
        if partition == {MISSES_REFIT} and query.get("fusekit-refit-layer") == "net.0":
            raise RuntimeError("partition {MISSES_REFIT} misses the first refit round")
        """), "    ") + QUERY_HANDLER))
    models_dir = tmp_path / "nodes"
    result_file, model_file = tmp_path / "lost.json", tmp_path / "lost.safetensors"
    config.update({"result-file": str(result_file), "model-file": str(model_file),
                   "models-dir": str(models_dir)})
    with Federation(tmp_path / "federation", 3, progress) as federation:
        output = run(federation, app, config, progress).stdout
        supernodes = federation.processes[1:]
        assert [node.poll() for node in supernodes] == [None, None, -signal.SIGKILL]
    result = json.loads(result_file.read_text())
    metrics = result["train_metrics"]["1"]
    assert metrics["pfnm.fused-replies"] == 3 and metrics["pfnm.calibration-rounds"] == 1
    assert metrics["pfnm.calibration-nodes"] == 2 and metrics["pfnm.calibration-paired"] == 0
    assert metrics["pfnm.aligned"] == 1 and metrics["pfnm.alignment-nodes"] == 2
    assert metrics["pfnm.refit-rounds"] == 3

    nodes, inputs, parts = fused_nodes(models_dir, config, 3)
    ids = {part: int(path.stem.removeprefix("node-"))
           for part, path in zip(parts, sorted(models_dir.iterdir()), strict=True)}
    stopped = "the node stopped answering (error 5: Error: Node Unavailable"
    misses = {part: f"the ClientApp failed (error 2: RuntimeError: partition {part} misses "
                    f"the {what} round)"
              for part, what in ((MISSES_CALIBRATION, "calibration"),
                                 (MISSES_REFIT, "first refit"))}
    assert result["left_out_statistics"] == {
        str(ids[MISSES_CALIBRATION]): misses[MISSES_CALIBRATION]}
    left_out = result["left_out_alignment"]
    assert sorted(left_out) == sorted(str(ids[p]) for p in (KILLED, MISSES_REFIT))
    assert left_out[str(ids[KILLED])].startswith(stopped), left_out
    assert left_out[str(ids[MISSES_REFIT])] == misses[MISSES_REFIT]
    lines = {f"round 1: statistics of node {ids[MISSES_CALIBRATION]} left out: "
             f"{misses[MISSES_CALIBRATION]}",
             f"round 1: cross statistics of node {ids[KILLED]} left out: {stopped}",
             f"round 1: refit statistics of node {ids[MISSES_REFIT]} left out: "
             f"{misses[MISSES_REFIT]}"}
    assert all(line in output for line in lines), output
    assert "round 1: aligned to 2 node(s) in 1 alignment and 3 refit round(s)" in output
    assert result["accuracy"] > min(result["node_accuracy"])

    fused = fusekit.fuse(nodes, method="pfnm", width_ratio=1.5)
    fused = Checkpoint.from_state_dict(fused.state_dict, fused.metadata)
    # Rounds: the first BatchNorm derived, the second's calibration, alignment, refit of
    # each of the three layers.
    killed = {protocol.CROSS: parts.index(KILLED)}
    misses_first = {protocol.STATISTICS: parts.index(MISSES_CALIBRATION),
                    protocol.REFIT: parts.index(MISSES_REFIT)}
    expected = protocol_with_nodes_killed(fused, nodes, inputs, killed, input_moments=True,
                                          misses_first=misses_first)
    assert [set(done["missing"]) for done in expected.history] == [
        set(), {parts.index(MISSES_CALIBRATION)}, {parts.index(KILLED)},
        {parts.index(MISSES_REFIT)}, set(), set()]
    assert_same_model(fusekit.load_checkpoint(model_file), expected.model.state_dict())
    # The losses, and the first BatchNorm from the moments, show in the model: the same
    # rounds with everyone answering differ, as do those with the first BatchNorm from a
    # query round.
    for other in (protocol_with_nodes_killed(fused, nodes, inputs, {}, input_moments=True),
                  protocol_with_nodes_killed(fused, nodes, inputs, killed,
                                             misses_first=misses_first)):
        assert any(not np.allclose(other.model.tensor(name), expected.model.tensor(name),
                                   atol=1e-3) for name in expected.model.tensors)


def example_task():
    """examples/flower's task module (its data and each node's part of it)."""
    spec = importlib.util.spec_from_file_location("example_task",
                                                  APP / "fusekit_digits" / "task.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    return task

