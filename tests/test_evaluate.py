"""fusekit.toolkit.evaluate and `fusekit evaluate`: agreement with a direct torch computation."""

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from fusekit._cli.app import app
from fusekit.core.checkpoint import save_checkpoint
from fusekit.core.errors import CheckpointError, DataError
from fusekit.core.metadata import ARCH, CLASS_COUNTS, METHOD, NUM_SAMPLES
from fusekit.toolkit.data import synthetic
from fusekit.toolkit.evaluate import Evaluator, evaluate_checkpoints, softmax_average
from fusekit.toolkit.nn import build_model, convnet_arch, mlp_arch

DATA = synthetic(samples=300, features=5, classes=3, seed=1)


def _write(path, arch, seed, method=None):
    model = build_model(arch, seed=seed).eval()
    meta = {ARCH: json.dumps(arch), NUM_SAMPLES: "10", CLASS_COUNTS: "[3, 3, 4]"}
    if method:
        meta[METHOD] = method
    save_checkpoint(path, model.state_dict(), meta)
    return path, model


def test_scores_match_direct_torch_computation(tmp_path):
    p1, m1 = _write(tmp_path / "a.safetensors", mlp_arch(5, [7], 3), 0)
    p2, m2 = _write(tmp_path / "b.safetensors", mlp_arch(5, [4, 6], 3), 1)  # mixed archs
    p3, _ = _write(tmp_path / "f.safetensors", mlp_arch(5, [7], 3), 2, method="avg")
    report = evaluate_checkpoints([p1, p2, p3], DATA, device="cpu", batch_size=17)
    x, y = torch.as_tensor(DATA.x_test), torch.as_tensor(DATA.y_test)
    with torch.no_grad():
        l1, l2 = m1(x), m2(x)
        for score, logits in [
            (report.scores[0], l1),
            (report.scores[1], l2),
            (report.scores[3], (l1 + l2) / 2),
        ]:
            assert score.accuracy == pytest.approx((logits.argmax(1) == y).double().mean().item())
            assert score.loss == pytest.approx(
                torch.nn.functional.cross_entropy(logits, y).item(), rel=1e-5
            )
    assert [s.kind for s in report.scores] == ["client", "client", "fused", "ensemble", "ensemble"]
    assert [s.name for s in report.scores[3:]] == ["ensemble", "ensemble-softmax"]
    # The softmax ensemble: argmax and cross-entropy of the mean class probabilities.
    mean_probability = (l1.softmax(1) + l2.softmax(1)) / 2
    softmax = report.scores[4]
    expected = (mean_probability.argmax(1) == y).double().mean().item()
    assert softmax.accuracy == pytest.approx(expected)
    assert softmax.loss == pytest.approx(
        torch.nn.functional.nll_loss(mean_probability.log(), y).item(), rel=1e-5)
    assert report.scores[2].method == "avg"
    assert report.mean_client_accuracy == pytest.approx(
        (report.scores[0].accuracy + report.scores[1].accuracy) / 2
    )


def test_wrong_number_of_classes(tmp_path):
    path, _ = _write(tmp_path / "a.safetensors", mlp_arch(5, [7], 4), 0)
    with pytest.raises(DataError, match="3 classes"):
        evaluate_checkpoints([path], DATA, device="cpu")


def test_checkpoints_without_arch(tmp_path):
    # An MLP without fusekit.arch is rebuilt from its tensors (fusekit.load_fused); a
    # ConvNet cannot be (padding and pooling are not in the tensors).
    mlp = build_model(mlp_arch(5, [2], 3), seed=0).eval()
    bare = save_checkpoint(tmp_path / "bare.safetensors", mlp.state_dict())
    score = evaluate_checkpoints([bare], DATA, device="cpu").scores[0]
    with torch.no_grad():
        logits = mlp(torch.as_tensor(DATA.x_test))
    y = torch.as_tensor(DATA.y_test)
    assert score.accuracy == pytest.approx((logits.argmax(1) == y).double().mean().item())
    conv = build_model(convnet_arch((1, 2, 2), [3], 3), seed=0).state_dict()
    bare_conv = save_checkpoint(tmp_path / "conv.safetensors", conv)
    with pytest.raises(CheckpointError, match=r"fusekit\.arch"):
        evaluate_checkpoints([bare_conv], DATA, device="cpu")


def test_evaluator_moves_test_set_once():
    evaluator = Evaluator(DATA, "cpu")
    assert evaluator.inputs.device.type == "cpu" and len(evaluator.targets) == len(DATA.y_test)


def test_cli_evaluate_json_and_table(tmp_path, small_synthetic_args):
    p1, _ = _write(tmp_path / "a.safetensors", mlp_arch(5, [7], 3), 0)
    p2, _ = _write(tmp_path / "b.safetensors", mlp_arch(5, [7], 3), 1)
    common = [
        "evaluate",
        str(p1),
        str(p2),
        *small_synthetic_args,
        "--seed",
        "1",
        "--device",
        "cpu",
    ]
    result = CliRunner().invoke(app, [*common, "--json"])
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [s["kind"] for s in payload["scores"]] == ["client", "client", "ensemble", "ensemble"]
    table = CliRunner().invoke(app, common)
    assert table.exit_code == 0 and "ensemble" in table.stdout
    data = tmp_path / "d.npz"  # --data-path alone means npz, as for `fusekit stats`
    np.savez(data, x_train=DATA.x_train, y_train=DATA.y_train, x_test=DATA.x_test,
             y_test=DATA.y_test)
    npz = CliRunner().invoke(app, ["evaluate", str(p1), str(p2), "--data-path", str(data),
                                   "--json"])
    assert npz.exit_code == 0, npz.output
    assert json.loads(npz.stdout)["scores"] == payload["scores"]
    missing = CliRunner().invoke(app, ["evaluate", str(tmp_path / "nope.safetensors")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_evaluation_matches_cpu(tmp_path):
    p1, _ = _write(tmp_path / "a.safetensors", mlp_arch(5, [7], 3), 0)
    p2, _ = _write(tmp_path / "b.safetensors", mlp_arch(5, [7], 3), 1)
    cpu = evaluate_checkpoints([p1, p2], DATA, device="cpu")
    gpu = evaluate_checkpoints([p1, p2], DATA, device="cuda")
    assert gpu.device.startswith("cuda")
    for a, b in zip(cpu.scores, gpu.scores, strict=True):
        assert a.accuracy == pytest.approx(b.accuracy, abs=1 / len(DATA.y_test))
        assert a.loss == pytest.approx(b.loss, rel=1e-4)


def test_softmax_ensemble_is_not_outvoted_by_one_model_with_large_logits():
    """Two models agree on class 0 with ordinary logits; a third, single-class-like model
    shouts class 2 with logits ten times larger: the logit average follows the loud model,
    the probability average the majority."""
    quiet = torch.tensor([[2.0, 0.0, 0.0]])
    loud = torch.tensor([[0.0, 0.0, 8.0]])
    logits = [quiet, quiet, loud]
    assert torch.stack(logits).mean(0).argmax(1).item() == 2
    assert softmax_average(logits).argmax(1).item() == 0
    np.testing.assert_allclose(softmax_average(logits).exp().sum(1).numpy(), 1.0, rtol=1e-6)


def test_rows_of_same_named_files_show_enough_path_to_tell_them_apart(tmp_path):
    from pathlib import Path

    from fusekit.toolkit.evaluate import distinct_names

    for folder, method in (("pfnm", "pfnm"), ("runs/x/nafi", "nafi")):
        (tmp_path / folder).mkdir(parents=True)
        _write(tmp_path / folder / "fused.safetensors", mlp_arch(5, [7], 3), 0, method)
    client, _ = _write(tmp_path / "client.safetensors", mlp_arch(5, [7], 3), 1)
    files = [client, *(tmp_path / f / "fused.safetensors" for f in ("pfnm", "runs/x/nafi"))]
    result = CliRunner().invoke(app, ["evaluate", *map(str, files), "--data", "synthetic",
                                      "--samples", "300", "--features", "5", "--classes", "3",
                                      "--device", "cpu", "--json"])
    assert result.exit_code == 0, result.output
    names = [s["name"] for s in json.loads(result.stdout)["scores"]]
    assert names == ["client.safetensors", "pfnm/fused.safetensors", "nafi/fused.safetensors"]
    assert distinct_names([Path("a/b/c"), Path("x/b/c"), Path("c/d"), None, Path("b/c")]) == [
        "a/b/c", "x/b/c", "d", "model 3", "b/c"]
    assert distinct_names([Path("s/f"), Path("s/f")]) == ["s/f", "s/f"]  # one file twice
