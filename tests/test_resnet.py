"""Residual networks and torchvision's families: groups, function preservation, every
method, architectures that travel with the file.

Tolerances: fused logits equal the original network's to 1e-4 absolute (float32 weights,
BatchNorm folded in float64 and written back in float32; the logits are O(1)).
"""

import json
import math
import os

import numpy as np
import pytest
import torch
from threadpoolctl import threadpool_limits
from torch import nn

import fusekit
from conftest import numpy_state, write
from fusekit.core import neurons
from fusekit.core.arch import hidden_widths, infer_arch, named_arch, with_hidden_widths
from fusekit.core.checkpoint import Checkpoint, load_checkpoint
from fusekit.core.errors import IncompatibleModelsError, SpecError
from fusekit.core.spec import GraphSpec, infer_spec, permute, spec_from_json
from fusekit.engine.matching import solve_assignment, sqeuclidean_cost
from fusekit.methods import METHODS
from fusekit.methods.base import FusionMethod
from fusekit.methods.ot import group_aligner, group_order
from fusekit.toolkit.nn import build_model
from fusekit.toolkit.nn.zoo import resnet18, resnet20, resnet50, vgg

ATOL = 1e-4


@pytest.fixture(autouse=True)
def _one_thread():
    """Small convolutions and products on a busy 2-core machine run several times faster
    on one torch and one BLAS thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    with threadpool_limits(1):
        yield
    torch.set_num_threads(previous)


def _random_statistics(model: nn.Module, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                width = module.num_features
                module.weight.copy_(torch.rand(width, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(width, generator=generator) * 0.3)
                module.running_mean.copy_(torch.randn(width, generator=generator) * 0.3)
                module.running_var.copy_(torch.rand(width, generator=generator) * 1.5 + 0.5)
    return model.eval()


def _scaled(name: str, divisor: int) -> list[int]:
    return [max(w // divisor, 2) for w in hidden_widths(named_arch(name, 10))]


def small_resnet50() -> nn.Module:
    """resnet50's layout (names, groups, Bottlenecks) at 1/16 of its widths: fast."""
    return resnet50(10, widths=_scaled("resnet50", 16))


def small_vgg11_bn() -> nn.Module:
    """vgg11_bn's layout at 1/16 of its conv widths and a 64-wide classifier."""
    return vgg("vgg11_bn", 10, widths=[*_scaled("vgg11_bn", 16)[:8], 64, 64])


def small_resnet18() -> nn.Module:
    """resnet18's layout at a quarter of its widths."""
    return resnet18(10, widths=_scaled("resnet18", 4))


MODELS = {
    "resnet18": small_resnet18,
    "resnet50": small_resnet50,
    "vgg11_bn": small_vgg11_bn,
    "resnet20": lambda: resnet20(10),
}


def _model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return _random_statistics(MODELS[name](), seed)


def _logits(model: nn.Module, state: dict, x: torch.Tensor) -> torch.Tensor:
    model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in state.items()},
                          strict=True)
    with torch.no_grad():
        return model(x)


def _inputs() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _random_perms(spec, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.permutation(width) for width in spec.hidden_widths]


# --- the groups -------------------------------------------------------------------------

def test_torchvision_parameter_counts():
    # torchvision's documented sizes (1000 classes): resnet18 11,689,512; resnet50 25,557,032;
    # vgg11_bn 132,868,840; He et al.'s ResNet-20 has 0.27M.
    def count(model):
        return sum(p.numel() for p in model.parameters())

    assert count(resnet18()) == 11_689_512
    assert count(resnet50()) == 25_557_032
    assert count(vgg("vgg11_bn")) == 132_868_840
    assert count(resnet20()) == 272_474


def test_resnet18_groups_follow_the_residual_streams():
    spec = infer_spec(resnet18(10).state_dict())
    assert isinstance(spec, GraphSpec)
    assert spec.group_names == (
        "conv1", "layer1.0.conv1", "layer1.1.conv1", "layer2.0.conv1", "layer2.0",
        "layer2.1.conv1", "layer3.0.conv1", "layer3.0", "layer3.1.conv1", "layer4.0.conv1",
        "layer4.0", "layer4.1.conv1")
    stream = {a.tensor for a in spec.group(spec.group_names.index("conv1"))}
    assert {"conv1.weight", "bn1.running_var", "layer1.0.conv2.weight", "layer1.1.bn2.bias",
            "layer2.0.downsample.0.weight"} <= stream
    layer2 = [(a.tensor, a.axis) for a in spec.group(spec.group_names.index("layer2.0"))]
    assert ("layer2.0.downsample.0.weight", 0) in layer2
    assert ("layer2.0.downsample.1.weight", 0) in layer2
    assert ("layer2.1.conv2.weight", 0) in layer2
    assert ("layer2.1.conv1.weight", 1) in layer2
    assert ("layer3.0.downsample.0.weight", 1) in layer2
    last = spec.group(spec.group_names.index("layer4.0"))
    assert ("fc.weight", 1) in [(a.tensor, a.axis) for a in last]


FAMILIES = ["resnet18", "resnet34", "resnet50", "resnet20", "resnet56", "vgg11", "vgg11_bn",
            "vgg16", "vgg16_bn"]


def _shapes(arch) -> dict[str, tuple[int, ...]]:
    """A module's tensor shapes without allocating its weights (meta device)."""
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_model(arch).state_dict().items()}


@pytest.mark.parametrize("name", FAMILIES)
def test_every_tensor_axis_is_in_exactly_the_right_groups(name):
    arch = named_arch(name, 10)
    shapes = _shapes(arch)
    spec = infer_spec(shapes)
    assert isinstance(spec, GraphSpec) == name.startswith("resnet")
    assert spec.other == ()
    assert spec.hidden_widths == hidden_widths(arch)
    moved: dict[tuple[str, int], int] = {}
    for g, width in enumerate(spec.hidden_widths):
        members = spec.group(g)
        assert members, f"group {g} is empty"
        for ref in members:
            assert shapes[ref.tensor][ref.axis] == width * ref.block
            moved[ref.tensor, ref.axis] = moved.get((ref.tensor, ref.axis), 0) + 1
    assert max(moved.values()) == 1  # no axis moves with two groups
    first, last = spec.layers[0], spec.layers[-1]
    assert last.out_features == 10
    for tensor, shape in shapes.items():
        if tensor.endswith("num_batches_tracked"):
            continue
        expected = set() if tensor in last.tensors else {0}
        if len(shape) > 1 and tensor != first.weight:
            expected.add(1)  # every weight reads a group, except the first's from the image
        assert {axis for (t, axis) in moved if t == tensor} == expected, tensor


@pytest.mark.parametrize("name", ["resnet50", "vgg16_bn"])
def test_inspect_prints_the_groups(tmp_path, name):
    from typer.testing import CliRunner

    from fusekit._cli.app import app

    arch = named_arch(name, 10)
    small = with_hidden_widths(arch, [max(w // 32, 2) for w in hidden_widths(arch)])
    path = write(tmp_path / "m.safetensors", build_model(small))
    spec = infer_spec(_shapes(small))
    text = CliRunner().invoke(app, ["inspect", str(path)])
    assert text.exit_code == 0, text.output
    for group in spec.group_names:
        assert f"permutation group {group}: " in text.output
    report = json.loads(CliRunner().invoke(app, ["inspect", str(path), "--json"]).stdout)
    groups = dict(zip(report["files"][0]["group_names"], report["files"][0]["permutation_groups"],
                      strict=True))
    if name == "resnet50":
        assert {"layer2.0.downsample.0.weight[axis 0]", "layer2.3.conv3.weight[axis 0]",
                "layer3.0.conv1.weight[axis 1]", "layer3.0.downsample.0.weight[axis 1]"} <= set(
                    groups["layer2.0"])
    listed = " ".join(" ".join(members) for members in groups.values())
    for tensor in _shapes(small):
        if not tensor.endswith("num_batches_tracked") and tensor != spec.layers[-1].bias:
            assert f"{tensor}[axis" in listed, tensor  # the classifier's bias is never moved


def test_each_group_alone_keeps_the_function():
    """A member missing from a group would change the function when only it is permuted."""
    model = _model("resnet20")
    state = numpy_state(model)
    spec = infer_spec(state)
    x = _inputs()
    expected = _logits(model, state, x)
    for g, width in enumerate(spec.hidden_widths):
        perms = [None] * len(spec.hidden_widths)
        perms[g] = np.random.default_rng(g).permutation(width)
        got = _logits(model, permute(state, spec, perms), x)
        torch.testing.assert_close(got, expected, rtol=0, atol=ATOL,
                                   msg=f"group {spec.group_names[g]}")


def test_a_group_missing_a_member_is_caught():
    model = _model("resnet20")
    state = numpy_state(model)
    spec = infer_spec(state)
    shortcut = next(i for i, layer in enumerate(spec.layers) if "downsample" in layer.name)
    broken = GraphSpec(spec.layers, spec.reads,
                       tuple(None if i == shortcut else w for i, w in enumerate(spec.writes)),
                       spec.group_names)
    group = spec.writes[shortcut]
    perms = [None] * len(spec.hidden_widths)
    perms[group] = np.random.default_rng(0).permutation(spec.hidden_widths[group])
    x = _inputs()
    got = _logits(model, permute(state, broken, perms), x)
    assert not torch.allclose(got, _logits(model, state, x), atol=ATOL)


@pytest.mark.parametrize("name", list(MODELS))
def test_permuting_every_group_keeps_the_function(name):
    model = _model(name)
    state = numpy_state(model)
    spec = infer_spec(state)
    x = _inputs()
    expected = _logits(model, state, x)
    permuted = permute(state, spec, _random_perms(spec, 3))
    assert not np.allclose(permuted["features.0.weight" if name.startswith("vgg")
                                    else "conv1.weight"], state[next(iter(state))])
    torch.testing.assert_close(_logits(model, permuted, x), expected, rtol=0, atol=ATOL)


# --- every method -----------------------------------------------------------------------

#: PFNM/NAFI at the clients' width with a tiny client noise: permuted copies match exactly and
#: the posterior means equal the copies' weights up to sigma^2 / sigma0^2 = 1e-6.
COPY_PARAMS = {"width_ratio": 1.0, "sigma": 1e-6, "sigma0": 1.0, "gamma": 1.0}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("method", ["ot", "rebasin", "ams", "avg", "pfnm", "nafi"])
def test_fusing_permuted_copies_gives_back_the_function(tmp_path, name, method):
    model = _model(name)
    state = numpy_state(model)
    spec = infer_spec(state)
    x = _inputs()
    expected = _logits(model, state, x)
    clients = []
    for s in range(3):
        # avg cannot undo permutations: it gets the copies as they are
        copy = state if method == "avg" else permute(state, spec, _random_perms(spec, 10 + s))
        clients.append(write(tmp_path / f"c{s}.safetensors", copy, num_samples=10 + s))
    result = fusekit.fuse(clients, method,
                          **(COPY_PARAMS if method in ("pfnm", "nafi") else {}))
    if os.access("/proc/self/clear_refs", os.W_OK):  # where the kernel lets the peak reset
        assert result.report["peak_memory_mb"] > 0
    path = result.save(tmp_path / "fused.safetensors")
    fused = fusekit.load_fused(path, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(fused(x), expected, rtol=0, atol=ATOL)
    if method != "ams":
        loaded = load_checkpoint(path)
        assert loaded.arch == infer_arch({k: v.shape for k, v in state.items()})
        fresh = MODELS[name]()
        fresh.load_state_dict({k: torch.from_numpy(np.array(v))
                               for k, v in loaded.state_dict().items()}, strict=True)
        with torch.no_grad():
            torch.testing.assert_close(fresh.eval()(x), expected, rtol=0, atol=ATOL)


def test_full_resnet18_fused_file_loads_into_resnet18_strictly(tmp_path):
    torch.manual_seed(0)
    model = _random_statistics(resnet18(10))
    state = numpy_state(model)
    spec = infer_spec(state)
    clients = [write(tmp_path / f"c{s}.safetensors", permute(state, spec, _random_perms(spec, s)))
               for s in range(2)]
    path = fusekit.fuse(clients, "ot").save(tmp_path / "fused.safetensors")
    fresh = resnet18(num_classes=10)
    fresh.load_state_dict({k: torch.from_numpy(np.array(v))
                           for k, v in load_checkpoint(path).state_dict().items()}, strict=True)
    x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x), model(x), rtol=0, atol=ATOL)


class _SequentialOnly(FusionMethod):
    name = "sequential-only-for-test"
    summary = "a method that fuses sequential networks only"

    def fuse(self, checkpoints, specs):
        raise AssertionError("never called on a residual network")


def test_methods_without_groups_refuse_residual_networks(tmp_path, monkeypatch):
    monkeypatch.setitem(METHODS, _SequentialOnly.name, _SequentialOnly)
    state = numpy_state(_model("resnet20"))
    clients = [write(tmp_path / f"c{s}.safetensors", state) for s in range(2)]
    with pytest.raises(IncompatibleModelsError, match=r"residual network.*pfnm.*rebasin"):
        fusekit.fuse(clients, _SequentialOnly.name)


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_pfnm_grows_every_member_of_a_group_to_the_width_asked(tmp_path, method):
    """Width target per group (ratio and explicit widths); every member of a group takes
    the group's width, and the file rebuilds strictly at the fused widths."""
    torch.manual_seed(0)
    widths = _scaled("resnet20", 2)
    clients = [write(tmp_path / f"c{s}.safetensors",
                     _random_statistics(resnet20(10, widths=widths), s)) for s in range(2)]
    ratio = fusekit.fuse(clients, method, width_ratio=1.5, sweeps=1)
    assert ratio.widths == [math.floor(1.5 * w + 0.5) for w in widths]
    asked = [w + 1 + i % 3 for i, w in enumerate(widths)]
    result = fusekit.fuse(clients, method, width=asked, sweeps=1)
    assert result.widths == asked
    assert [r["width"] for r in result.report["layers"]] == [
        asked[i] for i in sorted(range(len(widths)),
                                 key=infer_spec(numpy_state(resnet20(10))).writes.index)]
    path = result.save(tmp_path / "fused.safetensors")
    rebuilt = resnet20(10, widths=asked)  # strict: every member grew with its group
    rebuilt.load_state_dict({k: torch.from_numpy(np.array(v))
                             for k, v in load_checkpoint(path).state_dict().items()}, strict=True)
    fused = fusekit.load_fused(path, device="cpu")
    with torch.no_grad():
        torch.testing.assert_close(fused(_inputs()), rebuilt.eval()(_inputs()))
        assert torch.isfinite(fused(_inputs())).all()


@pytest.mark.parametrize("name", ["resnet50", "vgg11_bn", "resnet20"])
@pytest.mark.parametrize("method", ["pfnm", "ams"])
def test_output_folder_card_loads_residual_and_vgg_models_without_fusekit(
        tmp_path, name, method, monkeypatch):
    from typer.testing import CliRunner

    from fusekit._cli.app import app

    state = numpy_state(_model(name))
    clients = [str(write(tmp_path / f"c{s}.safetensors", state, num_samples=10 + s))
               for s in range(2)]
    folder = tmp_path / "out"
    fixed = ["--sigma", "1", "--sigma0", "1", "--gamma", "1", "--sweeps", "0"]  # no EM: fast
    result = CliRunner().invoke(app, ["fuse", *clients, "-m", method, "-o", f"{folder}/",
                                      *(fixed if method == "pfnm" else [])])
    assert result.exit_code == 0, result.output
    snippet = (folder / "README.md").read_text().split("```python\n")[1].split("```")[0]
    assert "fusekit" not in snippet
    monkeypatch.chdir(folder)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)  # runs the card's example call too
    x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(namespace["predict"](x),
                                   fusekit.load_fused(folder / "fused.safetensors", "cpu")(x))


def test_rebasin_backends_agree_and_sequential_networks_work(tmp_path):
    from conftest import mlp

    state = numpy_state(mlp(widths=(6, 9, 7, 3), batchnorm=True))
    spec = infer_spec(state)
    clients = [Checkpoint.from_state_dict(permute(state, spec, _random_perms(spec, s)))
               for s in range(3)]
    core = fusekit.fuse(clients, "rebasin")
    numpy = fusekit.fuse(clients, "rebasin", backend="numpy")
    for name in core.state_dict:
        np.testing.assert_array_equal(core.state_dict[name], numpy.state_dict[name])
    model = mlp(widths=(6, 9, 7, 3), batchnorm=True)
    x = torch.randn(4, 6)
    torch.testing.assert_close(_logits(model, core.state_dict, x), _logits(model, state, x),
                               rtol=0, atol=ATOL)


def test_rebasin_refuses_unequal_widths():
    a = Checkpoint.from_state_dict(numpy_state(resnet20(10)))
    b = Checkpoint.from_state_dict(numpy_state(resnet20(10, widths=_scaled("resnet20", 2))))
    with pytest.raises(IncompatibleModelsError, match="needs equal widths"):
        fusekit.fuse([a, b], "rebasin")


def test_ot_fuses_residual_networks_of_different_widths():
    torch.manual_seed(0)
    wide = _random_statistics(resnet20(10))
    narrow = _random_statistics(resnet20(10, widths=[w - 2 for w in _scaled("resnet20", 1)]))
    clients = [Checkpoint.from_state_dict(numpy_state(m), {"fusekit.num_samples": n})
               for m, n in ((wide, "20"), (narrow, "10"))]
    result = fusekit.fuse(clients, "ot")
    assert result.widths == hidden_widths(named_arch("resnet20", 10))
    assert "emd" in result.report["alignment"][0]["transport"]
    fused = fusekit.load_fused(Checkpoint.from_state_dict(result.state_dict, result.metadata),
                               device="cpu")
    assert torch.isfinite(fused(_inputs())).all()


@pytest.mark.parametrize("name", ["resnet18", "resnet50"])
def test_ot_assigns_groups_as_float64_squared_distances_do(name):
    """ot compares a group's rows by one float32 inner product against the anchor's rows,
    stacked once: on clients from independent initialisations every unit goes where the
    float64 squared-distance cost sends it, and the report's costs are those distances."""
    torch.manual_seed(0)
    anchor, client = (Checkpoint.from_state_dict(numpy_state(_random_statistics(
        MODELS[name](), seed=s))) for s in range(2))
    spec = infer_spec({k: anchor.tensor(k) for k in anchor.tensors})
    anchor_layers = neurons.client_layers(anchor, spec)
    _, report = group_aligner(anchor_layers, spec)(neurons.client_layers(client, spec), spec)
    layers = neurons.client_layers(client, spec)
    for group, ready in group_order(spec):
        cost = sqeuclidean_cost(neurons.writer_rows(layers, spec, group, ready),
                                neurons.writer_rows(anchor_layers, spec, group, ready))
        rows, cols = solve_assignment(cost)
        np.testing.assert_array_equal(report["assignment"][group], cols, err_msg=str(group))
        assert report["mean_cost"][group_order(spec).index((group, ready))] == pytest.approx(
            cost[rows, cols].mean(), rel=1e-5)
        mapping = np.empty_like(rows)
        mapping[cols] = rows
        layers = neurons.move_group(layers, spec, group, mapping)


def test_pfnm_fuses_residual_networks_of_different_widths():
    torch.manual_seed(0)
    widths = _scaled("resnet20", 2)
    narrow = [w - 1 - i % 2 for i, w in enumerate(widths)]
    clients = [Checkpoint.from_state_dict(numpy_state(_random_statistics(
        resnet20(10, widths=w), s)), {"fusekit.num_samples": "10"})
        for s, w in enumerate((widths, narrow))]
    result = fusekit.fuse(clients, "pfnm", width_ratio=1.25, sweeps=1)
    assert result.widths == [math.floor(1.25 * w + 0.5) for w in widths]
    fused = fusekit.load_fused(Checkpoint.from_state_dict(result.state_dict, result.metadata),
                               device="cpu")
    assert torch.isfinite(fused(_inputs())).all()


# --- spec files, architectures, memory --------------------------------------------------

class TinyResidual(nn.Module):
    """A residual network torchvision does not know: described by a fusekit.spec/2 file."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(5, 8)
        self.inner = nn.Linear(8, 6)
        self.outer = nn.Linear(6, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.stem(x))
        h = torch.relu(h + self.outer(torch.relu(self.inner(h))))
        return self.head(h)


TINY_SPEC = {"format": "fusekit.spec/2", "groups": ["stream", "inner"], "layers": [
    {"name": "stem", "weight": "stem.weight", "bias": "stem.bias", "reads": None,
     "writes": "stream"},
    {"name": "inner", "weight": "inner.weight", "bias": "inner.bias", "reads": "stream",
     "writes": "inner"},
    {"name": "outer", "weight": "outer.weight", "bias": "outer.bias", "reads": "inner",
     "writes": "stream"},
    {"name": "head", "weight": "head.weight", "bias": "head.bias", "reads": "stream",
     "writes": None}]}


def test_spec_file_version_2_describes_any_residual_network(tmp_path):
    torch.manual_seed(0)
    model = TinyResidual()
    state = numpy_state(model)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(TINY_SPEC))
    spec = spec_from_json(TINY_SPEC, state)
    assert spec.hidden_widths == [8, 6]
    assert spec_from_json(spec.to_json(), state) == spec
    x = torch.randn(4, 5)
    clients = [Checkpoint.from_state_dict(permute(state, spec, _random_perms(spec, s)))
               for s in range(3)]
    for method in ("ot", "rebasin"):
        result = fusekit.fuse(clients, method, spec=path)
        torch.testing.assert_close(_logits(model, result.state_dict, x), _logits(model, state, x),
                                   rtol=0, atol=ATOL)
        assert json.loads(result.metadata["fusekit.spec"])["format"] == "fusekit.spec/2"


@pytest.mark.parametrize(("change", "message"), [
    (lambda s: s["layers"][1].update(reads="nowhere"), r"layers\[1\]\.reads: expected null"),
    (lambda s: s["layers"][1].update(reads="inner"), r"reads group 'inner' before any layer"),
    (lambda s: s["layers"][2].update(writes="inner"), r"group 'inner': layer outer writes 8"),
    (lambda s: s.update(groups=["stream", "inner", "spare"]), r"\['spare'\] are written by no"),
    (lambda s: s.update(groups="stream"), r"\"groups\": expected a list"),
])
def test_spec_file_version_2_errors(change, message):
    spec = json.loads(json.dumps(TINY_SPEC))
    change(spec)
    with pytest.raises(SpecError, match=message):
        spec_from_json(spec, numpy_state(TinyResidual()))


@pytest.mark.parametrize("name", FAMILIES)
def test_architectures_are_recognised_and_rebuilt_at_any_width(name):
    arch = named_arch(name, 7)
    shapes = _shapes(arch)
    assert infer_arch(shapes) == arch
    assert infer_spec(shapes).hidden_widths == hidden_widths(arch)
    # every group its own width, small enough to build quickly
    widths = [max(w // 16, 2) + i % 3 for i, w in enumerate(hidden_widths(arch))]
    changed = with_hidden_widths(arch, widths)
    rebuilt = {k: tuple(v.shape) for k, v in build_model(changed).state_dict().items()}
    assert infer_spec(rebuilt).hidden_widths == widths
    assert infer_arch(rebuilt) == changed


def test_checkpoints_release_what_they_read(tmp_path):
    path = write(tmp_path / "m.safetensors", _model("resnet20"))
    checkpoint = load_checkpoint(path)
    assert checkpoint.content_hash and not checkpoint._arrays  # hashing streams the file
    checkpoint.tensor("fc.weight")
    checkpoint.release("fc.weight")
    assert not checkpoint._arrays


def test_trained_resnets_on_digits_fuse_with_every_method():
    """The benchmark's trained case, tiny: fused accuracies go to RESULTS.md; here only that
    training worked and that AMS, which keeps every client, answers as well as one."""
    from bench_resnet import trained_case

    methods = ("avg", "ot", "rebasin", "pfnm", "nafi", "ams")
    rows = trained_case(n_clients=2, epochs=1, methods=methods)  # clients 0.75-0.85 accurate
    assert [row["model"] for row in rows] == ["client 0", "client 1", *methods]
    clients, fused = rows[:2], dict(zip(methods, rows[2:], strict=True))
    assert min(row["accuracy"] for row in clients) > 0.5  # ten classes: chance is 0.1
    assert fused["ams"]["accuracy"] > 0.5
    assert fused["ot"]["widths"] == fused["rebasin"]["widths"] == clients[0]["widths"]
    assert fused["pfnm"]["widths"] == [math.floor(1.5 * w + 0.5) for w in clients[0]["widths"]]
    assert fused["ams"]["activation_scale"] is None  # not one network
    for method in methods[:-1]:
        scale = fused[method]["activation_scale"]
        assert list(scale) == ["conv1", "layer1", "layer2", "layer3"]
        assert all(0 < value < 10 for value in scale.values())


def test_eval_throughput_measures_every_fused_file_on_every_device():
    from bench_resnet import THROUGHPUT, eval_throughput, markdown

    rows = eval_throughput(["resnet20"], batch=2, seconds=0.01)
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    assert [(r["fused with"], r["device"]) for r in rows] == [
        (label, device) for label in THROUGHPUT for device in devices]
    assert [r["widths"] for r in rows[::len(devices)]] == ["1.00x", "1.50x"]
    assert all(r["images_per_s"] > 0 and r["image"] == 32 for r in rows)
    table = markdown(rows).splitlines()
    assert len(table) == 2 + len(rows) and table[0].startswith("| model | fused with |")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_resnet_runs_on_cuda_like_on_the_cpu(tmp_path):
    state = numpy_state(_model("resnet20"))
    clients = [write(tmp_path / f"c{s}.safetensors", state) for s in range(2)]
    path = fusekit.fuse(clients, "pfnm", **COPY_PARAMS).save(tmp_path / "fused.safetensors")
    x = _inputs()
    with torch.no_grad():
        gpu = fusekit.load_fused(path, device="cuda")(x.cuda()).cpu()
        torch.testing.assert_close(gpu, fusekit.load_fused(path, device="cpu")(x),
                                   rtol=1e-4, atol=1e-4)
