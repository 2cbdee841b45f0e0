import json
import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

import fusekit
from conftest import file_digest, mlp, write, write_raw
from fusekit.core.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from fusekit.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    NonFiniteOutputError,
    OutputError,
)


def test_round_trip_keeps_tensors_and_metadata(tmp_path):
    model = mlp()
    path = write(tmp_path / "m.safetensors", model, num_samples=12, class_counts="[4, 4, 4]")
    ckpt = load_checkpoint(path)
    assert ckpt.num_samples == 12
    np.testing.assert_array_equal(ckpt.class_counts, [4, 4, 4])
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(ckpt.tensor(name), tensor.numpy())


def test_content_hash_ignores_metadata_and_file_bytes(tmp_path):
    model = mlp()
    a = load_checkpoint(write(tmp_path / "a.safetensors", model, num_samples=1))
    b = load_checkpoint(write(tmp_path / "b.safetensors", model, num_samples=2))
    c = load_checkpoint(write(tmp_path / "c.safetensors", mlp(seed=1)))
    assert a.content_hash == b.content_hash != c.content_hash


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match=r"nope\.safetensors.*does not exist"):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_truncated_file(tmp_path):
    path = write(tmp_path / "m.safetensors", mlp())
    data = path.read_bytes()
    path.write_bytes(data[:-8])  # the header is intact, the tensor data is not
    with pytest.raises(CheckpointError, match=r"m\.safetensors: not a valid safetensors file"):
        load_checkpoint(path)


def test_file_shorter_than_header_length(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=r"tiny\.safetensors.*8-byte header.*2 bytes"):
        load_checkpoint(path)


def test_corrupt_header_json(tmp_path):
    path = tmp_path / "bad.safetensors"
    header = b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]'  # unterminated
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(CheckpointError, match=r"bad\.safetensors: not a valid safetensors file"):
        load_checkpoint(path)


def test_absurd_header_length(tmp_path):
    path = tmp_path / "huge.safetensors"
    path.write_bytes(struct.pack("<Q", 2**62) + b"{}")
    with pytest.raises(CheckpointError,
                       match=r"huge\.safetensors.*header claims 4611686018427387904 bytes; "
                             r"expected at most"):
        load_checkpoint(path)


def test_header_longer_than_file(tmp_path):
    path = tmp_path / "short.safetensors"
    path.write_bytes(struct.pack("<Q", 1000) + b"{}")
    with pytest.raises(CheckpointError, match=r"short\.safetensors: truncated.*1000 bytes, only 2"):
        load_checkpoint(path)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_tensor_is_named(tmp_path, bad):
    sd = {k: v.numpy().copy() for k, v in mlp().state_dict().items()}
    sd["2.weight"][1, 1] = bad
    ckpt = load_checkpoint(write_raw(tmp_path / "nan.safetensors", sd))
    with pytest.raises(CheckpointError, match=r"nan\.safetensors: tensor '2\.weight' has 1 "
                                              r"non-finite value.*expected finite"):
        ckpt.state_dict()


def test_integer_weights_are_refused(tmp_path):
    sd = {k: v.numpy() for k, v in mlp().state_dict().items()}
    sd["0.weight"] = sd["0.weight"].astype(np.int32)
    path = write(tmp_path / "int.safetensors", sd)
    with pytest.raises(CheckpointError, match=r"int\.safetensors: tensor '0\.weight' has dtype "
                                              r"I32; expected a floating-point weight"):
        load_checkpoint(path)


_NUM = "must be a positive integer of 1 to 15 ASCII digits"
_COUNTS = "must be a JSON list of 1 to 1000000 non-negative integer counts"


@pytest.mark.parametrize(("key", "value", "message"), [
    ("num_samples", "many", f"{_NUM}, found 'many'"),
    ("num_samples", "0", f"{_NUM}, found '0'"),
    ("num_samples", "1" + "0" * 400, _NUM),  # once an OverflowError
    ("num_samples", "1_000", _NUM),
    ("num_samples", "+5", _NUM),
    ("num_samples", " 7 ", _NUM),
    ("num_samples", "\u0667", _NUM),  # an Arabic-Indic seven: int() would take it
    ("num_samples", "1e3", _NUM),
    ("class_counts", "[1, -2]", _COUNTS),
    ("class_counts", "[1, NaN]", _COUNTS),
    ("class_counts", "[1, Infinity]", _COUNTS),
    ("class_counts", "[1, 1e400]", _COUNTS),
    ("class_counts", "[1, 2.5]", _COUNTS),
    ("class_counts", "[true, 1]", _COUNTS),
    ("class_counts", '["3", 1]', _COUNTS),
    ("class_counts", "[0, 0, 0]", _COUNTS),
    ("class_counts", "[]", _COUNTS),
    ("class_counts", "[1" + "0" * 20 + "]", _COUNTS),
    ("class_counts", "[" + "9" * 5000 + "]", "fusekit.class_counts: not JSON"),
    ("class_counts", "[" * 5000, "nested at most 64 levels deep, found 5000"),
    ("arch", "{not json", "fusekit.arch: not JSON"),
    ("arch", '{"a": ' * 3000 + "1" + "}" * 3000, "nested at most 64 levels deep, found 3000"),
    ("arch", "[1, 2]", "fusekit.arch must be a JSON object, found list"),
])
def test_malformed_metadata(tmp_path, key, value, message):
    path = write(tmp_path / "meta.safetensors", mlp(), **{key: value})
    with pytest.raises(CheckpointError, match=rf"meta\.safetensors: metadata .*{message}"):
        load_checkpoint(path)


def test_bfloat16_tensors_are_read_as_float32(tmp_path):
    import safetensors.torch
    import torch

    path = tmp_path / "bf16.safetensors"
    safetensors.torch.save_file(mlp().to(dtype=torch.bfloat16).state_dict(), path)
    ckpt = load_checkpoint(path)
    assert ckpt.tensors["0.weight"].dtype == "BF16"
    assert ckpt.tensor("0.weight").dtype == np.float32


def test_save_refuses_to_overwrite_and_force_replaces(tmp_path):
    path = write(tmp_path / "out.safetensors", mlp())
    before = file_digest(path)
    with pytest.raises(OutputError, match=r"out\.safetensors: output file exists; pass force=True"):
        save_checkpoint(path, {"w": np.zeros(2, np.float32)})
    assert file_digest(path) == before
    save_checkpoint(path, {"w": np.zeros(2, np.float32)}, force=True)
    assert list(load_checkpoint(path).tensors) == ["w"]


def test_save_into_missing_directory(tmp_path):
    with pytest.raises(OutputError, match=r"output directory .*missing does not exist"):
        save_checkpoint(tmp_path / "missing" / "f.safetensors", {"w": np.zeros(2)})


def test_failed_write_leaves_nothing_behind(tmp_path, monkeypatch):
    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "f.safetensors", {"w": np.zeros(2)})
    assert list(tmp_path.iterdir()) == []


def test_interrupted_fusion_leaves_no_output(mlp_clients, tmp_path, monkeypatch):
    def interrupted(*args, **kwargs):  # once every byte is in the temporary file
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fusekit.fuse(mlp_clients).save(tmp_path / "fused.safetensors")
    assert not (tmp_path / "fused.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_fusion_never_modifies_inputs(mlp_clients, tmp_path):
    before = [file_digest(p) for p in mlp_clients]
    fusekit.fuse(mlp_clients).save(tmp_path / "fused.safetensors")
    assert [file_digest(p) for p in mlp_clients] == before


def test_fused_output_carries_provenance(mlp_clients, tmp_path):
    path = fusekit.fuse(mlp_clients, method="avg").save(tmp_path / "fused.safetensors")
    meta = load_checkpoint(path).metadata
    hashes = sorted(load_checkpoint(p).content_hash for p in mlp_clients)
    assert sorted(json.loads(meta["fusekit.inputs"])) == hashes
    assert meta["fusekit.method"] == "avg"
    assert json.loads(meta["fusekit.params"]) == {"class_weighted": False}
    assert meta["fusekit.version"] == fusekit.__version__


def test_in_memory_checkpoint_has_same_interface():
    ckpt = Checkpoint.from_state_dict(mlp().state_dict(), {"fusekit.num_samples": "3"})
    assert ckpt.num_samples == 3
    assert ckpt.tensor("0.weight").shape == (5, 6)
    assert "memory" in ckpt.label


def test_scalar_tensors_keep_their_shape(tmp_path):
    path = save_checkpoint(tmp_path / "s.safetensors", {"n.num_batches_tracked": np.array(7)})
    assert load_checkpoint(path).tensor("n.num_batches_tracked").shape == ()


def test_outputs_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        path = save_checkpoint(tmp_path / "f.safetensors", {"w": np.zeros(2)})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o644


def test_output_path_that_is_a_directory(tmp_path):
    with pytest.raises(OutputError, match="is a directory; expected a file name"):
        save_checkpoint(tmp_path, {"w": np.zeros(2)}, force=True)


def test_in_memory_checkpoint_leaves_the_callers_arrays_writeable():
    weight = np.ones((5, 6), dtype=np.float32)
    ckpt = Checkpoint.from_state_dict({"0.weight": weight, "1.weight": np.ones((3, 5))})
    assert not ckpt.tensor("0.weight").flags.writeable
    weight[0, 0] = 2.0  # still the caller's to change


# ---- dtypes and shapes ----

@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "bfloat16"])
def test_narrow_floats_are_widened_exactly_to_float32(tmp_path, dtype):
    import safetensors.torch
    import torch

    bits = torch.arange(256, dtype=torch.uint8) if dtype != "bfloat16" else torch.arange(
        0, 65536, 97, dtype=torch.int32).to(torch.int16)
    narrow = bits.view(getattr(torch, dtype))
    path = tmp_path / "narrow.safetensors"
    safetensors.torch.save_file({"w": narrow}, path)
    ckpt = load_checkpoint(path)
    ckpt._arrays["w"] = ckpt._read("w")  # every bit pattern, NaN included, unchecked
    np.testing.assert_array_equal(ckpt._arrays["w"], narrow.float().numpy())
    assert ckpt._arrays["w"].dtype == np.float32


def test_float8_checkpoint_fuses(tmp_path):
    import safetensors.torch
    import torch

    paths = []
    for seed in range(2):
        path = tmp_path / f"f8_{seed}.safetensors"
        state = {k: v.to(torch.float8_e4m3fn) for k, v in mlp(seed=seed).state_dict().items()}
        safetensors.torch.save_file(state, path)
        paths.append(path)
    fused = fusekit.fuse(paths, method="pfnm")
    assert all(np.isfinite(a).all() for a in fused.state_dict.values())


def _raw_file(path, header: dict, data: bytes = b"") -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize(("name", "dtype", "shape", "message"), [
    ("w", "F8_E8M0", [2], r"tensor 'w' has dtype F8_E8M0; expected a floating-point weight "
                          r"\(F16, F32, F64, BF16, F8_E4M3, F8_E5M2"),
    ("w", "F4", [4], r"tensor 'w' has dtype F4; expected a floating-point weight"),
    ("w", "F32", [0, 3], r"tensor 'w' has shape \(0, 3\); expected no zero-size dimension"),
    ("w", "F32", [3, 0], r"tensor 'w' has shape \(3, 0\); expected no zero-size dimension"),
    ("bn.num_batches_tracked", "I64", [3],
     r"tensor 'bn\.num_batches_tracked' has shape \(3,\); expected a scalar counter"),
])
def test_unusable_tensors_are_refused_at_load(tmp_path, name, dtype, shape, message):
    import math

    size = {"F8_E8M0": 1, "F4": 0.5, "F32": 4, "I64": 8}[dtype] * math.prod(shape)
    path = tmp_path / "odd.safetensors"
    _raw_file(path, {name: {"dtype": dtype, "shape": shape, "data_offsets": [0, int(size)]}},
              b"\0" * int(size))
    with pytest.raises(CheckpointError, match=rf"odd\.safetensors: {message}"):
        load_checkpoint(path)


def test_negative_running_var_is_named(tmp_path):
    sd = {k: v.numpy().copy() for k, v in mlp(batchnorm=True).state_dict().items()}
    sd["1.running_var"][2] = -0.5
    ckpt = load_checkpoint(write_raw(tmp_path / "var.safetensors", sd))
    with pytest.raises(CheckpointError, match=r"var\.safetensors: tensor '1\.running_var' has 1 "
                                              r"negative value\(s\) \(smallest -0\.5\); expected"):
        ckpt.state_dict()


def test_tensor_read_under_a_memory_limit_is_reported(tmp_path):
    """A tensor that does not fit in memory: one line naming the file and tensor, not a
    Rust panic; the limit is set after the imports so only the read can hit it."""
    import subprocess
    import sys
    import textwrap

    path = tmp_path / "big.safetensors"
    safetensors.numpy.save_file({"w": np.zeros((64, 1024, 1024), np.uint8).view(np.float32)},
                                path)
    script = textwrap.dedent(f"""
        import resource
        from fusekit.core.checkpoint import load_checkpoint
        from fusekit.core.errors import CheckpointError
        ckpt = load_checkpoint({str(path)!r})
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) for l in f if l.startswith("VmSize")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (vm + (16 << 20), resource.RLIM_INFINITY))
        try:
            ckpt.tensor("w")
        except CheckpointError as exc:
            print(exc)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith(
        "big.safetensors: not enough memory to read tensor 'w' (67108864 bytes)"), done.stdout


def test_safetensors_panic_is_reported(tmp_path, monkeypatch):
    class PanicException(BaseException):  # what pyo3 raises on a Rust panic
        pass

    def panics(*args, **kwargs):
        raise PanicException("PyObject pointer is null")

    path = write(tmp_path / "m.safetensors", mlp())
    monkeypatch.setattr(safetensors, "safe_open", panics)
    with pytest.raises(CheckpointError, match=r"m\.safetensors: safetensors failed on this file "
                                              r"\(PyObject pointer is null\)"):
        load_checkpoint(path)


# ---- outputs ----

def _inputs(tmp_path):
    return [write(tmp_path / f"in{i}.safetensors", mlp(seed=i)) for i in range(2)]


@pytest.mark.parametrize("spelling", [
    lambda p: p,
    lambda p: p.parent / "." / p.name,
    lambda p: p.parent / "sub" / ".." / p.name,
    lambda p: Path(os.path.relpath(p)),
    lambda p: _link(p),
])
@pytest.mark.parametrize("force", [False, True])
def test_an_input_is_never_the_output(tmp_path, spelling, force):
    inputs = _inputs(tmp_path)
    (tmp_path / "sub").mkdir()
    before = [file_digest(p) for p in inputs]
    target = spelling(inputs[1])
    with pytest.raises(OutputError, match=r"the output is the input .*in1\.safetensors; "
                                          r"expected another path"):
        fusekit.fuse(inputs).save(target, force=force)
    with pytest.raises(OutputError, match="the output is the input"):
        save_checkpoint(target, {"w": np.zeros(2)}, force=force, inputs=inputs)
    assert [file_digest(p) for p in inputs] == before


def _link(path):
    link = path.parent / "link.safetensors"
    link.symlink_to(path)
    return link


@pytest.mark.parametrize(("make", "message"), [
    (lambda tmp: tmp, "is a directory; expected a file name for the output"),
    (lambda tmp: Path(""), "is a directory; expected a file name for the output"),
    (lambda tmp: Path("/proc/self/x.safetensors"), "x.safetensors: "),
    (lambda tmp: _fifo(tmp), "expected a regular file or a new name for the output, found a "
                             "FIFO"),
])
def test_unwritable_outputs_are_named(tmp_path, make, message):
    target = make(tmp_path)
    with pytest.raises(OutputError, match=re.escape(message)) as caught:
        save_checkpoint(target, {"w": np.zeros(2)}, force=True)
    assert "output file exists" not in str(caught.value)
    assert ".tmp" not in str(caught.value)


def _fifo(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    return tmp_path / "pipe"


def test_a_failed_write_names_the_output_not_the_temporary_file(tmp_path, monkeypatch):
    import tempfile

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / ".f.safetensors.x.tmp"))

    monkeypatch.setattr(tempfile, "mkstemp", refused)
    with pytest.raises(OutputError, match=r"f\.safetensors: cannot create the output in .* "
                                          r"\(Permission denied\)$") as caught:
        save_checkpoint(tmp_path / "f.safetensors", {"w": np.zeros(2)})
    assert ".tmp" not in str(caught.value)


def test_written_files_are_what_safetensors_reads(tmp_path):
    """Every dtype, 0-d and big-endian tensors, metadata: read back by safetensors itself."""
    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float64(2.5) * np.ones(3),
               "c": np.array(7, dtype=np.int64), "d": np.ones(5, dtype=np.float16),
               "e": np.arange(4, dtype=">f4"), "n.num_batches_tracked": np.array(3, np.int64)}
    path = save_checkpoint(tmp_path / "f.safetensors", tensors, {"k": "v"})
    with safetensors.safe_open(path, framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
        for name, value in tensors.items():
            np.testing.assert_array_equal(f.get_tensor(name), value)
            assert f.get_tensor(name).shape == value.shape
    assert len(path.read_bytes()) % 8 == sum(v.nbytes for v in tensors.values()) % 8

@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_outputs_are_never_written(tmp_path, bad):
    with pytest.raises(NonFiniteOutputError,
                       match=r"out\.safetensors: output tensor 'b' has 1 non-finite value"):
        save_checkpoint(tmp_path / "out.safetensors",
                        {"a": np.zeros(2), "b": np.array([1.0, bad], np.float32)})
    assert list(tmp_path.iterdir()) == []


def test_sigterm_during_a_write_removes_the_temporary_file(tmp_path):
    """SIGTERM arrives while the temporary file exists (sent from fsync): the process ends
    with 143 and leaves nothing in the output folder."""
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(f"""
        import os, signal
        import numpy as np
        from fusekit.core.checkpoint import save_checkpoint
        os.fsync = lambda fd: os.kill(os.getpid(), signal.SIGTERM)
        save_checkpoint({str(tmp_path / "out.safetensors")!r}, {{"w": np.zeros(1000)}})
        print("not reached")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 143, done.stderr
    assert "not reached" not in done.stdout
    assert list(tmp_path.iterdir()) == []


def test_value_check_reads_a_large_tensor_in_pieces_of_its_budget(tmp_path):
    """check_values holds about its budget, not the tensor (a service checks uploads so),
    and counts culprits across pieces: NaN/Inf in the first and last piece, negative
    variances in several."""
    import tracemalloc

    from fusekit.core.checkpoint import VALUE_CHECK_BYTES_PER_VALUE

    budget = 1 << 20
    step = budget // VALUE_CHECK_BYTES_PER_VALUE
    big = np.ones(8 * 1024 * 1024, np.float32)  # 32 MB
    path = safetensors_file(tmp_path / "big.safetensors", {"w": big})
    tracemalloc.start()
    load_checkpoint(path).check_values(budget)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * budget, peak  # the whole tensor would be 32 MB
    big[[0, -1]] = [np.nan, np.inf]
    path = safetensors_file(tmp_path / "nan.safetensors", {"w": big})
    with pytest.raises(CheckpointError, match=r"tensor 'w' has 2 non-finite value"):
        load_checkpoint(path).check_values(budget)
    var = np.ones(3 * step, np.float32)
    var[[1, step + 1, 2 * step + 1]] = [-1.0, -3.0, -2.0]
    path = safetensors_file(tmp_path / "var.safetensors", {"bn.running_var": var})
    with pytest.raises(CheckpointError, match=r"'bn\.running_var' has 3 negative value\(s\) "
                                              r"\(smallest -3\)"):
        load_checkpoint(path).check_values(budget)
    bf16 = np.full(2 * step + 5, 0x3F80, np.uint16)  # 1.0 in bfloat16
    bf16[-1] = 0x7FC0  # NaN
    path = tmp_path / "bf16.safetensors"
    text = json.dumps({"w": {"dtype": "BF16", "shape": [bf16.size],
                             "data_offsets": [0, bf16.nbytes]}}).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + bf16.tobytes())
    with pytest.raises(CheckpointError, match=r"tensor 'w' has 1 non-finite value"):
        load_checkpoint(path).check_values(budget)


def safetensors_file(path, tensors):
    path.write_bytes(safetensors.numpy.save(tensors))
    return path


def test_mapped_pieces_are_the_files_values_and_a_shortened_file_is_named(tmp_path,
                                                                          monkeypatch):
    """Pieces viewed in the file's mapped pages (any offset, BF16 widened) are the values
    tensor() reads, read-only; a file cut short after it was opened is refused by name
    before a page past its end is mapped."""
    from fusekit.core import checkpoint as module

    monkeypatch.setattr(module, "MAP_MIN_BYTES", 8)
    rng = np.random.default_rng(0)
    tensors = {"a": rng.normal(size=(37, 5)).astype(np.float32), "b": rng.normal(size=301)}
    path = safetensors_file(tmp_path / "m.safetensors", tensors)
    client = load_checkpoint(path)
    for name, expected in tensors.items():
        step = 13  # pieces of 52 or 104 bytes from odd offsets; the last one read
        pieces = list(client.pieces(name, step, np.empty(8, np.uint8), mapped=True))
        assert not any(p.flags.writeable for p in pieces[:-1])
        np.testing.assert_array_equal(np.concatenate(pieces), expected.reshape(-1))
    import safetensors.torch
    import torch

    safetensors.torch.save_file({"w": torch.randn(64, 64).to(torch.bfloat16)},
                                tmp_path / "h.safetensors")
    bf16 = load_checkpoint(tmp_path / "h.safetensors")
    whole = np.concatenate(list(bf16.pieces("w", 1000, np.empty(8, np.uint8), mapped=True)))
    np.testing.assert_array_equal(whole, bf16.tensor("w").reshape(-1))
    with open(path, "r+b") as handle:
        handle.truncate(client._offsets["b"][0] + 900)  # b's first pieces are there
    with pytest.raises(CheckpointError, match=r"m\.safetensors: tensor 'b' is truncated"):
        list(client.pieces("b", 100, np.empty(8, np.uint8), mapped=True))


def test_content_hash_streams_pieces_as_the_whole_tensors_hash(tmp_path, monkeypatch):
    """Pieces of a large tensor, 0-d counters, BF16 and held tensors hash as whole tensors."""
    import hashlib

    from fusekit.core import checkpoint as module

    rng = np.random.default_rng(0)
    tensors = {"big": rng.normal(size=(300, 7)).astype(np.float32),
               "wide": rng.normal(size=1000), "n.num_batches_tracked": np.array(3, np.int64)}
    path = safetensors_file(tmp_path / "m.safetensors", tensors)
    whole = hashlib.sha256()
    for name in sorted(tensors):
        module._hash_values(whole, name, tensors[name])
    monkeypatch.setattr(module, "HASH_PIECE_BYTES", 512)  # several pieces per tensor
    assert load_checkpoint(path).content_hash == whole.hexdigest()
    held = load_checkpoint(path)
    held.tensor("big")
    assert held.content_hash == whole.hexdigest()
    assert Checkpoint.from_state_dict(tensors).content_hash == whole.hexdigest()
