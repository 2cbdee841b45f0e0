"""``--method distill`` on Hugging Face transformers: a ViT taught on synthetic pixel
values, a GPT-2 language model on token sequences sampled from its clients' ensemble.

Clients are tiny models built from configs (no hub downloads), every weight random and
different per client, saved with ``save_pretrained``: fusekit trained none of them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")
torch = pytest.importorskip("torch")

from test_service import HANG_S, NAMES, admin, service  # noqa: E402, F401
from test_service_calibration import assert_same_tensors  # noqa: E402
from typer.testing import CliRunner  # noqa: E402

import fusekit  # noqa: E402
from fusekit._cli.app import app  # noqa: E402
from fusekit.client import Client  # noqa: E402
from fusekit.core.errors import IncompatibleModelsError  # noqa: E402
from fusekit.core.model_spec import client_spec  # noqa: E402
from fusekit.toolkit.nn.hf import load_pretrained  # noqa: E402

# 15 steps take the student to 0.19x (ViT) and 0.29x (GPT-2) of the start's KL; 30 steps
# to 0.06x and 0.21x, at twice the CPU.
SMALL = {"steps": 15, "batch": 32, "patience": 0}


def tiny_client(family: str, folder, seed: int):
    """A tiny ViT classifier (8x8 one-channel images, 3 classes) or GPT-2 language model
    (vocabulary 12, 10 positions) with random weights, saved as a model folder."""
    torch.manual_seed(seed)
    if family == "vit":
        model = transformers.ViTForImageClassification(transformers.ViTConfig(
            image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=24, num_labels=3))
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=12, n_positions=10, n_embd=16, n_layer=2, n_head=2, n_inner=24,
            bos_token_id=0, eos_token_id=0))
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    model.eval().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["vit", "gpt2"])
def family_clients(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"distill-{request.param}")
    return request.param, [tiny_client(request.param, root / f"client{s}", seed=s)
                           for s in range(3)]


def held_out_inputs(family: str) -> torch.Tensor:
    """Inputs the method never drew: normal images, or uniformly random token sequences."""
    generator = torch.Generator().manual_seed(1234)
    if family == "vit":
        return torch.randn((256, 1, 8, 8), generator=generator)
    return torch.randint(12, (256, 10), generator=generator)


@torch.no_grad()
def log_probs(model, family: str, x: torch.Tensor) -> torch.Tensor:
    key = "pixel_values" if family == "vit" else "input_ids"
    return model(**{key: x}).logits.flatten(0, -2).log_softmax(-1)


@pytest.mark.spread
def test_the_student_comes_closer_to_the_ensemble_than_its_start(family_clients, tmp_path):
    """KL(ensemble || model) on held-out inputs, per image or per token: the distilled
    student (saved as a folder, loaded with from_pretrained) against the pfnm fusion it
    started from, which independently initialised clients make far from their ensemble."""
    family, clients = family_clients
    x = held_out_inputs(family)
    probs = torch.stack([log_probs(load_pretrained(c), family, x).exp() for c in clients])
    ensemble = probs.mean(0).log()

    def disagreement(result, name):
        model = load_pretrained(result.save(tmp_path / name))
        return float(torch.nn.functional.kl_div(log_probs(model, family, x), ensemble,
                                                log_target=True, reduction="batchmean"))

    start = fusekit.fuse(clients, method="pfnm")
    student = fusekit.fuse(clients, method="distill", **SMALL)
    assert student.widths == start.widths  # the student is pfnm's model at 1.5x
    before, after = disagreement(start, "start"), disagreement(student, "student")
    assert after < 0.5 * before, (before, after)
    report = student.report["distill"]
    assert report["teacher"] == "softmax" and report["data"] == "none"
    if family == "vit":
        assert report["input_shape"] == [1, 8, 8] and report["prior"] == "normal"
    else:
        assert report["input_shape"] == [10] and report["prior"] == "sampled from the teacher"


def test_same_seed_same_student(family_clients):
    _, clients = family_clients
    first, again = (fusekit.fuse(clients, method="distill", steps=3, batch=8, seed=5)
                    for _ in range(2))
    other = fusekit.fuse(clients, method="distill", steps=3, batch=8, seed=6)
    for name, value in first.state_dict.items():
        np.testing.assert_array_equal(value, again.state_dict[name])
    assert any(not np.array_equal(v, other.state_dict[n]) for n, v in first.state_dict.items())
    assert set(first.state_dict) == set(fusekit.fuse(clients, method="pfnm").state_dict)


def test_sequences_sample_the_tokens_the_ensemble_predicts(tmp_path, monkeypatch):
    """exploration 0: every token after the first is drawn from the clients' ensemble;
    clients that predict token 7 whatever they read make sequences of 7s after a first
    token drawn uniformly."""
    from fusekit.toolkit.distill import _Trainer

    clients = []
    for s in range(2):
        folder = tiny_client("gpt2", tmp_path / f"c{s}", seed=s)
        model = transformers.GPT2LMHeadModel.from_pretrained(folder)
        with torch.no_grad():  # the final LayerNorm's bias alone decides: token 7's row
            embedding = model.transformer.wte.weight
            embedding[7] *= 10
            model.transformer.ln_f.weight.zero_()
            model.transformer.ln_f.bias.copy_(3 * embedding[7] / embedding[7].norm())
        model.save_pretrained(folder)
        clients.append(folder)
    sampled = recorded(monkeypatch, _Trainer, "_sampled_sequences")
    fusekit.fuse(clients, method="distill", initial="avg", steps=2, batch=16,
                 exploration=0.0, sequence_length=6)
    assert len(sampled) == 2 and all(s.shape == (16, 6) for s in sampled)
    assert all((s[:, 1:] == 7).all() for s in sampled)
    assert len(torch.cat(sampled)[:, 0].unique()) > 1


def test_pixels_stay_in_the_range_the_image_processor_gives(tmp_path, monkeypatch):
    """A folder's preprocessor_config.json (pixels / 255, then (x - 0.5) / 0.25) bounds
    every synthetic image to [-2, 2], before and after each input step; a processor with
    an unusable std is refused, naming the folder and the file."""
    from fusekit.toolkit.distill import _Trainer

    clients = [tiny_client("vit", tmp_path / f"c{s}", seed=s) for s in range(2)]
    processor = {"do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
                 "image_mean": [0.5], "image_std": [0.25]}
    for folder in clients:
        (folder / "preprocessor_config.json").write_text(json.dumps(processor))
    drawn = recorded(monkeypatch, _Trainer, "_synthetic_batch")
    result = fusekit.fuse(clients, method="distill", steps=4, batch=64, input_lr=5.0)
    assert result.report["distill"]["pixel_range"] == [[-2.0], [2.0]]
    x = torch.cat([inputs for inputs, _labels in drawn])
    assert x.min() == -2 and x.max() == 2  # N(0, I) and large steps reach both bounds
    processor["image_std"] = [0.5]
    (clients[0] / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(IncompatibleModelsError, match=r"c\d: its preprocessor_config.json "
                       r"gives pixels in \[\[-\d.0\], \[\d.0\]\]; .*c\d's in .*same inputs"):
        fusekit.fuse(clients, method="distill", steps=1)
    processor["image_std"] = [0.0]
    (clients[0] / "preprocessor_config.json").write_text(json.dumps(processor))
    with pytest.raises(fusekit.core.errors.CheckpointError,
                       match=r"c0: preprocessor_config.json image_std: expected positive"):
        fusekit.fuse(clients, method="distill", steps=1)


def test_transformers_distill_cannot_train_are_refused_in_one_line(tmp_path):
    gpt2 = [tiny_client("gpt2", tmp_path / f"g{s}", seed=s) for s in range(2)]
    with pytest.raises(IncompatibleModelsError, match="sequence_length 11 exceeds the "
                       "model's n_positions 10"):
        fusekit.fuse(gpt2, method="distill", steps=1, sequence_length=11)
    bert = []
    for s in range(2):
        torch.manual_seed(s)
        model = transformers.BertForSequenceClassification(transformers.BertConfig(
            vocab_size=20, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
            intermediate_size=24, max_position_embeddings=8, num_labels=3))
        model.save_pretrained(tmp_path / f"b{s}")
        bert.append(tmp_path / f"b{s}")
    with pytest.raises(IncompatibleModelsError, match=r"b\d: distill synthesises pixel "
                       r"values for ViT classifiers .* found a bert model "
                       r"\(BertForSequenceClassification\)"):
        fusekit.fuse(bert, method="distill", steps=1)


def test_cli_distils_model_folders_into_a_folder_transformers_loads(family_clients, tmp_path):
    family, clients = family_clients
    out = tmp_path / "student"
    run = CliRunner().invoke(app, ["fuse", *map(str, clients), "-m", "distill", "--steps",
                                   "3", "--batch", "8", "-o", f"{out}/"])
    assert run.exit_code == 0, run.output
    report = json.loads((out / "report.json").read_text())
    assert report["report"]["distill"]["steps"] == 3
    model = load_pretrained(out)
    assert log_probs(model, family, held_out_inputs(family)[:4]).isfinite().all()


def test_a_service_job_distils_transformer_clients_as_the_library_does(service, admin,  # noqa: F811
                                                                       tmp_path):
    """A distill job of two ViT clients given their config.json, on a real server with its
    workers: the result downloads as a model folder with the library's student, tensor for
    tensor."""
    names = NAMES[:2]
    folders = [tiny_client("vit", tmp_path / name, seed=i) for i, name in enumerate(names)]
    spec = client_spec(fusekit.load_checkpoint(folders[0]), None).to_json()
    config = json.loads((folders[0] / "config.json").read_text())
    params = {"steps": 3, "batch": 8}
    job = admin.create_job("distill", list(names), params=params, spec=spec, auto_run=True,
                           config=config)
    for name, folder in zip(names, folders, strict=True):
        with Client(service.url, job["tokens"][name]) as client:
            client.submit(job["id"], name, folder / "model.safetensors")
    state = admin.wait(job["id"], timeout=HANG_S, every=0.1)
    assert state["state"] == "succeeded", state
    result = admin.result(job["id"], tmp_path / "result")
    assert_same_tensors(result / "model.safetensors",
                        fusekit.fuse(folders, method="distill", **params).state_dict)
    assert load_pretrained(result).config.intermediate_size == 36  # pfnm's 1.5x of 24


def recorded(monkeypatch, cls, method: str) -> list:
    """What every call of ``cls.method`` returns during the test, in order."""
    returned, original = [], getattr(cls, method)

    def keep(self):
        returned.append(original(self))
        return returned[-1]

    monkeypatch.setattr(cls, method, keep)
    return returned
