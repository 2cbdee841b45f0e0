"""Hugging Face transformers (BERT, ViT, GPT-2): model folders in and out, permutation
groups, function preservation, fusion of permuted copies, refusals.

Models are built from a tiny config in the test (no download, no network), their weights
(LayerNorms included) set to random values so that every permutation shows, and saved
with ``save_pretrained``. Tolerances: logits are O(1) in float32; a permuted copy matches
the original to 1e-5, a fused model of permuted copies to 1e-4.
"""

import copy
import json
import shutil
import threading

import numpy as np
import pytest
import safetensors.numpy
import torch

import fusekit
from fusekit.core import metadata as meta
from fusekit.core.checkpoint import load_checkpoint
from fusekit.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    DataError,
    IncompatibleModelsError,
    ParameterError,
    SpecError,
    StatisticsError,
)
from fusekit.core.model_spec import fused_spec
from fusekit.core.stats import pool, save_statistics
from fusekit.core.transformer import (
    MLP_HIDDEN,
    calibration_points,
    infer_transformer,
    permute_group,
    permute_transformer,
    unit_rows,
)
from fusekit.engine.matching import solve_assignment
from fusekit.methods import transformer as methods_transformer
from fusekit.methods.calibration import point_targets, read_assignments
from fusekit.methods.transformer import (
    align_client,
    apply_moves,
    client_arrays,
    group_similarity,
    settled_slots,
)

transformers = pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from typer.testing import CliRunner  # noqa: E402

from fusekit._cli.app import app  # noqa: E402
from fusekit.toolkit.calibration import client_statistics  # noqa: E402
from fusekit.toolkit.local import calibrate_locally  # noqa: E402
from fusekit.toolkit.nn.hf import load_pretrained  # noqa: E402

ATOL_PERMUTED = 1e-5
ATOL_FUSED = 1e-4


def tiny_model(family: str, seed: int = 0, **changes):
    """A tiny BERT / ViT / GPT-2 with a head, every weight random (LayerNorms too)."""
    torch.manual_seed(seed)
    if family == "bert":
        config = transformers.BertConfig(**{
            "vocab_size": 40, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 24, "max_position_embeddings": 16,
            "num_labels": 3, **changes})
        model = transformers.BertForSequenceClassification(config)
    elif family == "vit":
        config = transformers.ViTConfig(
            image_size=8, patch_size=4, num_channels=1, hidden_size=16, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=24, num_labels=3, **changes)
        model = transformers.ViTForImageClassification(config)
    else:
        config = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2,
                                         n_head=4, bos_token_id=0, eos_token_id=0, **changes)
        model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    return model.eval()


def model_inputs(family: str) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    if family == "vit":
        return {"pixel_values": torch.randn(3, 1, 8, 8, generator=generator)}
    return {"input_ids": torch.randint(0, 40, (3, 7), generator=generator)}


def logits(folder, family: str) -> np.ndarray:
    with torch.no_grad():
        return load_pretrained(folder)(**model_inputs(family)).logits.numpy()


def save(model, folder, **kwargs):
    model.save_pretrained(folder, **kwargs)
    return folder


def shapes_of(folder):
    return {name: info.shape for name, info in load_checkpoint(folder).tensors.items()}


def spec_of(folder):
    return infer_transformer(load_checkpoint(folder).config, shapes_of(folder),
                             label=str(folder))


def random_perms(spec, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {g.name: rng.permutation(g.size) for g in spec.groups}


def permuted_copy(source, target, seed: int):
    """``source`` with every group permuted at random (stream, heads, each head's q/k and v
    dimensions, MLP units, pooler), written as a model folder at ``target``."""
    spec = spec_of(source)
    perms = random_perms(spec, seed)
    state = safetensors.numpy.load_file(source / "model.safetensors")
    target.mkdir()
    safetensors.numpy.save_file(permute_transformer(state, spec, perms),
                                target / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(source / "config.json", target / "config.json")
    return target


FAMILIES = ["bert", "vit", "gpt2"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_folders(request, tmp_path_factory):
    """(family, original folder, two permuted copies)."""
    family = request.param
    root = tmp_path_factory.mktemp(family)
    original = save(tiny_model(family), root / "original")
    copies = [permuted_copy(original, root / f"permuted{i}", seed=i) for i in (1, 2)]
    return family, original, copies


def test_groups_cover_every_weight_with_a_hidden_axis(family_folders):
    family, original, _ = family_folders
    spec = spec_of(original)
    kinds = {g.kind for g in spec.groups}
    assert kinds >= {"stream", "heads", "qk", "v", "mlp"}
    assert spec.other == (("classifier.bias",) if family != "gpt2" else ())
    heads = spec.of_kind("heads")
    assert len(heads) == 2 and len(spec.of_kind("qk")) == len(spec.of_kind("v")) == 2 * (
        spec.groups[heads[0]].size)


def test_permuted_copies_compute_the_same_function(family_folders):
    family, original, copies = family_folders
    expected = logits(original, family)
    before = safetensors.numpy.load_file(original / "model.safetensors")
    for copy in copies:
        after = safetensors.numpy.load_file(copy / "model.safetensors")
        moved = [n for n in before if not np.array_equal(before[n], after[n])]
        assert len(moved) >= len(before) - 1  # every tensor with a hidden axis moved
        np.testing.assert_allclose(logits(copy, family), expected, atol=ATOL_PERMUTED)


@pytest.mark.parametrize("method", ["rebasin", "ot"])
def test_fusing_permuted_copies_gives_back_the_model(family_folders, method, tmp_path):
    family, original, copies = family_folders
    result = fusekit.fuse([copies[0], original, copies[1]], method=method)
    out = result.save(tmp_path / "fused")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    np.testing.assert_allclose(logits(out, family), logits(original, family),
                               atol=ATOL_FUSED)
    groups_moved = [r["groups_moved"] for r in result.report["alignment"]]
    assert min(groups_moved) > 0  # the copies were really permuted back


@pytest.mark.parametrize("method", ["rebasin", "pfnm"])
def test_fusions_record_where_each_unit_went(family_folders, method):
    """Unit u of copy i is unit perm_i[u] of the original: both must land on one fused unit
    in the stream and in every MLP (what calibration maps its targets through)."""
    family, original, copies = family_folders
    spec = spec_of(original)
    hidden = [g for g in spec.groups if g.kind in ("stream", "mlp")]
    perms = {str(original): {g.name: np.arange(g.size) for g in hidden}}
    perms.update({str(c): random_perms(spec, seed) for c, seed in zip(copies, (1, 2))})
    result = fusekit.fuse([copies[0], original, copies[1]], method=method,
                          **({"width_ratio": 1.0} if method == "pfnm" else {}))
    by_client = dict(zip(result.report["clients"], result.assignments, strict=True))
    reference = by_client[str(original)]
    for label, assigned in by_client.items():
        for k, group in enumerate(hidden):
            np.testing.assert_array_equal(assigned[k], reference[k][perms[label][group.name]])
    assert meta.ASSIGNMENTS in result.metadata


def test_alignment_moves_replay_on_the_files_tensors(family_folders, tmp_path):
    """ot and rebasin average tensors read again from the files, moved by the takes the
    alignment noted: replayed on the stored tensors they give the aligned client exactly,
    sweeps in random order included (heads and their q/k dimensions share an axis)."""
    family, original, _ = family_folders
    other = save(tiny_model(family, seed=5), tmp_path / "other")
    spec = spec_of(other)
    anchor = client_arrays(load_checkpoint(original))
    client = client_arrays(load_checkpoint(other))
    moves: dict = {}
    report, _ = align_client(anchor, client, spec, sweeps=3, rng=np.random.default_rng(0),
                             solver=solve_assignment, moves=moves)
    assert report["groups_moved"] > 0 and report["sweeps"] > 0
    stored = safetensors.numpy.load_file(other / "model.safetensors")
    for name, array in client.items():
        np.testing.assert_array_equal(apply_moves(stored[name], moves.get(name, ())), array)


def test_scratch_reuses_only_the_shapes_several_groups_make(family_folders):
    """The first pass's unit rows and similarities are reused for the shapes that recur
    (the blocks' MLP units, here), never handed out twice; a shape met once is freed."""
    _, original, _ = family_folders
    spec = spec_of(original)
    anchor = client_arrays(load_checkpoint(original))
    compared = list(zip(spec.groups, settled_slots(spec, shapes_of(original)), strict=True))
    keep = methods_transformer.recurring_shapes(anchor, compared)
    mlp = next(g for g in spec.groups if g.kind == "mlp")
    assert (mlp.size, mlp.size) in keep and (spec.groups[0].size, 10**6) not in keep
    scratch = methods_transformer.Scratch(keep)
    first = scratch.take((mlp.size, mlp.size), np.float32)
    scratch.give(first, np.empty((spec.groups[0].size, 10**6), np.uint8))
    assert scratch.take((mlp.size, mlp.size), np.float64) is not first  # another dtype
    assert scratch.take((mlp.size, mlp.size), np.float32) is first
    assert scratch.take((mlp.size, mlp.size), np.float32) is not first  # taken already


def row_compared_groups(family_folders, tmp_path):
    """(anchor, another model, group) for every group compared by its unit rows (all but
    the heads), both models' tensors as stored."""
    family, original, _ = family_folders
    anchor = client_arrays(load_checkpoint(original))
    client = client_arrays(load_checkpoint(save(tiny_model(family, seed=5), tmp_path / "o")))
    return [(anchor, client, g) for g in spec_of(original).groups if g.kind != "heads"]


def test_group_similarity_is_the_sum_over_slots(family_folders, tmp_path):
    """A group's units compared in one product of their rows side by side: the sum of each
    slot's products (rows written, columns read, biases, blocks at an offset)."""
    for anchor, client, group in row_compared_groups(family_folders, tmp_path):
        expected = sum(unit_rows(anchor[s.tensor], s, group.size)
                       @ unit_rows(client[s.tensor], s, group.size).T for s in group.slots)
        np.testing.assert_allclose(group_similarity(anchor, client, group), expected,
                                   rtol=1e-12, atol=1e-12, err_msg=group.name)


def test_wide_groups_are_compared_in_batches_of_columns(family_folders, tmp_path, monkeypatch):
    """Unit rows wider than ROWS_BYTES (rebasin's stream over every slot) are compared in
    batches of columns, cut inside a slot too, their products summed: every column once,
    the same similarity to rounding."""
    for anchor, client, group in row_compared_groups(family_folders, tmp_path):
        whole = group_similarity(anchor, client, group)
        [one] = methods_transformer.column_batches(anchor, group, group.slots, np.float64)
        monkeypatch.setattr(methods_transformer, "ROWS_BYTES", 7 * 8 * group.size)
        batches = methods_transformer.column_batches(anchor, group, group.slots, np.float64)
        assert [sum(stop - first for _, first, stop in b) for b in batches[:-1]] == (
            [7] * (len(batches) - 1))
        covered = [(slot, c) for b in batches for slot, first, stop in b
                   for c in range(first, stop)]
        assert covered == [(slot, c) for slot, first, stop in one for c in range(first, stop)]
        np.testing.assert_allclose(group_similarity(anchor, client, group), whole,
                                   rtol=1e-12, atol=1e-12, err_msg=group.name)
        monkeypatch.undo()


@pytest.mark.parametrize("products", [np.float64, np.float32])
@pytest.mark.parametrize("ahead", [0, 200])
def test_first_pass_with_solves_overlapped_is_one_group_after_another(
        family_folders, tmp_path, products, ahead, monkeypatch):
    """The first pass solves groups' assignments while it computes the next groups'
    similarities (every group from ``ahead`` entries; the smaller ones at once): the same
    permutations as one group after another; and float32 products (ot's) assign every unit
    as float64 products do, on independent random models."""
    monkeypatch.setattr(methods_transformer, "SOLVE_AHEAD_ENTRIES", ahead)
    family, original, _ = family_folders
    other = save(tiny_model(family, seed=5), tmp_path / "other")
    spec = spec_of(other)
    anchor = client_arrays(load_checkpoint(original))
    client = client_arrays(load_checkpoint(other))
    _, orders = align_client(anchor, dict(client), spec, sweeps=0, rng=None,
                             solver=solve_assignment, products=products)
    expected = {}  # one group after another, in float64
    for group, slots in zip(spec.groups, settled_slots(spec, shapes_of(original)), strict=True):
        similarity = group_similarity(anchor, client, group, slots)
        _, cols = solve_assignment(similarity, maximize=True)
        if similarity[np.arange(cols.size), cols].sum() > np.trace(similarity) + 1e-9:
            permute_group(client, group, cols)
            expected[group.name] = cols
    assert orders.keys() == expected.keys() and len(expected) > 3
    for name, cols in expected.items():
        np.testing.assert_array_equal(orders[name], cols, err_msg=name)


def test_avg_of_a_shared_initialisation_is_the_coordinate_mean(tmp_path):
    a = save(tiny_model("vit", seed=0), tmp_path / "a")
    b = save(tiny_model("vit", seed=1), tmp_path / "b")
    out = fusekit.fuse([a, b], method="avg").save(tmp_path / "avg")
    fused = safetensors.numpy.load_file(out / "model.safetensors")
    first = safetensors.numpy.load_file(a / "model.safetensors")
    second = safetensors.numpy.load_file(b / "model.safetensors")
    for name, array in fused.items():
        np.testing.assert_allclose(array, (first[name] + second[name]) / 2, atol=1e-6)
    load_pretrained(out)


def test_sharded_folder_reads_as_the_single_file(tmp_path):
    model = tiny_model("gpt2")
    whole = load_checkpoint(save(model, tmp_path / "whole"))
    sharded = load_checkpoint(save(model, tmp_path / "sharded", max_shard_size="20KB"))
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    assert sharded.tensors == whole.tensors
    assert sharded.content_hash == whole.content_hash
    assert sharded.sample_hash == whole.sample_hash
    for name, array in sharded.state_dict().items():
        np.testing.assert_array_equal(array, whole.tensor(name))
    last = sorted((tmp_path / "sharded").glob("model-*-of-*.safetensors"))[-1]
    tensors = safetensors.numpy.load_file(last)
    name = sorted(tensors)[-1]
    tensors[name] = np.full_like(tensors[name], np.nan)
    safetensors.numpy.save_file(tensors, last, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{name}.*non-finite"):
        load_checkpoint(tmp_path / "sharded").check_values(budget=4096)  # read from its shard


def test_cli_writes_a_folder_transformers_loads(tmp_path, family_folders):
    family, original, copies = family_folders
    out = tmp_path / "fused"
    run = CliRunner().invoke(app, ["fuse", str(original), str(copies[0]), "-m", "rebasin",
                                   "-o", f"{out}/"])
    assert run.exit_code == 0, run.output
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "README.md",
                                               "recipe.yaml", "report.json"}
    assert "from_pretrained" in (out / "README.md").read_text()
    np.testing.assert_allclose(logits(out, family), logits(original, family),
                               atol=ATOL_FUSED)
    # Without the slash, and without -o: the same output folder (it was a bare model folder,
    # without card, recipe or report, and by default one named fused-rebasin.safetensors).
    bare = CliRunner().invoke(app, ["fuse", str(original), str(copies[0]), "-m", "rebasin",
                                    "-o", str(tmp_path / "x6")])
    assert bare.exit_code == 0, bare.output
    assert {p.name for p in (tmp_path / "x6").iterdir()} == {p.name for p in out.iterdir()}
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        default = CliRunner().invoke(app, ["fuse", str(original), str(copies[0]), "-m", "avg"])
        assert default.exit_code == 0, default.output
    assert {p.name for p in (tmp_path / "fused-avg").iterdir()} == {p.name for p in out.iterdir()}


def test_spec3_file_describes_the_same_groups(tmp_path, family_folders):
    family, original, copies = family_folders
    spec = spec_of(original)
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(spec.to_json()))
    result = fusekit.fuse([original, copies[0]], method="ot", spec=path)
    np.testing.assert_allclose(logits(result.save(tmp_path / "out"), family),
                               logits(original, family), atol=ATOL_FUSED)


def test_different_head_counts_are_refused_in_one_line(tmp_path):
    a = save(tiny_model("bert"), tmp_path / "a")
    b = save(tiny_model("bert", seed=1, num_attention_heads=2), tmp_path / "b")
    with pytest.raises(IncompatibleModelsError, match=r"heads \(heads, 4 units\).*2 units"):
        fusekit.fuse([a, b], method="ot")


def test_unknown_family_and_unfit_methods_are_refused(tmp_path):
    folder = save(tiny_model("gpt2"), tmp_path / "gpt2")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(SpecError, match="model_type 'llama'.*fusekit.spec/3"):
        fusekit.fuse([folder, folder], method="avg")
    other = save(tiny_model("gpt2"), tmp_path / "other")
    with pytest.raises(IncompatibleModelsError, match="does not fuse transformers"):
        fusekit.fuse([other, other], method="fed2")


def test_a_head_fusekit_does_not_know_is_refused_not_averaged(tmp_path):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=24,
                                     max_position_embeddings=16)
    folder = save(transformers.BertForQuestionAnswering(config), tmp_path / "qa")
    with pytest.raises(SpecError, match=r"qa_outputs.*no permutation group.*spec/3"):
        fusekit.fuse([folder, folder], method="ot")


@pytest.mark.parametrize("tied", [True, False])
def test_masked_lm_heads_move_with_the_model(tmp_path, tied):
    """BertForMaskedLM: the head's transform and LayerNorm write the stream when the decoder
    is the token embedding (tied), a group of their own that the decoder reads otherwise;
    permuted copies compute the same logits and fuse back to them."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=24,
                                     max_position_embeddings=16, tie_word_embeddings=tied)
    model = transformers.BertForMaskedLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn_like(param) * 0.3)
    original = save(model.eval(), tmp_path / "original")
    spec = spec_of(original)
    assert ("mlm_transform" in spec.group_names) is not tied
    assert spec.other == ("cls.predictions.bias",) + (() if tied else (
        "cls.predictions.decoder.bias",))
    copies = [permuted_copy(original, tmp_path / f"permuted{i}", seed=i) for i in (1, 2)]
    expected = logits(original, "bert")
    for folder in copies:
        np.testing.assert_allclose(logits(folder, "bert"), expected, atol=ATOL_PERMUTED)
    fused = fusekit.fuse([copies[0], original, copies[1]], method="rebasin")
    np.testing.assert_allclose(logits(fused.save(tmp_path / "fused"), "bert"), expected,
                               atol=ATOL_FUSED)


def test_position_ids_saved_by_older_transformers_are_read_past(tmp_path):
    folder = save(tiny_model("bert"), tmp_path / "bert")
    tensors = safetensors.numpy.load_file(folder / "model.safetensors")
    tensors["bert.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
    safetensors.numpy.save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert "bert.embeddings.position_ids" not in load_checkpoint(folder).tensors
    out = fusekit.fuse([folder, folder], method="avg").save(tmp_path / "out")
    np.testing.assert_allclose(logits(out, "bert"), logits(folder, "bert"), atol=1e-6)


# ---- calibration from client statistics ------------------------------------------------

def client_inputs(family: str, n: int = 40, seed: int = 0) -> np.ndarray:
    """Pixel values, or token ids with the last positions of every other sequence padding
    (BERT's pad_token_id is 0; GPT-2 has none, so nothing is padding there)."""
    rng = np.random.default_rng(seed)
    if family == "vit":
        return rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    ids = rng.integers(1, 40, size=(n, 7))
    ids[::2, 5:] = 0
    return ids


def test_statistics_count_every_token_but_padding(family_folders):
    """Per channel moments of the last LayerNorm over the tokens counted, against the
    model's own hidden states (BERT: its last block's output LayerNorm; GPT-2: ln_f)."""
    family, original, _ = family_folders
    x = client_inputs(family)
    stats = client_statistics(original, x)
    points = calibration_points(spec_of(original), shapes_of(original))
    assert set(stats.points) == {p.point for p in points}
    assert sum(p.kind == MLP_HIDDEN for p in points) == 2
    model = load_pretrained(original)
    with torch.no_grad():
        if family == "vit":
            hidden = model(pixel_values=torch.from_numpy(x), output_hidden_states=True)
            last = model.vit.layernorm(hidden.hidden_states[-1]).reshape(-1, 16).numpy()
        else:
            ids = torch.from_numpy(x)
            mask = ids != 0 if family == "bert" else torch.ones_like(ids, dtype=torch.bool)
            out = model(input_ids=ids, attention_mask=mask.long(), output_hidden_states=True)
            last = out.hidden_states[-1][mask].numpy()
    tokens = {"vit": 40 * 5, "bert": 40 * 7 - 20 * 2, "gpt2": 40 * 7}[family]
    moments = stats.points["layernorm:" + {"vit": "vit.layernorm", "gpt2": "transformer.ln_f",
                                           "bert": "bert.encoder.layer.1.output.LayerNorm"}[family]]
    assert last.shape[0] == tokens and set(moments.count) == {tokens}
    np.testing.assert_allclose(moments.mean, last.mean(0), atol=1e-5)
    np.testing.assert_allclose(moments.var, last.var(0), rtol=1e-4, atol=1e-6)


def test_calibrating_with_its_own_statistics_changes_nothing(family_folders, tmp_path):
    """An unfused model towards its own statistics, and a fusion of permuted copies of one
    model (ot: the same function) towards the copies' statistics through its assignments:
    every channel already has its target's mean and deviation."""
    family, original, copies = family_folders
    x = client_inputs(family)
    own = client_statistics(original, x)
    same = fusekit.calibrate(original, [own], targets=[own]).state_dict
    before = load_checkpoint(original).state_dict()
    for name, array in before.items():
        np.testing.assert_allclose(same[name], array, rtol=1e-4, atol=1e-5)
    fused = fusekit.fuse([copies[0], original, copies[1]], method="ot").save(tmp_path / "f")
    targets = [client_statistics(folder, x) for folder in (copies[0], original, copies[1])]
    calibrated = fusekit.calibrate(fused, [client_statistics(fused, x)], targets=targets)
    out = calibrated.save(tmp_path / "calibrated")
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (fused / "config.json").read_text())
    np.testing.assert_allclose(logits(out, family), logits(original, family), atol=ATOL_FUSED)


def test_layer_by_layer_calibration_gives_every_channel_its_target(tmp_path):
    """Two different ViTs fused by pfnm at 1.5x: after one round per point, the calibrated
    model's pooled statistics are the targets at every point (exact, §13)."""
    a = save(tiny_model("vit", seed=0), tmp_path / "a")
    b = save(tiny_model("vit", seed=1), tmp_path / "b")
    fused = fusekit.fuse([a, b], method="pfnm", width_ratio=1.5).save(tmp_path / "fused")
    x = [client_inputs("vit", seed=s) for s in (0, 1)]
    result = calibrate_locally(fused, x, clients=[load_checkpoint(a), load_checkpoint(b)])
    assert result.report["calibration"]["rounds"] == 7  # 2 x (2 LayerNorms, 1 MLP) + final
    out = result.save(tmp_path / "calibrated")
    model = load_pretrained(out)  # loads, at the fused width
    assert model.vit.layers[0].mlp.fc1.weight.shape == (36, 16)
    checkpoint = load_checkpoint(out)
    spec = fused_spec(checkpoint)
    points = calibration_points(spec, shapes_of(out))
    after = pool([client_statistics(out, inputs) for inputs in x])
    own = [client_statistics(folder, inputs) for folder, inputs in zip((a, b), x)]
    by_model = {c: assigned for c, assigned in zip(
        json.loads(checkpoint.metadata[meta.INPUTS]),
        read_assignments(checkpoint, spec), strict=True)}
    goals = point_targets(spec, points, own, [by_model[s.model] for s in own])
    for point in points:
        mean, std = goals[point.point]
        np.testing.assert_allclose(after[point.point].mean, mean, atol=1e-4)
        np.testing.assert_allclose(after[point.point].std, std, rtol=1e-3, atol=1e-5)


def test_calibration_of_chosen_layers_changes_only_them(tmp_path):
    a = save(tiny_model("gpt2", seed=0), tmp_path / "a")
    b = save(tiny_model("gpt2", seed=1), tmp_path / "b")
    fused = fusekit.fuse([a, b], method="ot").save(tmp_path / "fused")
    x = [client_inputs("gpt2", seed=s) for s in (0, 1)]
    chosen = ["transformer.h.1.ln_2", "transformer.h.0.mlp.c_fc"]
    result = calibrate_locally(fused, x, clients=[load_checkpoint(a), load_checkpoint(b)],
                               layers=chosen)
    assert result.report["calibration"]["rounds"] == 2
    before = load_checkpoint(fused).state_dict()
    changed = {name for name, array in result.state_dict.items()
               if not np.array_equal(array, before[name])}
    assert changed == {f"{module}.{part}" for module in chosen for part in ("weight", "bias")}


def test_cli_calibrates_a_model_folder(tmp_path):
    """fusekit stats on model folders with token ids, fusekit calibrate to a folder that
    from_pretrained loads."""
    a = save(tiny_model("bert", seed=0), tmp_path / "a")
    b = save(tiny_model("bert", seed=1), tmp_path / "b")
    fused = tmp_path / "fused"
    runner = CliRunner()
    assert runner.invoke(app, ["fuse", str(a), str(b), "-m", "rebasin", "-o",
                               f"{fused}/"]).exit_code == 0
    data = tmp_path / "ids.npz"
    np.savez(data, x_train=client_inputs("bert"))
    files = []
    for model in (fused, a, b):
        path = tmp_path / f"{model.name}.stats.safetensors"
        run = runner.invoke(app, ["stats", str(model), "--data", "tokens", "--data-path",
                                  str(data), "-o", str(path)])
        assert run.exit_code == 0, run.output
        # transformers' own bars ("Loading weights") stay off while fusekit loads a folder
        assert "Loading weights" not in run.stderr and "it/s" not in run.stderr, run.stderr
        files.append(str(path))
    assert transformers.utils.logging.is_progress_bar_enabled()  # and are back on after
    run = runner.invoke(app, ["calibrate", str(fused), files[0], "--targets", files[1],
                              "--targets", files[2], "-o", f"{tmp_path / 'out'}/", "--json"])
    assert run.exit_code == 0, run.output
    assert json.loads(run.stdout)["repair"] is True
    assert np.all(np.isfinite(logits(tmp_path / "out", "bert")))


def test_bad_statistics_of_a_transformer_are_refused_in_one_line(tmp_path):
    folder = save(tiny_model("gpt2"), tmp_path / "gpt2")
    other = save(tiny_model("gpt2", seed=1, n_inner=32), tmp_path / "other")
    x = client_inputs("gpt2")
    own = client_statistics(folder, x)
    with pytest.raises(ParameterError, match="targets: .*transformer.*--targets"):
        fusekit.calibrate(folder, [own])
    with pytest.raises(StatisticsError, match="computed for model"):
        fusekit.calibrate(folder, [client_statistics(other, x)], targets=[own])
    point = "mlp_hidden:transformer.h.0.mlp.c_fc"
    for field, value, message in (("var", -1.0, "variances must be finite"),
                                  ("count", 2.5, "positive integer counts"),
                                  ("mean", np.nan, "means must be finite")):
        bad = copy.deepcopy(own)
        getattr(bad.points[point], field)[3] = value
        source = bad if field == "mean" else (  # a file cannot hold NaN: checked in memory
            save_statistics(tmp_path / f"{field}.safetensors", bad))
        with pytest.raises(StatisticsError, match=f"point '{point}'.*{message}"):
            fusekit.calibrate(folder, [source], targets=[own])
    with pytest.raises(ParameterError, match="no BatchNorm"):
        client_statistics(folder, x, mode="batch")
    with pytest.raises(DataError, match="integer token ids"):
        client_statistics(folder, x + 0.5)
    np.savez(tmp_path / "floats.npz", x_train=x + 0.5)
    run = CliRunner().invoke(app, ["stats", str(folder), "--data", "tokens", "--data-path",
                                   str(tmp_path / "floats.npz"), "-o", str(tmp_path / "s")])
    assert run.exit_code == 2 and "integer token ids of shape (N, L)" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1


def test_folder_without_weights_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="model.safetensors or model.safetensors.index"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("method", ["pfnm", "nafi"])
def test_bayesian_matching_of_mlp_units_gives_back_the_model(family_folders, method, tmp_path):
    family, original, copies = family_folders
    result = fusekit.fuse([copies[0], original, copies[1]], method=method, width_ratio=1.0)
    np.testing.assert_allclose(logits(result.save(tmp_path / "fused"), family),
                               logits(original, family), atol=ATOL_FUSED)


def test_bayesian_matching_widens_the_mlp_and_the_config(tmp_path):
    a = save(tiny_model("gpt2", seed=0), tmp_path / "a")
    b = save(tiny_model("gpt2", seed=1, n_inner=48), tmp_path / "b")
    result = fusekit.fuse([a, b], method="pfnm", width=80)
    out = result.save(tmp_path / "fused")
    config = json.loads((out / "config.json").read_text())
    assert config["n_inner"] == 80 and result.widths == [16, 80, 80]
    model = load_pretrained(out)
    assert model.transformer.h[1].mlp.c_fc.weight.shape == (16, 80)
    with pytest.raises(IncompatibleModelsError, match="needs equal widths"):
        fusekit.fuse([a, b], method="rebasin")


def test_inspect_lists_the_groups(family_folders):
    family, original, copies = family_folders
    run = CliRunner().invoke(app, ["inspect", str(original), str(copies[0]), "--json"])
    assert run.exit_code == 0, run.output
    report = json.loads(run.stdout)
    assert report["fusable_together"]
    first = report["files"][0]
    assert first["family"] == family and "stream" in first["group_names"]
    assert any("[axis 0, block 8]" in m or "[axis 1, block 8]" in m or "block 4" in m
               for members in first["permutation_groups"] for m in members)


def test_ams_keeps_every_classifier_and_answers_with_the_most_confident(tmp_path):
    a = save(tiny_model("vit", seed=0), tmp_path / "a")
    b = save(tiny_model("vit", seed=1), tmp_path / "b")
    result = fusekit.fuse([a, b], method="ams", mode="top1", confidence="probability")
    result.save(tmp_path / "ams.safetensors")
    packed = fusekit.load_fused(tmp_path / "ams.safetensors", device="cpu")
    x = model_inputs("vit")["pixel_values"]
    with torch.no_grad():
        fused = packed(x).numpy()
    clients = np.stack([logits(folder, "vit") for folder in (a, b)])
    chosen = np.take_along_axis(clients, np.argmax(
        np.max(torch.tensor(clients).softmax(-1).numpy(), axis=2), axis=0)[None, :, None], 0)
    np.testing.assert_allclose(fused, chosen[0], atol=1e-5)
    run = CliRunner().invoke(app, ["fuse", str(a), str(b), "-m", "ams", "-o",
                                   f"{tmp_path / 'out'}/"])
    assert run.exit_code == 0, run.output
    assert "fusekit.load_fused" in (tmp_path / "out" / "README.md").read_text()
    lm = save(tiny_model("gpt2"), tmp_path / "lm")
    with pytest.raises(IncompatibleModelsError, match="classifiers.*GPT2LMHeadModel"):
        fusekit.fuse([lm, lm], method="ams")


def test_a_folder_without_config_json_is_named_as_such(tmp_path):
    (tmp_path / "weights").mkdir()
    with pytest.raises(CheckpointNotFoundError, match=r"weights: a folder without config\.json; "
                       r"expected a \.safetensors file or a Hugging Face model folder"):
        load_checkpoint(tmp_path / "weights")


def test_loads_in_threads_leave_weight_tying_intact(tmp_path):
    """from_pretrained patches PreTrainedModel process-wide while it loads; loads in threads
    at once (clients of a service job in one process) must not leave the patch behind."""
    folder = save(tiny_model("bert"), tmp_path / "bert")
    original = transformers.PreTrainedModel.tie_weights
    threads = [threading.Thread(target=lambda: [load_pretrained(folder) for _ in range(5)])
               for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert transformers.PreTrainedModel.tie_weights is original
    config = transformers.BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, intermediate_size=24,
                                     max_position_embeddings=16, tie_word_embeddings=True)
    model = transformers.BertForMaskedLM(config)
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
