"""Clients from one base model (federated fine-tuning): PFNM and NAFI at any width answer as
the clients' average does (ALGORITHMS.md §3, "Clients from one base").

Fine-tuned copies of one base keep its neuron order, so the matching is the identity (up
to counterparts it leaves apart); every global holding base neuron j is the average's
neuron j, and the layers reading it weight each copy by its share of the clients, so the
copies add up to the average's neuron instead of counting it once per copy. The clients here are plain torch
models fusekit did not train (tests/foreign.py), and tiny Hugging Face transformers.
"""

import numpy as np
import pytest
import torch

import fusekit
from fusekit.methods.bayesian import match_neurons

RATIOS = (1.0, 1.5)


def relative_gap(scores: np.ndarray, reference: np.ndarray) -> float:
    """Root mean square of the difference, relative to the reference's."""
    return float(np.sqrt(np.mean((scores - reference) ** 2) / np.mean(reference ** 2)))


def fused_scores(files, method: str, x: np.ndarray, folder, **params):
    result = fusekit.fuse(files, method=method, **params)
    name = f"{method}-{params.get('width_ratio', '')}.safetensors"
    model = fusekit.load_fused(result.save(folder / name), "cpu")
    with torch.inference_mode():
        return result, model(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def shared_family(tmp_path_factory):
    import foreign as own

    folder = tmp_path_factory.mktemp("shared")
    families = {}

    def family(kind: str):
        if kind not in families:
            families[kind] = own.make_shared_family(kind, folder)
        return families[kind]

    return family


@pytest.mark.parametrize("kind", ["mlp", "bn_mlp", "resnet20"])
def test_fine_tuned_copies_fuse_to_the_average_at_every_width(shared_family, tmp_path, kind):
    family = shared_family(kind)
    x, y = family.arrays.x_test, family.arrays.y_test
    _, average = fused_scores(family.files, "avg", x, tmp_path)
    for method in ("pfnm", "nafi"):
        for ratio in RATIOS:
            result, scores = fused_scores(family.files, method, x, tmp_path, width_ratio=ratio)
            assert all(layer["one_base"] for layer in result.report["layers"])
            assert relative_gap(scores, average) < 0.1, (method, ratio)
            accuracy, floor = (np.mean(s.argmax(1) == y) for s in (scores, average))
            assert accuracy >= floor - 0.01, (method, ratio, accuracy, floor)


def test_every_width_and_the_zeros_option_answer_as_the_clients_width(shared_family, tmp_path):
    """Two hidden layers: the copies of layer 1 are read by layer 2's fused columns (with
    unobserved="zeros" averaged in as zeros, not weighted again) and layer 2's by the head."""
    family = shared_family("bn_mlp")
    x = family.arrays.x_test
    _, reference = fused_scores(family.files, "pfnm", x, tmp_path, width_ratio=1.0)
    for params in ({"width_ratio": 3.0}, {"width": "unlimited"},
                   {"width_ratio": 1.5, "unobserved": "zeros"}):
        result, scores = fused_scores(family.files, "pfnm", x, tmp_path, **params)
        assert all(layer["one_base"] for layer in result.report["layers"])
        np.testing.assert_allclose(scores, reference, atol=1e-4, err_msg=str(params))


@pytest.mark.parametrize("kind", ["mlp", "bn_mlp"])
def test_independent_clients_are_not_taken_for_one_base(foreign, kind):
    family = foreign(kind)
    result = fusekit.fuse(family.files, method="pfnm")
    assert not any(layer["one_base"] for layer in result.report["layers"])


def test_copies_of_a_base_neuron_are_equal_and_read_by_their_shares():
    rng = np.random.default_rng(0)
    base = rng.normal(size=(6, 12))
    copies = [base + rng.normal(scale=0.05, size=base.shape) for _ in range(3)]
    average = np.mean(copies, axis=0)
    result = match_neurons(copies, [1.0] * 3, sigma0_2=1.0, width=9, shrink=False)
    assert result.report["one_base"] and result.report["split"] == 3
    shares = result.reader_shares()
    for j in range(6):  # every copy of neuron j is the average's, all copies read as one
        parts = sorted({int(a[j]) for a in result.assignments})
        np.testing.assert_allclose(result.means[parts], average[[j] * len(parts)])
        assert sum(shares[p] for p in parts) == pytest.approx(1.0)
    assert match_neurons(copies, [1.0] * 3, sigma0_2=1.0).reader_shares() is None  # no copy
    permuted = [copies[0], copies[1][rng.permutation(6)], copies[2]]
    assert match_neurons(permuted, [1.0] * 3, sigma0_2=1.0, width=9).base is None


class TestTransformers:
    """Tiny GPT-2, ViT and BERT clients: one random base, each client the base plus its own
    perturbation of every weight (a tenth of the weights' scale)."""

    @pytest.fixture(autouse=True)
    def _needs_transformers(self):
        pytest.importorskip("transformers", reason="the [hf] extra is not installed")

    @staticmethod
    def clients(family: str, folder, shared: bool):
        from test_transformers import save, tiny_model

        folders = []
        for s in range(3):
            model = tiny_model(family, seed=0 if shared else s)
            with torch.no_grad():
                generator = torch.Generator().manual_seed(10 + s)
                for param in model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 0.03)
            folders.append(save(model, folder / f"{family}-{shared}-{s}"))
        return folders

    @pytest.mark.parametrize("family", ["gpt2", "vit", "bert"])
    def test_fine_tuned_copies_fuse_to_the_average(self, tmp_path, family):
        from test_transformers import logits

        folders = self.clients(family, tmp_path, shared=True)
        average = logits(fusekit.fuse(folders, method="avg").save(tmp_path / "avg"), family)
        for method in ("pfnm", "nafi"):
            for ratio in RATIOS:
                result = fusekit.fuse(folders, method=method, width_ratio=ratio)
                assert all(layer["one_base"] for layer in result.report["layers"])
                out = result.save(tmp_path / f"{method}-{ratio}")
                assert relative_gap(logits(out, family), average) < 0.05, (method, ratio)

    def test_independent_clients_are_not_taken_for_one_base(self, tmp_path):
        folders = self.clients("gpt2", tmp_path, shared=False)
        result = fusekit.fuse(folders, method="pfnm")
        assert not any(layer["one_base"] for layer in result.report["layers"])
