"""fusekit.toolkit.nn: architecture JSON, module layout, PAN encodings, checkpoint loading."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch

from fusekit.core.checkpoint import Checkpoint, save_checkpoint
from fusekit.core.errors import CheckpointError, SpecError
from fusekit.core.metadata import ARCH
from fusekit.toolkit.nn import (
    build_model,
    convnet_arch,
    hidden_widths,
    load_model,
    mlp_arch,
    pan_buffer_names,
    pan_encoding,
    parse_arch_string,
    validate_arch,
    with_hidden_widths,
)

MLP = {
    "type": "mlp",
    "in_features": 64,
    "hidden": [100],
    "out_features": 10,
    "batchnorm": False,
    "pan": None,
}
CONV = {
    "type": "convnet",
    "in_channels": 1,
    "image_size": [8, 8],
    "channels": [32, 64],
    "kernel_size": 3,
    "pool": True,
    "hidden": [],
    "out_features": 10,
    "pan": None,
}


def test_arch_module_does_not_import_torch():
    code = "import sys, fusekit.core.arch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_validate_fills_defaults_and_roundtrips_contract_examples():
    assert validate_arch(MLP) == MLP
    assert validate_arch(CONV) == CONV
    short = validate_arch({"type": "mlp", "in_features": 4, "out_features": 2})
    assert short["hidden"] == [] and short["batchnorm"] is False and short["pan"] is None


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ({**MLP, "type": "rnn"}, "arch.type"),
        ({**MLP, "hidden": [10, 0]}, "arch.hidden"),
        ({**MLP, "in_features": "64"}, "arch.in_features"),
        ({**MLP, "extra": 1}, "unknown key"),
        ({**MLP, "pan": {"mode": "cubic"}}, "arch.pan.mode"),
        ({**MLP, "pan": {"mode": "multiplicative", "amplitude": 1.5}}, "amplitude"),
        ({**CONV, "kernel_size": 4}, "kernel_size"),
        ({**CONV, "channels": [8, 8, 8, 8]}, "shrink"),
    ],
)
def test_validate_rejects_bad_arch_with_named_field(bad, fragment):
    with pytest.raises(SpecError, match=fragment):
        validate_arch(bad)


def test_hidden_widths_and_with_hidden_widths():
    assert hidden_widths(MLP) == [100]
    conv = {**CONV, "hidden": [50]}
    assert hidden_widths(conv) == [32, 64, 50]
    wider = with_hidden_widths(conv, [40, 70, 60])
    assert wider["channels"] == [40, 70] and wider["hidden"] == [60]
    assert conv["channels"] == [32, 64]  # input untouched
    with pytest.raises(SpecError, match="expected 3 hidden widths"):
        with_hidden_widths(conv, [1, 2])


def test_parse_arch_string():
    assert parse_arch_string("mlp:200,100", input_shape=(1, 8, 8), num_classes=10)["hidden"] == [
        200,
        100,
    ]
    conv = parse_arch_string("conv:16,32/64", input_shape=(1, 8, 8), num_classes=10)
    assert conv["channels"] == [16, 32] and conv["hidden"] == [64]
    with pytest.raises(SpecError, match="--arch"):
        parse_arch_string("resnet18", input_shape=(1, 8, 8), num_classes=10)
    with pytest.raises(SpecError, match="image data"):
        parse_arch_string("conv:8", input_shape=(20,), num_classes=3)


def _kinds(model) -> list[str]:
    """The module types of ``model.net``, in order."""
    return [type(m).__name__ for m in model.net]


def test_mlp_layout_and_tensor_order():
    arch = mlp_arch(64, [30, 20], 10, batchnorm=True, pan={"mode": "additive"})
    model = build_model(arch, seed=0)
    names = list(model.state_dict())
    assert names[:2] == ["net.0.weight", "net.0.bias"]
    hidden = ["Linear", "BatchNorm1d", "ReLU", "PositionEncoding"]  # per hidden layer
    assert _kinds(model) == [*hidden, *hidden, "Linear"]
    assert pan_buffer_names(model) == ["net.3.encoding", "net.7.encoding"]
    assert "net.3.encoding" not in dict(model.named_parameters())
    assert model(torch.zeros(5, 1, 8, 8)).shape == (5, 10)


def test_convnet_layout_and_forward_accepts_flat_inputs():
    model = build_model(convnet_arch((1, 8, 8), [4, 6], 10, hidden=[12]), seed=0)
    conv = ["Conv2d", "BatchNorm2d", "ReLU", "MaxPool2d"]  # per conv layer
    assert _kinds(model) == [*conv, *conv, "Flatten", "Linear", "ReLU", "Linear"]
    assert model.net[0].padding == (1, 1)
    assert model.net[9].in_features == 6 * 2 * 2
    x = torch.randn(3, 1, 8, 8)
    model.eval()
    torch.testing.assert_close(model(x), model(x.reshape(3, -1)))


def test_pan_encoding_matches_paper_formula():
    j = np.arange(8)
    add = pan_encoding(8, {"mode": "additive", "amplitude": 0.2, "period": 2})
    np.testing.assert_allclose(add, 0.2 * np.sin(2 * math.pi * 2 * j / 8), atol=1e-7)
    mul = pan_encoding(8, {"mode": "multiplicative", "amplitude": 0.1, "period": 1})
    np.testing.assert_allclose(mul, 1 + 0.1 * np.sin(2 * math.pi * j / 8), atol=1e-7)
    model = build_model({**CONV, "pan": {"mode": "multiplicative"}}, seed=0)
    assert model.state_dict()["net.3.encoding"].shape == (32, 1, 1)


def test_pans_break_permutation_invariance_plain_models_keep_it():
    def permuted_output(pan):
        model = build_model(mlp_arch(6, [16], 3, pan=pan), seed=1).eval()
        x = torch.randn(4, 6)
        before = model(x)
        perm = torch.randperm(16, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            model.net[0].weight.copy_(model.net[0].weight[perm])
            model.net[0].bias.copy_(model.net[0].bias[perm])
            last = model.net[-1]
            last.weight.copy_(last.weight[:, perm])
        return (model(x) - before).abs().max().item()

    assert permuted_output(None) < 1e-5
    assert permuted_output({"mode": "multiplicative", "amplitude": 0.5, "period": 1}) > 1e-3


def test_build_model_seed_is_deterministic_and_leaves_global_rng():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = build_model(MLP, seed=7).state_dict()
    b = build_model(MLP, seed=7).state_dict()
    assert torch.equal(torch.rand(1), expected_next)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_load_model_roundtrip(tmp_path):
    model = build_model(
        {**CONV, "pan": {"mode": "additive", "amplitude": 0.1, "period": 1}}, seed=0
    ).eval()
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, model.state_dict(), {ARCH: json.dumps(model.arch)})
    loaded = load_model(path)
    x = torch.randn(2, 1, 8, 8)
    torch.testing.assert_close(loaded(x), model(x))
    assert not loaded.training


def test_load_model_errors_name_the_problem(tmp_path):
    sd = build_model(MLP, seed=0).state_dict()
    with pytest.raises(CheckpointError, match=r"no fusekit\.arch"):
        load_model(Checkpoint.from_state_dict(sd, {}))
    wrong = {**MLP, "hidden": [50]}
    with pytest.raises(CheckpointError, match=r"net\.0\.weight.*shape"):
        load_model(Checkpoint.from_state_dict(sd, {ARCH: json.dumps(wrong)}))
    with pytest.raises(CheckpointError, match=r"invalid fusekit\.arch"):
        load_model(Checkpoint.from_state_dict(sd, {ARCH: json.dumps({"type": "x"})}))
