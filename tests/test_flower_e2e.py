"""Real Flower federations on 127.0.0.1: a SuperLink and SuperNodes (Flower's own
processes, deployment engine) and apps run with ``flwr run``. On three SuperNodes: the
example app fused by FedAvg (fusekit's avg) and by PFNM, and the app the Flower page
(docs/flower.md) writes, file by file, over two rounds, each fused model calibrated with the
statistics the nodes send in a query round; the example app's BatchNorm MLP fused,
calibrated, aligned and refit in three query rounds, one node missing the first refit
round. On one SuperNode: a run whose round cannot fuse (the initial model comes back) and
a run that cannot finish, stopped at its timeout. Each test checks that every process the federation started has ended. About 6-7
minutes on two busy cores (each query round about 15-30 s of it), up to 12 on a heavily
loaded machine; progress lines are printed as the runs go. Deselect with
``-m "not flower_e2e"``."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr", reason="needs the [flower] extra")

import fusekit
from fusekit.core.checkpoint import Checkpoint
from fusekit.flower.local import LocalFederation, progress_lines
from fusekit.toolkit.data import load_dataset
from fusekit.toolkit.nn import build_model
from fusekit.toolkit.processes import descendant_groups, group_alive, groups_with_env
from test_flower_alignment import refit_without

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "examples" / "flower"

pytestmark = pytest.mark.flower_e2e


@pytest.fixture
def progress(request):
    """Writes a line to the terminal at once, output capture or not."""
    plugins = request.config.pluginmanager
    reporter, capture = plugins.get_plugin("terminalreporter"), plugins.get_plugin(
        "capturemanager")

    def write(line: str) -> None:
        with capture.global_and_fixture_disabled():
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


def run(federation: LocalFederation, app: Path, config: dict, progress, timeout=420):
    progress(f"flwr run {app.name} {config}")
    return federation.run(app, config, timeout=timeout, on_line=progress_lines(progress))


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


def test_three_nodes_run_the_example_and_the_readme_app(tmp_path, progress):
    with Federation(tmp_path / "federation", 3, progress) as federation:
        results = {}
        for method, evaluate in (("avg", 0.0), ("pfnm", 1.0)):
            result_file = tmp_path / f"{method}.json"
            run(federation, APP, {"method": method, "epochs": 10,
                                  "fraction-evaluate": evaluate,
                                  "result-file": str(result_file)}, progress)
            results[method] = json.loads(result_file.read_text())
        model_file = tmp_path / "readme-global.safetensors"
        readme = run(federation, readme_app(tmp_path / "readme-app"),
                     {"model-file": str(model_file)}, progress).stdout

    avg, pfnm = results["avg"], results["pfnm"]
    assert avg["hidden_widths"] == [100]
    assert pfnm["hidden_widths"] == [150]  # the default fused width: 1.5 × the widest node
    assert pfnm["accuracy"] > avg["accuracy"] + 0.05
    assert pfnm["left_out"] == {} and avg["left_out"] == {}
    round_one = pfnm["train_metrics"]["1"]
    assert round_one["pfnm.fused-replies"] == 3
    assert round_one["pfnm.fused-widths"] == pfnm["hidden_widths"]
    # The nodes rebuilt the fused model from the widths in the ConfigRecord and scored it.
    assert pfnm["client_evaluation"]["1"]["accuracy"] > 0.8

    # The Flower page's app: fusekit's lines with their level, no evaluate failures, PFNM's
    # width kept by the averaged second round (the nodes trained the 150-wide model).
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for line in readme.splitlines()]
    assert any(re.match(r"INFO\s*:\s+round 1: pfnm fused 3 models .* \[150\]$", line)
               for line in lines)
    assert any(re.match(r"INFO\s*:\s+round 2: avg fused 3 models .* \[150\]$", line)
               for line in lines)
    assert "No evaluate function registered" not in readme
    assert "Received 3 results and 0 failures" in readme
    for round_ in (1, 2):  # each fused model calibrated with the three nodes' statistics
        assert any(re.match(rf"INFO\s*:\s+round {round_}: calibrated with the statistics of "
                            r"3 node\(s\) over 1347 inputs \(one-pass, 1 query round", line)
                   for line in lines)
    assert "left out" not in readme
    assert fusekit.load_checkpoint(model_file).tensors["0.weight"].shape == (150, 64)
    model = fusekit.load_fused(model_file, "cpu")
    digits = load_dataset("digits")
    with torch.no_grad():
        predicted = model(torch.as_tensor(digits.x_test)).argmax(dim=1).numpy()
    assert not model.training and (predicted == digits.y_test).mean() > 0.8
    assert_running_statistics_are_the_nodes_pooled(model, tmp_path / "readme-app")


def assert_running_statistics_are_the_nodes_pooled(model, app: Path) -> None:
    """The global model's BatchNorm holds the mean and (unbiased) variance of its input
    over the union of the three nodes' data, as one pass over it would give: its input,
    the first layer's output, is the same in both calibration modes."""
    spec = importlib.util.spec_from_file_location("readme_task", app / "my_fusion" / "task.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    x = torch.cat([task.node_data({"partition-id": i, "num-partitions": 3})[0]
                   for i in range(3)])
    assert len(x) == 1347
    with torch.no_grad():
        h = model.get_submodule("0")(x).double()
    norm = model.get_submodule("1")
    torch.testing.assert_close(norm.running_mean.double(), h.mean(0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(norm.running_var.double(), h.var(0), rtol=1e-5, atol=1e-5)


def test_one_node_a_round_that_cannot_fuse_and_a_run_that_cannot_finish(tmp_path, progress):
    """One reply is fewer than the two a round fuses: the round fails and the run hands
    back the initial model. Two nodes required, one started: the ServerApp would wait for
    ever; the run is stopped on the SuperLink at its timeout."""
    with Federation(tmp_path / "federation", 1, progress) as federation:
        result_file, model_file = tmp_path / "one.json", tmp_path / "one.safetensors"
        run(federation, APP, {"min-nodes": 1, "epochs": 1, "fraction-evaluate": 0.0,
                              "result-file": str(result_file),
                              "model-file": str(model_file)}, progress)
        with pytest.raises(subprocess.TimeoutExpired):
            run(federation, APP, {"min-nodes": 2}, progress, timeout=20)
        assert sorted(r["status"] for r in federation.runs()) == ["finished:completed",
                                                                   "finished:stopped"]
    result = json.loads(result_file.read_text())
    assert result["fused_rounds"] == 0 and result["train_metrics"] == {}
    assert result["hidden_widths"] == [100]
    initial = fusekit.load_checkpoint(model_file)
    assert initial.arch["hidden"] == [100]
    # The ServerApp's initial model: build_model(arch, seed=0), the run config's seed.
    expected = build_model(initial.arch, seed=0).state_dict()
    for name, tensor in expected.items():
        assert (initial.tensor(name) == tensor.numpy()).all(), name


def test_three_nodes_align_and_refit_the_fusion_one_missing_a_refit_round(tmp_path, progress):
    """A BatchNorm MLP from each node's own initial weights, fused by PFNM and calibrated
    layer by layer (its one BatchNorm from the input moments the train replies carry: no
    query), then one alignment round and a refit round per layer: three query rounds on
    real SuperNodes. The node of partition 0 fails the first refit query: that round
    refits with the other two, and it takes part in the next. The global model is what
    the same rounds give in this process with the same nodes' models and data."""
    app = tmp_path / "app"
    shutil.copytree(APP, app, ignore=shutil.ignore_patterns("__pycache__"))
    client_app = app / "fusekit_digits" / "client_app.py"
    handler = "    data = task.dataset()\n    indices = task.node_indices(context.run_config, " \
              "context.node_config, data)\n    return Message(statistics_reply("
    source = client_app.read_text()
    assert source.count(handler) == 1
    client_app.write_text(source.replace(handler, textwrap.indent(textwrap.dedent("""\
        if (context.node_config["partition-id"] == 0
                and msg.content["config"].get("fusekit-refit-layer") == "net.0"):
            raise RuntimeError("partition 0 misses the first refit round")
        """), "    ") + handler))
    models_dir = tmp_path / "nodes"
    result_file, model_file = tmp_path / "align.json", tmp_path / "align.safetensors"
    config = {"method": "pfnm", "arch": "mlp:32", "batchnorm": True, "epochs": 5,
              "partition": "dirichlet", "alpha": 0.5, "seed": 0,
              "calibrate": True, "calibration-rounds": "layerwise", "alignment-rounds": 1,
              "input-moments": True, "fraction-evaluate": 0.0,
              "result-file": str(result_file), "model-file": str(model_file),
              "models-dir": str(models_dir)}
    with Federation(tmp_path / "federation", 3, progress) as federation:
        output = run(federation, app, config, progress).stdout
    result = json.loads(result_file.read_text())
    metrics = result["train_metrics"]["1"]
    assert metrics["pfnm.calibration-rounds"] == 0  # derived from the input moments
    assert metrics["pfnm.aligned"] == 1 and metrics["pfnm.alignment-nodes"] == 3
    assert metrics["pfnm.refit-rounds"] == 2
    (reason,) = result["left_out_alignment"].values()
    assert "partition 0 misses the first refit round" in reason
    assert "round 1: aligned to 3 node(s) in 1 alignment and 2 refit round(s)" in output

    task = example_task()
    data = task.dataset()
    nodes = [fusekit.load_checkpoint(path) for path in sorted(models_dir.iterdir())]
    inputs, parts = {}, {}  # each node's training inputs and partition, by class counts
    for part in range(3):
        indices = task.node_indices(config, {"partition-id": part, "num-partitions": 3},
                                    data)
        counts = np.bincount(data.y_train[indices], minlength=data.num_classes)
        node = next(n for n in nodes if (n.class_counts == counts).all())
        inputs[node.content_hash], parts[node.content_hash] = data.x_train[indices], part
    fused = fusekit.fuse(nodes, method="pfnm", width_ratio=1.5)
    silent = next(i for i, n in enumerate(nodes) if parts[n.content_hash] == 0)
    expected = refit_without(Checkpoint.from_state_dict(fused.state_dict, fused.metadata),
                             nodes, [inputs[n.content_hash] for n in nodes], silent)
    model = fusekit.load_checkpoint(model_file)
    for name, value in expected.state_dict().items():
        np.testing.assert_allclose(model.tensor(name), value, rtol=1e-4, atol=1e-5,
                                   err_msg=name)
    assert result["accuracy"] > min(result["node_accuracy"])


def example_task():
    """examples/flower's task module (its data and each node's part of it)."""
    spec = importlib.util.spec_from_file_location("example_task",
                                                  APP / "fusekit_digits" / "task.py")
    task = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(task)
    return task

