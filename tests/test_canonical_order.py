"""fusekit.fuse's canonical order and its provenance hashes: a function of the inputs'
contents alone, whatever their order, and the recorded hashes are the full sha256."""

import hashlib
import itertools
import json
import threading

import numpy as np
import pytest
import safetensors.torch
import torch

import fusekit
from conftest import mlp, numpy_state, write, write_raw
from fusekit.api import canonical_order
from fusekit.core.checkpoint import SAMPLE_VALUES, Checkpoint, load_checkpoint
from fusekit.core.errors import CheckpointError
from fusekit.core.model_spec import client_spec, client_specs


def reference_hash(state: dict[str, np.ndarray]) -> str:
    """sha256 over sorted names, dtypes, shapes and bytes, written out independently."""
    digest = hashlib.sha256()
    for name in sorted(state):
        array = np.ascontiguousarray(state[name])
        digest.update(name.encode())
        digest.update(f"|{array.dtype.str}|{array.shape}|".encode())
        digest.update(array.tobytes())
    return digest.hexdigest()


def colliding_clients(n: int) -> list[dict[str, np.ndarray]]:
    """n 20-10-3 MLPs equal everywhere but in the middle of 0.weight (200 values): the same
    first and last SAMPLE_VALUES values of every tensor, different contents."""
    base = numpy_state(mlp(widths=(20, 10, 3), seed=0))
    assert base["0.weight"].size > 2 * SAMPLE_VALUES
    clients = []
    for seed in range(n):
        state = {k: v.copy() for k, v in base.items()}
        middle = state["0.weight"].reshape(-1)[SAMPLE_VALUES:-SAMPLE_VALUES]
        middle += np.random.default_rng(seed).normal(0, 0.3, middle.size).astype(np.float32)
        clients.append(state)
    return clients


def test_content_hash_is_the_full_sha256(tmp_path):
    state = numpy_state(mlp(batchnorm=True))
    state["1.num_batches_tracked"] = np.array(7)  # a 0-d counter
    path = write(tmp_path / "m.safetensors", state)
    expected = reference_hash(state)
    assert load_checkpoint(path).content_hash == expected
    assert Checkpoint.from_state_dict(state).content_hash == expected
    # BF16 is hashed as what the checkpoint reads: float32
    bf16 = tmp_path / "bf16.safetensors"
    safetensors.torch.save_file(mlp().to(dtype=torch.bfloat16).state_dict(), bf16)
    assert load_checkpoint(bf16).content_hash == reference_hash(
        numpy_state(mlp().to(dtype=torch.bfloat16).float()))


def test_hashing_keeps_what_the_checkpoint_holds(tmp_path):
    checkpoint = load_checkpoint(write(tmp_path / "m.safetensors", mlp()))
    held = checkpoint.tensor("2.weight")
    assert checkpoint.sample_hash and checkpoint.content_hash
    assert list(checkpoint._arrays) == ["2.weight"]
    assert np.shares_memory(checkpoint.tensor("2.weight"), held)


def test_sample_hash_is_the_same_from_a_file_or_memory(tmp_path):
    state = numpy_state(mlp(widths=(20, 10, 3)))
    from_file = load_checkpoint(write(tmp_path / "m.safetensors", state))
    sample = from_file.sample_hash
    from_file.tensor("0.weight")  # a held tensor is sampled from memory
    del from_file.__dict__["sample_hash"]
    assert from_file.sample_hash == sample == Checkpoint.from_state_dict(state).sample_hash
    changed = {k: v.copy() for k, v in state.items()}
    changed["0.weight"][0, 0] += 1  # the first value of a tensor is in the sample
    assert Checkpoint.from_state_dict(changed).sample_hash != sample


def test_canonical_order_is_widest_first_then_sample_hash_then_content_hash(tmp_path):
    states = colliding_clients(3) + [numpy_state(mlp(widths=(20, 10, 3), seed=s)) for s in (1, 2)]
    states.append(numpy_state(mlp(widths=(20, 12, 3), seed=3)))
    checkpoints = [load_checkpoint(write(tmp_path / f"c{i}.safetensors", s))
                   for i, s in enumerate(states)]
    specs = [client_spec(c, None) for c in checkpoints]
    expected = sorted(range(len(states)), key=lambda i: (
        [-w for w in specs[i].hidden_widths], checkpoints[i].sample_hash,
        reference_hash(states[i])))
    assert canonical_order(checkpoints, specs) == expected
    assert expected[0] == 5  # the widest
    assert len({checkpoints[i].sample_hash for i in range(3)}) == 1


def test_clients_of_the_same_shapes_share_one_inferred_spec(tmp_path, monkeypatch):
    """The spec inferred from names and shapes serves every client that has them (one
    inference); a client of other widths gets its own, as client_spec gives each."""
    from fusekit.core import model_spec

    states = [numpy_state(mlp(widths=(20, w, 3), seed=s)) for s, w in enumerate((10, 12, 10))]
    checkpoints = [load_checkpoint(write(tmp_path / f"c{i}.safetensors", s))
                   for i, s in enumerate(states)]
    inferred = []
    infer = model_spec.infer_spec
    monkeypatch.setattr(model_spec, "infer_spec", lambda *a, **k: inferred.append(1) or infer(
        *a, **k))
    specs = client_specs(checkpoints, None)
    assert len(inferred) == 2 and specs[0] is specs[2]
    assert specs == [client_spec(c, None) for c in checkpoints]
    assert [s.hidden_widths for s in specs] == [[10], [12], [10]]


@pytest.mark.parametrize("method", ["pfnm", "ot"])
def test_permuted_inputs_with_colliding_sample_hashes_fuse_identically(tmp_path, method):
    states = colliding_clients(4)
    paths = [write(tmp_path / f"c{i}.safetensors", s, num_samples=10 + i)
             for i, s in enumerate(states)]
    checkpoints = [load_checkpoint(p) for p in paths]
    assert len({c.sample_hash for c in checkpoints}) == 1
    assert len({c.content_hash for c in checkpoints}) == 4
    results = [fusekit.fuse(list(order), method) for order in itertools.permutations(paths)]
    first = results[0]
    for result in results[1:]:
        assert result.metadata == first.metadata
        assert result.state_dict.keys() == first.state_dict.keys()
        for name, value in first.state_dict.items():
            np.testing.assert_array_equal(result.state_dict[name], value, err_msg=name)
    # ties of the sample hash are broken by the full content hash, recorded in full
    assert json.loads(first.metadata["fusekit.inputs"]) == sorted(
        reference_hash(s) for s in states)


def test_provenance_records_every_input_full_sha256_in_canonical_order(tmp_path):
    states = [numpy_state(mlp(widths=(20, w, 3), seed=w)) for w in (8, 12, 10)]
    paths = [write(tmp_path / f"c{i}.safetensors", s) for i, s in enumerate(states)]
    result = fusekit.fuse(paths, "pfnm")
    by_label = {str(p): reference_hash(s) for p, s in zip(paths, states, strict=True)}
    assert json.loads(result.metadata["fusekit.inputs"]) == [
        by_label[label] for label in result.report["clients"]]
    assert result.report["clients"] == [str(paths[i]) for i in (1, 2, 0)]  # widest first


def test_a_failed_content_hash_fails_the_fusion_naming_the_file(tmp_path, monkeypatch):
    paths = [write(tmp_path / f"c{i}.safetensors", mlp(seed=i)) for i in range(3)]

    def unreadable(checkpoint):
        if checkpoint.path.name == "c1.safetensors":
            raise CheckpointError(f"{checkpoint.label}: cannot read tensor '0.weight' "
                                  "(Input/output error)")
        return reference_hash(checkpoint.state_dict())

    monkeypatch.setattr(Checkpoint, "content_hash", property(unreadable))
    with pytest.raises(CheckpointError,
                       match=r"c1\.safetensors: cannot read tensor '0\.weight' \(Input/output"):
        fusekit.fuse(paths, "pfnm")


def test_a_fusion_error_wins_and_hashing_stops(tmp_path):
    paths = [write(tmp_path / f"c{i}.safetensors", mlp(seed=i)) for i in range(3)]
    state = numpy_state(mlp(seed=3))
    state["2.weight"][1, 1] = np.nan
    paths.append(write_raw(tmp_path / "nan.safetensors", state))
    threads = threading.active_count()
    with pytest.raises(CheckpointError, match=r"nan\.safetensors: tensor '2\.weight' has 1 "
                                              r"non-finite value"):
        fusekit.fuse(paths, "pfnm")
    assert threading.active_count() == threads


def test_a_file_truncated_after_loading_is_named(tmp_path):
    paths = [write(tmp_path / f"c{i}.safetensors", mlp(seed=i)) for i in range(2)]
    checkpoints = [load_checkpoint(p) for p in paths]
    paths[1].write_bytes(paths[1].read_bytes()[:-8])  # the last tensor loses its end
    with pytest.raises(CheckpointError, match=r"c1\.safetensors: tensor '.*' is truncated"):
        fusekit.fuse(checkpoints, "pfnm")
    paths[1].unlink()
    with pytest.raises(CheckpointError,
                       match=r"c1\.safetensors: cannot read tensor '.*' \(No such file"):
        fusekit.fuse([load_checkpoint(paths[0]), checkpoints[1]], "pfnm")
