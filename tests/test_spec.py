import json

import numpy as np
import pytest
import torch
from torch import nn

from conftest import cnn, mlp, numpy_state
from fusekit.core.errors import SpecError
from fusekit.core.spec import infer_spec, load_spec_file, permute


def test_mlp_spec():
    spec = infer_spec(mlp(widths=(6, 9, 7, 3)).state_dict())
    assert [layer.name for layer in spec.layers] == ["0", "2", "4"]
    assert spec.hidden_widths == [9, 7]
    assert (spec.in_features, spec.out_features) == (6, 3)
    assert [(a.tensor, a.axis) for a in spec.group(1)] == [("2.weight", 0), ("2.bias", 0),
                                                            ("4.weight", 1)]


def test_batchnorm_moves_with_its_layer():
    spec = infer_spec(mlp(batchnorm=True).state_dict())
    assert spec.layers[0].norm.prefix == "1"
    assert {a.tensor for a in spec.group(0)} == {
        "0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean", "1.running_var", "3.weight"}
    assert spec.other == ()  # num_batches_tracked belongs to the BatchNorm, unpermuted


def test_cnn_spec_with_flatten_block():
    spec = infer_spec(cnn(channels=(4, 6)).state_dict())
    kinds = [(layer.kind, layer.in_features, layer.out_features) for layer in spec.layers]
    assert kinds == [("conv2d", 1, 4), ("conv2d", 4, 6), ("linear", 6, 8), ("linear", 8, 3)]
    assert spec.layers[2].input_block == 4  # 2x2 spatial positions per channel
    assert spec.layers[0].kernel_size == (3, 3)
    assert spec.group(1)[-1].block == 4


def test_natural_order_of_numbered_layers():
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(11)], nn.Linear(4, 2))
    spec = infer_spec(model.state_dict())
    assert [layer.name for layer in spec.layers] == [str(i) for i in range(12)]


def test_top_level_groups_are_reordered_to_chain():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5))
            self.classifier = nn.Linear(5 * 4, 2)  # sorts before "features"

    spec = infer_spec(Net().state_dict())
    assert [layer.name for layer in spec.layers] == ["features.0", "classifier"]
    assert spec.layers[1].input_block == 4


@pytest.mark.parametrize("make", [lambda: mlp(widths=(6, 9, 7, 3), batchnorm=True),
                                  lambda: cnn(channels=(4, 6))])
def test_permuting_hidden_neurons_keeps_the_function(make):
    model = make()
    spec = infer_spec(model.state_dict())
    x = torch.randn(5, 6) if spec.layers[0].kind == "linear" else torch.randn(5, 1, 8, 8)
    expected = model(x)
    rng = np.random.default_rng(0)
    permuted = permute(numpy_state(model), spec, [rng.permutation(w) for w in spec.hidden_widths])
    model.load_state_dict(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in permuted.items()})
    torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-6)


def test_conv1d_needs_a_spec_file():
    with pytest.raises(SpecError, match=r"0\.weight has 3 dims.*JSON spec file"):
        infer_spec(nn.Sequential(nn.Conv1d(2, 3, 3), nn.Flatten(), nn.Linear(3, 2)).state_dict())


def test_shapes_that_do_not_chain():
    sd = {"a.weight": np.zeros((5, 4)), "b.weight": np.zeros((3, 7))}
    with pytest.raises(SpecError, match=r"cannot order the layers.*a:\(5, 4\).*--spec"):
        infer_spec(sd, label="m.safetensors")


def test_wrong_bias_shape():
    sd = {"a.weight": np.zeros((5, 4)), "a.bias": np.zeros(4), "b.weight": np.zeros((3, 5))}
    with pytest.raises(SpecError, match=r"tensor 'a\.bias' has shape \(4,\); expected \(5,\)"):
        infer_spec(sd)


def test_no_layers():
    with pytest.raises(SpecError, match="found no Linear or Conv2d"):
        infer_spec({"scale": np.zeros(3)})


def test_spec_file_with_arbitrary_names(tmp_path):
    sd = {"enc_w": np.zeros((5, 4)), "enc_b": np.zeros(5), "bn.weight": np.ones(5),
          "bn.bias": np.zeros(5), "bn.running_mean": np.zeros(5), "bn.running_var": np.ones(5),
          "dec_w": np.zeros((2, 5)), "temperature": np.ones(1)}
    spec_json = {"format": "fusekit.spec/1", "layers": [
        {"name": "enc", "weight": "enc_w", "bias": "enc_b", "norm": "bn", "eps": 1e-3},
        {"name": "dec", "weight": "dec_w"}]}
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec_json))
    spec = load_spec_file(path, sd)
    assert spec.hidden_widths == [5]
    assert spec.layers[0].norm.eps == 1e-3
    assert spec.other == ("temperature",)
    assert {a.tensor for a in spec.group(0)} >= {"enc_w", "enc_b", "bn.running_var", "dec_w"}
    assert load_spec_file(path, sd).to_json()["layers"][0]["weight"] == "enc_w"


def test_spec_file_errors(tmp_path):
    with pytest.raises(SpecError, match=r"nope\.json: spec file does not exist"):
        load_spec_file(tmp_path / "nope.json", {})
    bad = tmp_path / "bad.json"
    bad.write_text('{"layers": 3}')
    with pytest.raises(SpecError, match=r"bad\.json: expected a JSON object with \"format\""):
        load_spec_file(bad, {})
    missing = tmp_path / "missing.json"
    missing.write_text(json.dumps({"format": "fusekit.spec/1", "layers": [{"weight": "w"}]}))
    with pytest.raises(SpecError, match=r"names tensor 'w', which the checkpoint does not have"):
        load_spec_file(missing, {"v": np.zeros((2, 2))})


def test_with_hidden_widths():
    spec = infer_spec(mlp(widths=(6, 9, 7, 3)).state_dict()).with_hidden_widths([12, 10])
    assert spec.hidden_widths == [12, 10]
    assert spec.layers[1].in_features == 12
    with pytest.raises(SpecError, match="expected 2 hidden widths, got 1"):
        spec.with_hidden_widths([4])


@pytest.mark.parametrize(("entry", "message"), [
    ({"weight": 3}, r"layers\[0\]\.weight: expected a tensor or module name"),
    ({"weight": "w", "bias": ["b"]}, r"layers\[0\]\.bias: expected a tensor or module name"),
    ({"weight": "w", "norm": "bn", "eps": "small"}, r"layers\[0\]\.eps: expected a number"),
    ([1, 2], r"layers\[0\]: expected an object"),
])
def test_malformed_spec_entries(tmp_path, entry, message):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"format": "fusekit.spec/1", "layers": [entry]}))
    with pytest.raises(SpecError, match=message):
        load_spec_file(path, {"w": np.zeros((2, 2))})


def test_spec_path_that_is_a_directory(tmp_path):
    with pytest.raises(SpecError, match="cannot read the spec file"):
        load_spec_file(tmp_path, {})
