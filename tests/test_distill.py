"""``--method distill``: a matched fusion taught the clients' ensemble on synthetic inputs.

Clients are plain torch MLPs trained here on a generated Gaussian mixture, each on a few
classes (fusekit trains none of them); the test data stays in the test.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
import torch
from torch import nn

import fusekit
from fusekit.core.errors import IncompatibleModelsError, ParameterError
from fusekit.methods import distill as method
from conftest import cnn, mlp, write

FEATURES, CLASSES = 10, 4
SMALL = {"steps": 40, "batch": 64, "patience": 0}


def mixture(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Standardised inputs around one random centre per class."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(size=(CLASSES, FEATURES)) * 1.5
    y = rng.integers(0, CLASSES, n)
    x = centres[y] + rng.normal(size=(n, FEATURES))
    return ((x - x.mean(0)) / x.std(0)).astype(np.float32), y


def trained_client(classes: list[int], seed: int) -> tuple[nn.Module, list[int]]:
    x, y = mixture(600, seed)
    keep = np.isin(y, classes)
    x, y = torch.from_numpy(x[keep]), torch.from_numpy(y[keep])
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(), nn.Linear(16, CLASSES))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(150):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model.eval(), np.bincount(y.numpy(), minlength=CLASSES).tolist()


@pytest.fixture(scope="module")
def clients(tmp_path_factory):
    folder = tmp_path_factory.mktemp("distill-clients")
    paths = []
    for i, classes in enumerate([[0, 1], [1, 2], [2, 3], [3, 0]]):
        model, counts = trained_client(classes, seed=i)
        paths.append(write(folder / f"client{i}.safetensors", model,
                           num_samples=sum(counts), class_counts=json.dumps(counts)))
    return paths


def logits_of(state_dict, x: np.ndarray) -> torch.Tensor:
    names = sorted(n for n in state_dict if n.endswith(".weight"))
    h = torch.from_numpy(x)
    for i, name in enumerate(names):
        h = h @ torch.as_tensor(np.asarray(state_dict[name])).T + torch.as_tensor(
            np.asarray(state_dict[name.replace("weight", "bias")]))
        h = h.relu() if i < len(names) - 1 else h
    return h


def class_share_mixture(clients, x: np.ndarray) -> torch.Tensor:
    """The clients' class-share mixture on ``x``, renormalised (AMS's class-aware rule)."""
    models = [fusekit.load_fused(p, device="cpu") for p in clients]
    counts = np.array([json.loads(fusekit.load_checkpoint(p).metadata["fusekit.class_counts"])
                       for p in clients], dtype=float)
    shares = torch.as_tensor(counts / counts.sum(0), dtype=torch.float32)
    with torch.no_grad():
        probs = torch.stack([m(torch.from_numpy(x)) for m in models]).softmax(2)
    mixed = (shares[:, None, :] * probs).sum(0)
    return mixed / mixed.sum(1, keepdim=True)


def test_same_seed_same_student_other_seed_another(clients):
    first = fusekit.fuse(clients, method="distill", seed=3, **SMALL)
    again = fusekit.fuse(list(reversed(clients)), method="distill", seed=3, **SMALL)
    other = fusekit.fuse(clients, method="distill", seed=4, **SMALL)
    for name, value in first.state_dict.items():
        np.testing.assert_array_equal(value, again.state_dict[name])
    assert any(not np.array_equal(v, other.state_dict[n]) for n, v in first.state_dict.items())
    assert first.widths == [24]  # pfnm's default width, 1.5 x 16
    report = first.report["distill"]
    assert report["teacher"] == "class-share" and report["data"] == "none"
    assert report["steps"] == 40 and report["synthetic_inputs"] == 40 * 64


def test_the_student_agrees_with_the_ensemble_more_than_its_start(clients):
    """On held-out inputs the method never saw: top-1 agreement with the class-share
    ensemble, the distilled student against the fusion it started from (avg: independently
    initialised clients average to a poor model, which the ensemble must teach)."""
    x, _ = mixture(2000, seed=123)
    ensemble = class_share_mixture(clients, x).argmax(1)
    start = fusekit.fuse(clients, method="avg")
    student = fusekit.fuse(clients, method="distill", initial="avg", steps=100, batch=128)

    def agreement(result):
        return float((logits_of(result.state_dict, x).argmax(1) == ensemble).float().mean())

    start_rate, student_rate = agreement(start), agreement(student)
    assert 1 - student_rate <= 0.5 * (1 - start_rate), (start_rate, student_rate)


def test_inputs_moved_toward_their_experts_teach_the_student_more(clients):
    """``experts`` also moves each synthetic input toward a client that holds its label
    answering it confidently (that client's data's region): pfnm's student, taught on such
    inputs, ends more accurate on held-out data the method never sees than taught on
    inputs moved by the ensemble's confidence alone (93.2 % against 92.7 % here)."""
    x, y = mixture(2000, seed=123)

    def accuracy(experts: float) -> float:
        student = fusekit.fuse(clients, method="distill", steps=100, batch=128,
                               experts=experts)
        return float((logits_of(student.state_dict, x).argmax(1).numpy() == y).mean())

    without, with_experts = accuracy(0.0), accuracy(1.0)
    assert with_experts > without, (without, with_experts)


def test_a_sharpened_teacher_teaches_the_class_share_mixtures_top_class(clients):
    """Clients that hold different classes are each sure of their own classes on any
    input, so the class-share mixture, renormalised, spreads its mass over the classes
    (its top probability far under one on held-out inputs) although its top class is
    mostly right. Taught that mixture sharpened (``teacher_temperature`` 0.01) on the
    synthetic inputs it answers with the label they were made for, the student agrees
    with its top class more than taught the mixture as it is (the default temperature 1):
    95.9 % of held-out inputs against 93.8 % here (seeds 0-2: 95.4-95.9 % against
    93.6-93.8 %); mean top probability 0.51."""
    x, _ = mixture(2000, seed=123)
    mixed = class_share_mixture(clients, x)
    assert float(mixed.max(1).values.mean()) < 0.75
    top = mixed.argmax(1)

    def agreement(temperature: float) -> float:
        student = fusekit.fuse(clients, method="distill", steps=100, batch=128,
                               teacher_temperature=temperature)
        return float((logits_of(student.state_dict, x).argmax(1) == top).float().mean())

    as_it_is, sharpened = agreement(1.0), agreement(0.01)
    assert sharpened > as_it_is, (as_it_is, sharpened)


def test_no_file_but_the_checkpoints_is_opened(clients, tmp_path):
    """The server has the checkpoints and nothing else: a data set lying beside them is
    never read (every open during the fusion is recorded)."""
    x, y = mixture(100, seed=0)
    data = tmp_path / "data.npz"
    np.savez(data, x=x, y=y)
    fusekit.fuse(clients, method="distill", steps=2, batch=8)  # imports done beforehand
    opened: list[str] = []
    recording = [True]

    def audit(event, args):
        if recording[0] and event == "open" and isinstance(args[0], str):
            opened.append(args[0])

    sys.addaudithook(audit)
    try:
        fusekit.fuse(clients, method="distill", **SMALL)
    finally:
        recording[0] = False
    checkpoints = {str(p) for p in clients}
    folders = {str(p.parent) for p in clients} | {str(tmp_path)}
    beside = [p for p in opened if any(p.startswith(f) for f in folders)]
    assert beside and set(beside) <= checkpoints, beside


def test_clients_with_batchnorm_and_without_class_counts(tmp_path):
    paths = [write(tmp_path / f"bn{i}.safetensors", mlp((6, 8, 3), batchnorm=True, seed=i))
             for i in range(3)]
    result = fusekit.fuse(paths, method="distill", initial="avg", steps=5, batch=16)
    assert result.report["distill"]["teacher"] == "softmax"
    assert result.widths == [8]
    assert all(np.isfinite(v).all() for v in result.state_dict.values())
    loaded = fusekit.load_fused(result.save(tmp_path / "student.safetensors"), device="cpu")
    assert loaded(torch.zeros(2, 6)).shape == (2, 3)


@pytest.mark.parametrize(("params", "message"), [
    ({"steps": 0}, "steps: expected an integer >= 1"),
    ({"initial": "ams"}, "initial: expected one of"),
    ({"temperature": 0.0}, "temperature: expected a finite number > 0"),
    ({"teacher_temperature": 0.0}, "teacher_temperature: expected a finite number > 0"),
    ({"initial": "avg", "width_ratio": 2.0}, "width_ratio: initial fusion 'avg' keeps"),
    ({"device": "tpu"}, "device: expected auto, cpu or cuda"),
])
def test_parameters_are_checked(clients, params, message):
    with pytest.raises(ParameterError, match=message):
        fusekit.fuse(clients, method="distill", **{"steps": 1, "batch": 4, **params})


def test_convolutional_clients_need_their_image_size(tmp_path):
    paths = [write(tmp_path / f"c{i}.safetensors", cnn(seed=i)) for i in range(2)]
    with pytest.raises(IncompatibleModelsError, match="image_size"):
        fusekit.fuse(paths, method="distill", initial="avg", steps=1)


def test_residual_clients_are_distilled_into_the_fusion_at_their_architecture(tmp_path):
    """Two plain-torch ResNet-20s (narrow, BatchNorm statistics of their own): the student
    is pfnm's ResNet at 1.5x, taught on images of the size asked, with every client
    BatchNorm's statistics as the inputs' prior; without a size the method says it needs
    one."""
    from fusekit.core.arch import hidden_widths, named_arch
    from fusekit.toolkit.nn.zoo import resnet20

    widths = [w // 4 for w in hidden_widths(named_arch("resnet20", 3))]
    paths = []
    for seed in range(2):
        torch.manual_seed(seed)
        model = resnet20(3, in_channels=1, widths=widths)
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
        paths.append(write(tmp_path / f"resnet{seed}.safetensors", model.eval()))
    with pytest.raises(IncompatibleModelsError, match="image_size"):
        fusekit.fuse(paths, method="distill", steps=1)
    result = fusekit.fuse(paths, method="distill", image_size=8, steps=3, batch=8)
    report = result.report["distill"]
    assert report["input_shape"] == [1, 8, 8] and report["prior"] == "normal"
    norms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    assert report["batchnorm_layers"] == 2 * norms  # every BatchNorm of both clients
    assert result.widths == [w * 3 // 2 for w in widths]  # pfnm's default width, 1.5x
    loaded = fusekit.load_fused(result.save(tmp_path / "student.safetensors"), device="cpu")
    assert loaded(torch.zeros(2, 1, 8, 8)).shape == (2, 3)


def test_the_method_refuses_to_run_without_its_training_stage(clients, monkeypatch):
    from fusekit import api

    monkeypatch.setattr(method, "_trainer", [])
    with pytest.raises(ParameterError, match="trains its student with torch"):
        api.fuse(clients, method="distill", steps=1)


def test_the_weights_prior_varies_where_the_clients_data_varies():
    """Clients trained on inputs whose last half is constant: inputs drawn in the span of
    their first-layer weights vary on the first half, not on the constant half (training
    never moved those weights, and their random starts cancel across clients), next to
    nothing with the principal prior (the directions the random starts spread over are
    dropped), and have unit variance per input on average, as normalised inputs do."""
    from fusekit.toolkit.distill import weight_basis

    x, y = mixture(600, seed=0)
    x = np.concatenate([x, np.zeros_like(x)], axis=1)
    models = []
    for seed in range(6):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(2 * FEATURES, 32), nn.ReLU(), nn.Linear(32, CLASSES))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(150):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(torch.from_numpy(x)), torch.from_numpy(y)
                                        ).backward()
            optimizer.step()
        models.append(model)
    weights = [m[0].weight.detach().numpy() for m in models]
    for principal, contrast in ((False, 4), (True, 50)):
        basis = weight_basis(weights, principal=principal)
        inputs = (torch.randn(4000, len(basis)) @ basis).var(dim=0)
        assert inputs.mean() == pytest.approx(1.0, rel=0.1)
        assert inputs[:FEATURES].mean() > contrast * inputs[FEATURES:].mean(), inputs


def test_each_student_update_replays_pool_inputs_beside_the_fresh_batch(clients):
    """``replay`` adds, to each update after the first, that many inputs per fresh one
    drawn from the pool of earlier steps: as many as the report says, and a different
    student (what they gain is measured in benchmarks/RESULTS.md)."""
    settings = {"steps": 6, "batch": 32, "seed": 1}
    once = fusekit.fuse(clients, method="distill", replay=0, **settings)
    replayed = fusekit.fuse(clients, method="distill", replay=3, pool=100, **settings)
    assert once.report["distill"]["replayed_inputs"] == 0
    assert replayed.report["distill"]["replayed_inputs"] == 5 * 3 * 32
    assert replayed.report["distill"]["pool"] == 100
    assert any(not np.allclose(once.state_dict[name], replayed.state_dict[name])
               for name in once.state_dict)


def test_the_pool_keeps_the_latest_inputs_with_the_teachers_answers():
    """A ring of ``capacity`` inputs: the oldest are overwritten, every input keeps the
    answer it was given; of a batch larger than the pool, its last inputs."""
    from fusekit.toolkit.distill import _Pool

    pool = _Pool(capacity=5)
    for start in (0, 3, 6):
        batch = torch.arange(start, start + 3, dtype=torch.float32)[:, None]
        pool.add(batch, 10 * batch)
    assert sorted(pool.inputs[:, 0].tolist()) == [4, 5, 6, 7, 8]
    inputs, answers = pool.draw(50, torch.Generator().manual_seed(0))
    assert set(inputs[:, 0].tolist()) == {4, 5, 6, 7, 8}
    torch.testing.assert_close(answers, 10 * inputs)
    small = _Pool(capacity=4)
    batch = torch.arange(6, dtype=torch.float32)[:, None]
    small.add(batch, 10 * batch)
    assert sorted(small.inputs[:, 0].tolist()) == [2, 3, 4, 5]
    torch.testing.assert_close(small.targets, 10 * small.inputs)


def test_the_pool_holds_at_most_its_memory_bound_and_never_less_than_a_batch():
    """``pool`` inputs where they fit in POOL_BYTES (a 784-pixel model's do), fewer for
    large images, a batch at least."""
    from fusekit.toolkit.distill import POOL_BYTES, _pool_capacity

    settings = {"pool": 16_384, "batch": 256}
    assert _pool_capacity(settings, (784,), 10) == 16_384
    image = 3 * 224 * 224 * 4 + 1000 * 4
    assert _pool_capacity(settings, (3, 224, 224), 1000) == POOL_BYTES // image
    assert _pool_capacity(settings, (3, 4096, 4096), 10) == 256
