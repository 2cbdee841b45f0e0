"""Per-class client weights of the output layer and the clients' heterogeneity report
(ALGORITHMS.md §3): a client that saw one class gets no say on that class."""

import numpy as np
import pytest
import torch
from conftest import mlp, write
from typer.testing import CliRunner

import fusekit
from fusekit._cli import output
from fusekit._cli.app import app
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.methods.avg import class_shares, information_shares


def clients_with_counts(counts, tmp_path, biases=None):
    """6-5-3 MLP clients whose output bias is ``biases[s]`` (to see whose bias survives)."""
    tmp_path.mkdir(exist_ok=True)
    paths = []
    for s, c in enumerate(counts):
        model = mlp(seed=s)
        if biases is not None:
            model[-1].bias.data[:] = torch.tensor(biases[s])
        paths.append(write(tmp_path / f"c{s}.safetensors", model, num_samples=sum(c),
                           class_counts=str(c)))
    return paths


def loaded(paths):
    return [load_checkpoint(p) for p in paths]


def test_information_shares_follow_the_formula(tmp_path):
    counts = np.array([[30, 10, 0], [5, 5, 10], [0, 0, 40]], dtype=float)
    ckpts = loaded(clients_with_counts(counts.astype(int).tolist(), tmp_path))
    information = counts * (1 - counts / counts.sum(1, keepdims=True))
    expected = information / information.sum(0)
    # Class 2: the one-class client 2 (40 samples) has no information on it, client 1 all.
    np.testing.assert_allclose(information_shares(ckpts, 3), expected)
    assert information_shares(ckpts, 3)[2, 2] == 0.0
    assert class_shares(ckpts, 3)[2, 2] == pytest.approx(0.8)  # the paper's shares


def test_a_class_only_one_class_clients_hold_gets_the_sample_shares(tmp_path):
    ckpts = loaded(clients_with_counts([[20, 0, 0], [0, 10, 10], [0, 0, 10]], tmp_path))
    shares = information_shares(ckpts, 3)
    np.testing.assert_allclose(shares[:, 0], [0.4, 0.4, 0.2])  # N_s / N
    np.testing.assert_allclose(shares.sum(0), 1.0)


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_a_one_class_client_does_not_set_its_class_in_the_output_layer(method, tmp_path):
    # Client 0 saw only class 0 and learnt a large class-0 bias; client 1 saw every class.
    paths = clients_with_counts([[90, 0, 0], [10, 10, 10]], tmp_path,
                                biases=[[9.0, -9.0, -9.0], [0.5, 0.0, -0.5]])
    bias_name = "2.bias"
    informed = fusekit.fuse(paths, method=method, sweeps=1)
    paper = fusekit.fuse(paths, method=method, sweeps=1, class_weights="counts")
    np.testing.assert_allclose(informed.state_dict[bias_name], [0.5, 0.0, -0.5], atol=1e-6)
    assert paper.state_dict[bias_name][0] == pytest.approx(0.9 * 9.0 + 0.1 * 0.5, rel=1e-5)
    assert informed.params["class_weights"] == "information"


def test_report_flags_clients_too_different_for_a_compact_model(tmp_path):
    one_class = clients_with_counts([[30, 0, 0], [0, 30, 0], [0, 0, 30]], tmp_path / "a")
    differ = fusekit.fuse(one_class, method="pfnm", sweeps=1).report["heterogeneity"]
    assert differ["class_contrast"] == 0.0
    assert differ["classes_without_contrast"] == [0, 1, 2]
    assert differ["compact_ok"] is False
    assert 0.0 <= differ["matched_share"] <= 1.0
    balanced = clients_with_counts([[10, 10, 10], [20, 20, 20]], tmp_path / "b")
    differ = fusekit.fuse(balanced, method="nafi", sweeps=1).report["heterogeneity"]
    assert differ["class_contrast"] == pytest.approx(1.0)
    assert differ["classes_without_contrast"] == [] and differ["compact_ok"] is True


def test_report_without_class_counts_has_no_contrast():
    rng = np.random.default_rng(0)
    ckpts = [Checkpoint.from_state_dict({"0.weight": rng.normal(size=(5, 4)),
                                         "0.bias": rng.normal(size=5),
                                         "2.weight": rng.normal(size=(3, 5)),
                                         "2.bias": rng.normal(size=3)}) for _ in range(2)]
    differ = fusekit.fuse(ckpts, method="pfnm", sweeps=1).report["heterogeneity"]
    assert differ["class_contrast"] is None and differ["compact_ok"] is True


def test_cli_summary_says_the_clients_are_too_different(tmp_path, monkeypatch):
    paths = clients_with_counts([[30, 0, 0], [0, 30, 0], [0, 2, 30]], tmp_path)
    # The console's width, not COLUMNS: a console made while COLUMNS was set keeps that width.
    monkeypatch.setattr(output.stdout, "width", 300)
    result = CliRunner().invoke(app, ["fuse", *map(str, paths), "--method", "pfnm",
                                      "-o", str(tmp_path / "fused.safetensors")])
    assert result.exit_code == 0, result.output
    assert "class contrast 0.06" in result.stdout  # 3.75 / (92 x 2/3)
    assert "classes held only by one-class clients [0]" in result.stdout
    assert "too different for a compact fused model" in result.stdout
