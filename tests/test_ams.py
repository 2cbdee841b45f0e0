"""AMS (ALGORITHMS.md §6): packing the clients, and the selection against a numpy reference."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import fusekit
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.errors import IncompatibleModelsError, ParameterError
from fusekit.core.metadata import AMS as AMS_METADATA
from fusekit.methods.ams import read_ams_metadata, resolve_k
from fusekit.toolkit.nn.ams import AMSModel, select_logits


def reference_selection(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """AMS paper Eq. 8-9 sample by sample: rank models by max logit (ties: lower index
    first), sum the logits of the first k."""
    n_models, batch, classes = logits.shape
    fused = np.zeros((batch, classes))
    chosen = np.zeros((k, batch), dtype=np.int64)
    for b in range(batch):
        confidence = [max(logits[s, b]) for s in range(n_models)]
        ranking = sorted(range(n_models), key=lambda s: (-confidence[s], s))[:k]
        fused[b] = sum(logits[s, b].astype(np.float64) for s in ranking)
        chosen[:, b] = ranking
    return fused, chosen


def assert_same_choice(chosen: torch.Tensor, expected: np.ndarray, n_models: int) -> None:
    """Ranked choice for k < S; for k = S (every model) only the set is defined."""
    chosen = chosen.numpy()
    if len(expected) == n_models:
        chosen, expected = np.sort(chosen, axis=0), np.sort(expected, axis=0)
    np.testing.assert_array_equal(chosen, expected)


@pytest.mark.parametrize("seed", range(3))
def test_selection_matches_reference_on_random_logits(seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(5, 64, 7)).astype(np.float32)
    for k in range(1, 6):
        fused, chosen = select_logits(torch.from_numpy(logits), k)
        ref_fused, ref_chosen = reference_selection(logits, k)
        assert_same_choice(chosen, ref_chosen, 5)
        np.testing.assert_allclose(fused.numpy(), ref_fused, rtol=1e-6, atol=1e-6)


def test_selection_breaks_ties_by_lower_model_index():
    rng = np.random.default_rng(7)
    # small integers: many exact ties of the max logit between models
    logits = rng.integers(-2, 3, size=(6, 200, 3)).astype(np.float32)
    for k in range(1, 7):
        fused, chosen = select_logits(torch.from_numpy(logits), k)
        ref_fused, ref_chosen = reference_selection(logits, k)
        assert_same_choice(chosen, ref_chosen, 6)
        np.testing.assert_array_equal(fused.numpy(), ref_fused)
    all_equal = torch.ones(4, 3, 2)
    assert select_logits(all_equal, 1)[1].tolist() == [[0, 0, 0]]
    assert select_logits(all_equal, 3)[1].tolist() == [[0, 0, 0], [1, 1, 1], [2, 2, 2]]


def test_full_is_the_logit_sum_and_top1_picks_one_model():
    logits = torch.tensor([[[1.0, 5.0]], [[4.0, 0.0]], [[0.0, 6.0]]])
    assert select_logits(logits, 3)[0].tolist() == [[5.0, 11.0]]
    assert select_logits(logits, 1)[0].tolist() == [[0.0, 6.0]]
    assert select_logits(logits, 2)[0].tolist() == [[1.0, 11.0]]


def test_selection_rejects_bad_shapes_and_k():
    with pytest.raises(ParameterError, match=r"expected shape \(models, batch, classes\)"):
        select_logits(torch.zeros(3, 4), 1)
    with pytest.raises(ParameterError, match=r"1 <= k <= 3"):
        select_logits(torch.zeros(3, 4, 2), 4)


@pytest.mark.parametrize(("mode", "k", "expected"),
                         [("top1", None, 1), ("top1", 1, 1), ("full", None, 4),
                          ("full", 4, 4), ("topk", 2, 2), ("topk", 4, 4)])
def test_resolve_k(mode, k, expected):
    assert resolve_k(mode, k, 4) == expected


@pytest.mark.parametrize(("mode", "k", "message"), [
    ("best", None, r"mode: expected one of top1, topk, full, got 'best'"),
    ("topk", None, r"mode 'topk' needs k"),
    ("topk", 0, r"1 <= k <= 4"),
    ("topk", 5, r"1 <= k <= 4"),
    ("topk", 2.5, r"k: expected an integer"),
    ("top1", 2, r"k=2 contradicts mode 'top1'"),
    ("full", 3, r"k=3 contradicts mode 'full'"),
])
def test_resolve_k_rejects(mode, k, message):
    with pytest.raises(ParameterError, match=message):
        resolve_k(mode, k, 4)


# ---- real sub-models (plain torch modules; no fusekit.toolkit.nn architecture needed) ----

def mlp(depth: int, seed: int, in_features: int = 12, classes: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, 9), nn.ReLU()]
        width = 9
    return nn.Sequential(nn.Flatten(), *layers, nn.Linear(width, classes)).eval()


def cnn(seed: int, classes: int = 4) -> nn.Module:
    """Takes flat (B, 12) inputs as 3x2x2 images."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Unflatten(1, (3, 2, 2)), nn.Conv2d(3, 5, 3, padding=1), nn.BatchNorm2d(5),
        nn.ReLU(), nn.Flatten(), nn.Linear(20, classes),
    ).eval()


def _randomise_batchnorm(model: nn.Module) -> nn.Module:
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.normal_()
            module.running_var.uniform_(0.5, 2.0)
    return model


def mixed_models() -> list[nn.Module]:
    """MLPs of depth 1 to 5, two more of depth 2 (a vectorised group) and a CNN."""
    return ([mlp(depth, seed=depth) for depth in range(1, 6)] + [mlp(2, 10), mlp(2, 11)]
            + [_randomise_batchnorm(cnn(20))])


@pytest.mark.parametrize(("mode", "k"), [("top1", None), ("topk", 3), ("full", None)])
def test_ams_model_matches_reference_across_architectures(mode, k):
    models = mixed_models()
    ams = AMSModel(models, mode=mode, k=k).eval()
    x = torch.randn(50, 12)
    with torch.no_grad():
        separate = np.stack([m(x).double().numpy() for m in models])
        fused, chosen = ams.select(x)
    ref_fused, ref_chosen = reference_selection(separate, ams.k)
    assert_same_choice(chosen, ref_chosen, len(models))
    np.testing.assert_allclose(fused.numpy(), ref_fused, rtol=1e-5, atol=1e-5)
    # the paper's premise: top1 answers with exactly one sub-model's logits
    if mode == "top1":
        for b in range(0, 50, 7):
            np.testing.assert_allclose(fused[b].numpy(), separate[chosen[0, b], b], rtol=1e-5)


def test_vectorised_groups_equal_one_by_one_and_modes_switch():
    models = [mlp(3, seed) for seed in range(4)]
    ams = AMSModel(models, mode="full").eval()
    assert ams._groups == [[0, 1, 2, 3]]
    x = torch.randn(33, 12)
    with torch.no_grad():
        one_by_one = torch.stack([m(x) for m in models])
        torch.testing.assert_close(ams.all_logits(x), one_by_one)  # CPU default: one by one
        ams.vectorise = True
        torch.testing.assert_close(ams.all_logits(x), one_by_one, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ams(x), one_by_one.sum(0), rtol=1e-5, atol=1e-5)
        ams.set_mode("top1")
        ref, _ = reference_selection(one_by_one.double().numpy(), 1)
        np.testing.assert_allclose(ams(x).numpy(), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ParameterError, match="needs k"):
        ams.set_mode("topk")


# ---- fusing: the artefact ----

def _state(model: nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def _write(tmp_path, name, model, num_samples):
    return fusekit.save_checkpoint(tmp_path / name, _state(model),
                                   {"fusekit.num_samples": str(num_samples)})


def test_fuse_packs_every_client_across_architectures(tmp_path):
    models = mixed_models()
    paths = [_write(tmp_path, f"c{i}.safetensors", m, 10 + i) for i, m in enumerate(models)]
    result = fusekit.fuse(paths, method="ams", mode="topk", k=2)
    assert result.method == "ams"
    assert result.params == {"mode": "topk", "k": 2, "confidence": "logit"}
    assert result.widths == []
    description = read_ams_metadata(result.metadata, "result")
    assert [m["prefix"] for m in description["models"]] == [
        f"models.{i}." for i in range(len(models))]
    # every client appears exactly once, tensors bit-identical, in fusekit's canonical order
    hashes = json.loads(result.metadata["fusekit.inputs"])
    by_hash = {load_checkpoint(p).content_hash: load_checkpoint(p) for p in paths}
    assert sorted(hashes) == sorted(by_hash)
    for i, digest in enumerate(hashes):
        client = by_hash[digest]
        assert description["models"][i]["num_samples"] == client.num_samples
        for name in client.tensors:
            np.testing.assert_array_equal(result.state_dict[f"models.{i}.{name}"],
                                          client.tensor(name))
    n_tensors = sum(len(load_checkpoint(p).tensors) for p in paths)
    assert len(result.state_dict) == n_tensors
    # the saved artefact keeps its description
    saved = load_checkpoint(result.save(tmp_path / "ams.safetensors"))
    assert read_ams_metadata(saved.metadata, "saved") == description
    assert json.loads(saved.metadata["fusekit.params"]) == {
        "k": 2, "mode": "topk", "confidence": "logit"}


def test_fuse_is_independent_of_input_order(tmp_path):
    models = mixed_models()[:4]
    paths = [_write(tmp_path, f"c{i}.safetensors", m, 5) for i, m in enumerate(models)]
    a = fusekit.fuse(paths, method="ams")
    b = fusekit.fuse(paths[::-1], method="ams")
    assert a.metadata[AMS_METADATA] == b.metadata[AMS_METADATA]
    assert a.state_dict.keys() == b.state_dict.keys()
    for name in a.state_dict:
        np.testing.assert_array_equal(a.state_dict[name], b.state_dict[name])


def test_fuse_refuses_different_output_counts(tmp_path):
    paths = [_write(tmp_path, "four.safetensors", mlp(1, 0, classes=4), 5),
             _write(tmp_path, "three.safetensors", mlp(2, 1, classes=3), 5)]
    with pytest.raises(IncompatibleModelsError,
                       match=r"has \d outputs but .* has \d; AMS needs every model"):
        fusekit.fuse(paths, method="ams")


def test_avg_still_refuses_mixed_architectures(tmp_path):
    paths = [_write(tmp_path, "a.safetensors", mlp(1, 0), 5),
             _write(tmp_path, "b.safetensors", mlp(2, 1), 5)]
    with pytest.raises(IncompatibleModelsError):
        fusekit.fuse(paths, method="avg")


def test_fuse_rejects_bad_parameters():
    ckpts = [Checkpoint.from_state_dict(_state(mlp(1, s))) for s in range(2)]
    with pytest.raises(ParameterError, match="1 <= k <= 2"):
        fusekit.fuse(ckpts, method="ams", mode="topk", k=3)
    with pytest.raises(ParameterError, match="does not take parameter"):
        fusekit.fuse(ckpts, method="ams", anchor=0)


def test_read_ams_metadata_rejects_malformed():
    from fusekit.core.errors import CheckpointError

    with pytest.raises(CheckpointError, match="not an AMS artefact"):
        read_ams_metadata({}, "x.safetensors")
    with pytest.raises(CheckpointError, match="not JSON"):
        read_ams_metadata({AMS_METADATA: "{"}, "x.safetensors")
    with pytest.raises(CheckpointError, match="non-empty \"models\" list"):
        read_ams_metadata({AMS_METADATA: json.dumps({"format": "fusekit.ams/1"})}, "x")
    bad_k = {"format": "fusekit.ams/1", "mode": "topk", "k": 9, "models": [{}]}
    with pytest.raises(CheckpointError, match=r"1 <= k <= 1"):
        read_ams_metadata({AMS_METADATA: json.dumps(bad_k)}, "x")


def test_cli_fuse_ams(tmp_path):
    from typer.testing import CliRunner

    from fusekit._cli.app import app

    paths = [_write(tmp_path, f"c{i}.safetensors", m, 5) for i, m in enumerate(mixed_models())]
    out = tmp_path / "ams.safetensors"
    result = CliRunner().invoke(app, ["fuse", *map(str, paths), "--method", "ams", "--mode",
                                      "topk", "--k", "3", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["params"] == {"mode": "topk", "k": 3, "confidence": "logit"}
    assert read_ams_metadata(load_checkpoint(out).metadata, "out")["k"] == 3
    bad = CliRunner().invoke(app, ["fuse", *map(str, paths), "--method", "ams", "--mode",
                                   "topk", "-o", str(tmp_path / "x.safetensors")])
    assert bad.exit_code == 2 and "needs k" in bad.output


def test_probability_confidence_does_not_let_a_loud_model_win_every_input():
    """A single-class client answers every input with large logits for its class; its max
    logit beats every other model everywhere (AMS collapses to it), its max softmax
    probability only where it is more certain than the others."""
    batch, classes = 50, 4
    rng = np.random.default_rng(0)
    labels = rng.integers(0, classes, batch)
    informed = np.full((2, batch, classes), -1.0)
    informed[:, np.arange(batch), labels] = 2.0  # two good models: probability ~0.91
    loud = np.zeros((1, batch, classes))
    loud[0, :, 3] = 12.0
    loud[0, :, :3] = 9.0  # larger logits, yet a flatter softmax (max ~0.87)
    logits = torch.from_numpy(np.concatenate([informed, loud]).astype(np.float32))
    _, by_logit = select_logits(logits, 1)
    assert (by_logit == 2).all()  # the paper's rule: the loud model answers everything
    fused, by_probability = select_logits(logits, 1, "probability")
    assert (by_probability == 0).all()  # the informed models (ties: lower index) answer
    np.testing.assert_array_equal(fused.argmax(1).numpy(), labels)
    # The probability rule is max softmax, sample by sample, against numpy.
    shifted = logits.numpy() - logits.numpy().max(axis=2, keepdims=True)
    probability = np.exp(shifted) / np.exp(shifted).sum(axis=2, keepdims=True)
    for k in (1, 2):
        _, chosen = select_logits(logits, k, "probability")
        expected = np.argsort(-probability.max(axis=2), axis=0, kind="stable")[:k]
        np.testing.assert_array_equal(chosen.numpy(), expected)


def test_confidence_rule_is_stored_in_the_artefact_and_validated(tmp_path):
    paths = [_write(tmp_path, f"c{i}.safetensors", mlp(1, seed=i), 10) for i in range(2)]
    result = fusekit.fuse(paths, method="ams", confidence="probability")
    assert json.loads(result.metadata[AMS_METADATA])["confidence"] == "probability"
    loaded = fusekit.load_fused(result.save(tmp_path / "ams.safetensors"))
    assert loaded.confidence == "probability"
    assert loaded.set_mode("top1", confidence="logit").confidence == "logit"
    with pytest.raises(ParameterError, match="confidence: expected one of 'logit', 'probability'"):
        fusekit.fuse(paths, method="ams", confidence="loudest")


# ---- the class-share rule ----

def _one_class_and_informed_logits(batch=60, classes=4, seed=0):
    """Model 0 saw only class 3 (a third of its samples) and answers 3 on every input with
    near certainty; models 1 and 2 saw every class and give the truth probability ~0.87."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, classes, batch)
    informed = np.full((2, batch, classes), -1.0)
    informed[:, np.arange(batch), labels] = 2.0
    loud = np.zeros((1, batch, classes))
    loud[0, :, 3] = 12.0
    logits = torch.from_numpy(np.concatenate([loud, informed]).astype(np.float32))
    counts = np.array([[0, 0, 0, 30], [10, 10, 10, 30], [10, 10, 10, 30]], dtype=np.float64)
    return logits, counts, labels


def test_class_share_rule_follows_its_formula():
    logits, counts, _ = _one_class_and_informed_logits()
    shares = torch.tensor(counts / counts.sum(0), dtype=torch.float32)
    weighted = shares.numpy()[:, None, :] * torch.softmax(logits, 2).numpy()
    fused, chosen = select_logits(logits, 3, "class-share", shares)
    np.testing.assert_allclose(fused.numpy(), np.log(weighted.sum(0)), rtol=1e-5)
    for k in (1, 2):
        fused, chosen = select_logits(logits, k, "class-share", shares)
        expected = np.argsort(-weighted.max(axis=2), axis=0, kind="stable")[:k]
        np.testing.assert_array_equal(chosen.numpy(), expected)
        picked = np.take_along_axis(weighted, expected[:, :, None], 0).sum(0)
        # Classes the chosen model never saw get the smallest positive float, not log 0.
        np.testing.assert_allclose(np.exp(fused.numpy()), picked, rtol=1e-5, atol=1e-30)
        assert np.isfinite(fused.numpy()).all()
    with pytest.raises(ParameterError, match="expected class shares of shape"):
        select_logits(logits, 3, "class-share")


def test_a_one_class_client_no_longer_wins_every_input():
    logits, counts, labels = _one_class_and_informed_logits()
    shares = torch.tensor(counts / counts.sum(0), dtype=torch.float32)
    for rule in ("logit", "probability"):  # the loud one-class model answers everything
        assert (select_logits(logits, 1, rule)[1] == 0).all()
    fused, _ = select_logits(logits, 3, "class-share", shares)
    np.testing.assert_array_equal(fused.argmax(1).numpy(), labels)


def _write_counts(tmp_path, name, model, counts):
    return fusekit.save_checkpoint(tmp_path / name, _state(model),
                                   {"fusekit.num_samples": str(sum(counts)),
                                    "fusekit.class_counts": json.dumps(counts)})


def test_class_share_is_the_default_with_class_counts_and_survives_loading(tmp_path):
    counts = [[0, 0, 0, 30], [5, 5, 5, 5], [10, 0, 10, 0]]
    paths = [_write_counts(tmp_path, f"c{i}.safetensors", mlp(1, i), c)
             for i, c in enumerate(counts)]
    result = fusekit.fuse(paths, method="ams")
    assert result.params == {"mode": "full", "k": 3, "confidence": "class-share"}
    saved = result.save(tmp_path / "ams.safetensors")
    description = read_ams_metadata(load_checkpoint(saved).metadata, "saved")
    assert sorted(m["class_counts"] for m in description["models"]) == sorted(counts)
    loaded = fusekit.load_fused(saved, "cpu")
    x = torch.randn(16, 12)
    with torch.no_grad():
        logits = loaded.all_logits(x)
        own = np.array([m["class_counts"] for m in description["models"]], dtype=np.float64)
        weighted = (own / own.sum(0))[:, None, :] * torch.softmax(logits, 2).numpy()
        np.testing.assert_allclose(loaded(x).numpy(), np.log(weighted.sum(0)), rtol=1e-5)
    # The paper's rules stay available by name, and the mode by its own default.
    paper = fusekit.fuse(paths, method="ams", confidence="logit")
    assert paper.params == {"mode": "top1", "k": 1, "confidence": "logit"}
    assert loaded.set_mode("top1", confidence="logit").confidence == "logit"


def test_class_share_needs_every_clients_class_counts(tmp_path):
    paths = [_write_counts(tmp_path, "a.safetensors", mlp(1, 0), [1, 2, 3, 4]),
             _write(tmp_path, "b.safetensors", mlp(1, 1), 10)]
    assert fusekit.fuse(paths, method="ams").params["confidence"] == "logit"
    with pytest.raises(ParameterError, match="needs fusekit.class_counts"):
        fusekit.fuse(paths, method="ams", confidence="class-share")
    loaded = fusekit.load_fused(fusekit.fuse(paths, method="ams").save(
        tmp_path / "ams.safetensors"), "cpu")
    with pytest.raises(ParameterError, match="needs every model's class counts"):
        loaded.set_mode("full", confidence="class-share")
