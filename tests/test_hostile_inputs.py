"""The bad-input contract, one table: every hostile input below goes through the CLI
(``fusekit fuse``) and the Python API (``fusekit.fuse(...).save(...)``) for every method it
applies to, and must be refused

- from the API with the case's FusekitError subclass, from the CLI with exit code 2;
- in one line that names the culprit (file, tensor, metadata key or argument);
- with every input byte-identical and nothing new in the output folder.

Each case writes its files in the test (tiny 6-5-3 MLP clients, no binary fixtures).
Cases the project has long handled are here too, so none regresses.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

import fusekit
from conftest import mlp, numpy_state, write, write_raw
from fusekit._cli.app import app
from fusekit.core.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    FusekitError,
    IncompatibleModelsError,
    NonFiniteOutputError,
    OutputError,
    SpecError,
)

METHODS = ("avg", "pfnm", "nafi", "ot", "ams")
SAME_ARCHITECTURE = ("avg", "pfnm", "nafi", "ot")
PERMUTING = ("pfnm", "nafi", "ot")
COUNTS = [[5, 3, 2], [1, 8, 1], [0, 2, 8]]


@dataclass
class Setup:
    """What one case hands to ``fuse``: inputs, output and options (API keyword names)."""

    inputs: list[Path]
    output: Path
    force: bool = False
    spec: Path | None = None
    params: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], Setup]
    error: type[FusekitError]
    culprit: str  # a regex the one-line message must match
    methods: tuple[str, ...] = METHODS


# ---- building blocks ----

@functools.cache
def _model_state(seed: int) -> dict[str, np.ndarray]:
    return numpy_state(mlp(batchnorm=True, seed=seed))


def model_state(seed: int = 7) -> dict[str, np.ndarray]:
    """A 6-5-3 MLP with BatchNorm, as fresh writable numpy arrays (built once per seed)."""
    return {k: v.copy() for k, v in _model_state(seed).items()}


def clients(folder: Path) -> list[Path]:
    """Three healthy clients with BatchNorm, sample and class counts."""
    return [write(folder / f"client{i}.safetensors", model_state(i),
                  num_samples=sum(c), class_counts=json.dumps(c))
            for i, c in enumerate(COUNTS)]


def with_bad(make: Callable[[Path], Path]) -> Callable[[Path], Setup]:
    """Two healthy clients and the hostile file ``make`` writes."""
    return lambda folder: Setup([*clients(folder)[:2], make(folder)], folder / "out" / "f.st")


def state(**changes: Callable[[np.ndarray], np.ndarray]) -> dict[str, np.ndarray]:
    sd = model_state()
    for name, change in changes.items():
        sd[name.replace("__", ".")] = change(sd[name.replace("__", ".")])
    return sd


def bad_tensor(**changes: Callable[[np.ndarray], np.ndarray]) -> Callable[[Path], Setup]:
    return with_bad(lambda folder: write_raw(folder / "bad.safetensors", state(**changes),
                                             num_samples=10))


def bad_metadata(key: str, value: str) -> Callable[[Path], Setup]:
    metadata = {"num_samples": "10", key: value}
    return with_bad(lambda folder: write_raw(folder / "bad.safetensors", model_state(),
                                             **metadata))


def bad_file(writer: Callable[[Path], None]) -> Callable[[Path], Setup]:
    def make(folder: Path) -> Path:
        path = folder / "bad.safetensors"
        writer(path)
        return path

    return with_bad(make)


def raw_header(dtype: str, shape: list[int], nbytes: int) -> Callable[[Path], None]:
    """A file of one hand-written tensor (dtypes the writers of this test cannot make)."""
    def writer(path: Path) -> None:
        header = json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": [0, nbytes]}})
        path.write_bytes(len(header).to_bytes(8, "little") + header.encode() + b"\0" * nbytes)

    return writer


def float8_nan(path: Path) -> None:
    import safetensors.torch
    import torch

    sd = {k: torch.from_numpy(v) for k, v in model_state().items()}
    sd["0.weight"] = sd["0.weight"].to(torch.float8_e4m3fn)
    sd["0.weight"].view(torch.uint8)[0, 0] = 0x7F  # E4M3FN's NaN
    safetensors.torch.save_file(sd, path)


def zero_width(folder: Path) -> Path:
    sd = model_state()
    sd = {k: (v[:0] if k.startswith(("0.", "1.")) and v.ndim else v) for k, v in sd.items()}
    sd["3.weight"] = sd["3.weight"][:, :0]
    return write_raw(folder / "bad.safetensors", sd)


def symlink_loop(path: Path) -> None:
    path.symlink_to(path)


def output_case(output: Callable[[Path, list[Path]], Path], force: bool = True,
                ) -> Callable[[Path], Setup]:
    def build(folder: Path) -> Setup:
        inputs = clients(folder)
        return Setup(inputs, output(folder, inputs), force=force)

    return build


def link_to(target: Path) -> Path:
    link = target.parent / "out" / "link.safetensors"
    link.symlink_to(target)
    return link


def existing(folder: Path) -> Path:
    path = folder / "out" / "old.safetensors"
    path.write_bytes(b"an earlier result")
    return path


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def spec_case(writer: Callable[[Path], None]) -> Callable[[Path], Setup]:
    def build(folder: Path) -> Setup:
        setup = Setup(clients(folder), folder / "out" / "f.st", spec=folder / "spec.json")
        writer(setup.spec)
        return setup

    return build


def with_params(build: Callable[[Path], Setup], **params: Any) -> Callable[[Path], Setup]:
    def wrapped(folder: Path) -> Setup:
        setup = build(folder)
        setup.params.update(params)
        return setup

    return wrapped


def float16_overflow(folder: Path) -> Setup:
    """Finite float16 clients whose folded BatchNorm (variance 0) pushes weights past the
    float16 range: the fused tensor would hold Inf."""
    inputs = []
    for i in range(2):
        sd = {k: v.astype(np.float16) if v.dtype.kind == "f" else v
              for k, v in model_state(i).items()}
        sd["1.running_var"][:] = 0
        sd["0.weight"] *= 1000
        inputs.append(write_raw(folder / f"half{i}.safetensors", sd, num_samples=5))
    return Setup(inputs, folder / "out" / "f.st")


def different_inputs(folder: Path) -> Setup:
    return Setup([write(folder / "wide.safetensors", mlp(widths=(64, 5, 3), seed=0)),
                  write(folder / "narrow.safetensors", mlp(widths=(60, 5, 3), seed=1))],
                 folder / "out" / "f.st")


NUM = r"bad\.safetensors: metadata fusekit\.num_samples must be a positive integer"
COUNTS_MSG = r"bad\.safetensors: metadata fusekit\.class_counts must be a JSON list"
DEEP = "[" * 5000
PAN = json.dumps({"type": "mlp", "in_features": 6, "hidden": [5], "out_features": 3,
                  "batchnorm": True, "pan": {"mode": "additive", "amplitude": 0.1, "period": 1}})

CASES = [
    # -- files --
    Case("missing-file", with_bad(lambda f: f / "missing.safetensors"), CheckpointNotFoundError,
         r"missing\.safetensors: checkpoint file does not exist"),
    Case("directory", with_bad(lambda f: (f / "dir.safetensors").mkdir() or
                               f / "dir.safetensors"),
         CheckpointNotFoundError,
         r"dir\.safetensors: a folder without config\.json; expected a \.safetensors file "
         r"or a Hugging Face model folder"),
    Case("fifo", bad_file(fifo), CheckpointNotFoundError,
         r"bad\.safetensors: cannot read the checkpoint file: expected a regular file, found a "
         r"FIFO"),
    Case("dev-zero", with_bad(lambda f: Path("/dev/zero")), CheckpointNotFoundError,
         r"/dev/zero: cannot read the checkpoint file: expected a regular file, found a "
         r"character device"),
    Case("symlink-loop", bad_file(symlink_loop), CheckpointNotFoundError,
         r"bad\.safetensors: cannot read the checkpoint file: found a symlink loop"),
    Case("garbage", bad_file(lambda p: p.write_bytes(b"\xff" * 64)), CheckpointError,
         r"bad\.safetensors: safetensors header claims \d+ bytes; expected at most"),
    Case("short", bad_file(lambda p: p.write_bytes(b"\1\2")), CheckpointError,
         r"bad\.safetensors: not a valid safetensors file \(expected an 8-byte header"),
    Case("truncated", bad_file(lambda p: p.write_bytes(
        write(p.with_suffix(".tmp"), model_state()).read_bytes()[:-8])), CheckpointError,
        r"bad\.safetensors: not a valid safetensors file"),
    Case("bad-header-json", bad_file(lambda p: p.write_bytes(b"\x05" + b"\0" * 7 + b"{oops")),
         CheckpointError, r"bad\.safetensors: not a valid safetensors file"),
    # -- tensors --
    Case("nan-weight", bad_tensor(**{"0__bias": lambda a: np.where(np.arange(5) == 0, np.nan, a)}),
         CheckpointError, r"bad\.safetensors: tensor '0\.bias' has 1 non-finite value"),
    Case("inf-weight", bad_tensor(**{"3__weight": lambda a: a * np.inf}), CheckpointError,
         r"bad\.safetensors: tensor '3\.weight' has 15 non-finite value"),
    Case("integer-weight", bad_tensor(**{"3__weight": lambda a: a.astype(np.int64)}),
         CheckpointError, r"bad\.safetensors: tensor '3\.weight' has dtype I64; expected a "
                          r"floating-point weight"),
    Case("float8-nan", bad_file(float8_nan), CheckpointError,
         r"bad\.safetensors: tensor '0\.weight' has 1 non-finite value"),
    Case("float8-e8m0", bad_file(raw_header("F8_E8M0", [2, 2], 4)), CheckpointError,
         r"bad\.safetensors: tensor 'w' has dtype F8_E8M0; expected a floating-point weight"),
    Case("negative-running-var",
         bad_tensor(**{"1__running_var": lambda a: np.where(np.arange(5) == 2, -0.5, a)}),
         CheckpointError, r"bad\.safetensors: tensor '1\.running_var' has 1 negative value"),
    Case("counter-not-scalar",
         bad_tensor(**{"1__num_batches_tracked": lambda a: np.array([1, 2, 3])}),
         CheckpointError, r"bad\.safetensors: tensor '1\.num_batches_tracked' has shape \(3,\); "
                          r"expected a scalar counter"),
    Case("zero-width-layer", with_bad(zero_width), CheckpointError,
         r"bad\.safetensors: tensor '0\.bias' has shape \(0,\); expected no zero-size dimension"),
    Case("zero-inputs", bad_tensor(**{"0__weight": lambda a: a[:, :0]}), CheckpointError,
         r"bad\.safetensors: tensor '0\.weight' has shape \(5, 0\); expected no zero-size"),
    Case("other-architecture",
         with_bad(lambda f: write(f / "deep.safetensors", mlp(widths=(6, 5, 5, 3)))),
         IncompatibleModelsError, r"architectures cannot be fused: .*deep\.safetensors has 3",
         SAME_ARCHITECTURE),
    Case("position-aware", bad_metadata("arch", PAN), IncompatibleModelsError,
         r"bad\.safetensors: trained with position-aware neurons", PERMUTING),
    Case("ams-different-inputs", different_inputs, IncompatibleModelsError,
         r"(narrow|wide)\.safetensors takes 6[04] input values per sample but .*"
         r"(wide|narrow)\.safetensors takes 6[04]; AMS needs",
         ("ams",)),
    Case("float16-overflow", float16_overflow, NonFiniteOutputError,
         r"f\.st: output tensor '0\.weight' has \d+ non-finite value", PERMUTING),
    # -- metadata --
    Case("num-samples-huge", bad_metadata("num_samples", "1" + "0" * 400), CheckpointError, NUM),
    Case("num-samples-underscore", bad_metadata("num_samples", "1_000"), CheckpointError, NUM),
    Case("num-samples-sign", bad_metadata("num_samples", "+5"), CheckpointError, NUM),
    Case("num-samples-spaces", bad_metadata("num_samples", " 7 "), CheckpointError, NUM),
    Case("num-samples-arabic-indic", bad_metadata("num_samples", "\u0667"), CheckpointError, NUM),
    Case("num-samples-zero", bad_metadata("num_samples", "0"), CheckpointError, NUM),
    Case("class-counts-nan", bad_metadata("class_counts", "[1, NaN, 2]"), CheckpointError,
         COUNTS_MSG),
    Case("class-counts-infinity", bad_metadata("class_counts", "[1, Infinity, 2]"),
         CheckpointError, COUNTS_MSG),
    Case("class-counts-1e400", bad_metadata("class_counts", "[1, 1e400, 2]"), CheckpointError,
         COUNTS_MSG),
    Case("class-counts-bool", bad_metadata("class_counts", "[true, 1, 2]"), CheckpointError,
         COUNTS_MSG),
    Case("class-counts-string", bad_metadata("class_counts", '["1", 1, 2]'), CheckpointError,
         COUNTS_MSG),
    Case("class-counts-zeros", bad_metadata("class_counts", "[0, 0, 0]"), CheckpointError,
         COUNTS_MSG),
    Case("class-counts-negative", bad_metadata("class_counts", "[1, -2, 2]"), CheckpointError,
         COUNTS_MSG),
    Case("class-counts-deep", bad_metadata("class_counts", DEEP), CheckpointError,
         r"bad\.safetensors: metadata fusekit\.class_counts: expected JSON nested at most 64 "
         r"levels deep, found 5000"),
    Case("class-counts-wrong-length",
         with_params(bad_metadata("class_counts", "[1, 2]"), class_weighted=True),
         IncompatibleModelsError, r"bad\.safetensors: fusekit\.class_counts has 2 entries; "
                                  r"expected 3", ("avg",)),
    Case("arch-not-json", bad_metadata("arch", "{oops"), CheckpointError,
         r"bad\.safetensors: metadata fusekit\.arch: not JSON"),
    Case("arch-deep", bad_metadata("arch", '{"a":' * 3000 + "1" + "}" * 3000), CheckpointError,
         r"bad\.safetensors: metadata fusekit\.arch: expected JSON nested at most 64 levels"),
    # -- spec files --
    Case("spec-deep", spec_case(lambda p: p.write_text(DEEP)), SpecError,
         r"spec\.json: spec file: expected JSON nested at most 64 levels deep, found 5000"),
    Case("spec-fifo", spec_case(lambda p: fifo(p)), SpecError,
         r"spec\.json: cannot read the spec file: expected a regular file, found a FIFO"),
    Case("spec-missing", spec_case(lambda p: None), SpecError,
         r"spec\.json: spec file does not exist"),
    # -- outputs --
    Case("output-is-input", output_case(lambda f, ins: ins[1]), OutputError,
         r"client1\.safetensors: the output is the input .*client1\.safetensors"),
    Case("output-is-input-other-spelling",
         output_case(lambda f, ins: f / "out" / ".." / ins[0].name), OutputError,
         r"client0\.safetensors: the output is the input .*client0\.safetensors"),
    Case("output-is-link-to-input", output_case(lambda f, ins: link_to(ins[2])), OutputError,
         r"link\.safetensors: the output is the input .*client2\.safetensors"),
    Case("output-is-input-without-force", output_case(lambda f, ins: ins[0], force=False),
         OutputError, r"client0\.safetensors: the output is the input"),
    Case("output-exists", output_case(lambda f, ins: existing(f), force=False), OutputError,
         r"old\.safetensors: output file exists; pass (force=True|--force) to"),
    Case("output-is-directory", output_case(lambda f, ins: f / "out"), OutputError,
         r"out: is a directory; (expected a file name|to write an output folder)"),
    Case("output-folder-missing", output_case(lambda f, ins: f / "nowhere" / "f.st"),
         OutputError, r"f\.st: output directory .*nowhere does not exist"),
    Case("output-is-fifo", output_case(lambda f, ins: fifo(f / "out" / "pipe")), OutputError,
         r"pipe: expected a regular file or a new name for the output, found a FIFO"),
    Case("output-in-proc", output_case(lambda f, ins: Path("/proc/self/x.safetensors")),
         OutputError, r"^/proc/self/x\.safetensors: "),
]


def _cli_flags(setup: Setup) -> list[str]:
    flags = ["--force"] if setup.force else []
    if setup.spec is not None:
        flags += ["--spec", str(setup.spec)]
    for name, value in setup.params.items():
        flags += [f"--{name.replace('_', '-')}"] if value is True else [f"--{name}", str(value)]
    return flags


def snapshot(folder: Path) -> dict[str, str]:
    """Every regular file under ``folder`` (FIFOs, devices and loops are never opened)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    (tmp_path / "out").mkdir()
    return tmp_path


def _refused(case: Case, workdir: Path, run: Callable[[Setup], str]) -> None:
    setup = case.build(workdir)
    before = snapshot(workdir)
    message = run(setup)
    assert "\n" not in message.strip(), message
    assert re.search(case.culprit, message), message
    assert snapshot(workdir) == before  # inputs unchanged, nothing new anywhere under here


def _cases():
    return [pytest.param(case, method, id=f"{case.id}-{method}")
            for case in CASES for method in case.methods]


@pytest.mark.parametrize(("case", "method"), _cases())
def test_api_refuses(case: Case, method: str, workdir: Path) -> None:
    def run(setup: Setup) -> str:
        with pytest.raises(case.error) as caught:
            result = fusekit.fuse(setup.inputs, method=method, spec=setup.spec,
                                  **setup.params)
            result.save(setup.output, force=setup.force)
        return str(caught.value)

    _refused(case, workdir, run)


@pytest.mark.parametrize(("case", "method"), _cases())
def test_cli_refuses(case: Case, method: str, workdir: Path) -> None:
    def run(setup: Setup) -> str:
        args = ["fuse", *map(str, setup.inputs), "--method", method, "-o", str(setup.output),
                *_cli_flags(setup)]
        return _cli_error(CliRunner().invoke(app, args))

    _refused(case, workdir, run)


def _cli_error(result: Any) -> str:
    """The CLI's one error line (exit 2), without its "error: " prefix."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr  # other lines may be logged warnings
    assert result.stderr.rstrip().endswith(errors[0]), result.stderr  # nothing after it
    return errors[0].removeprefix("error: ")


FILE_CASES = [pytest.param(case, id=case.id) for case in CASES
              if case.error in (CheckpointError, CheckpointNotFoundError)]


@pytest.mark.parametrize("case", FILE_CASES)
def test_inspect_reports(case: Case, workdir: Path) -> None:
    """``inspect`` lists a file's problems (exit 2) instead of failing on them."""
    def run(setup: Setup) -> str:
        result = CliRunner().invoke(app, ["inspect", str(setup.inputs[-1]), "--json"])
        assert result.exit_code == 2, (result.exit_code, result.output)
        [report] = json.loads(result.stdout)["files"]
        assert len(report["problems"]) == 1, report
        return report["problems"][0]

    _refused(case, workdir, run)


@pytest.mark.parametrize("case", FILE_CASES)
def test_evaluate_refuses(case: Case, workdir: Path) -> None:
    def run(setup: Setup) -> str:
        args = ["evaluate", str(setup.inputs[-1]), "--data", "synthetic", "--samples", "60",
                "--features", "6", "--classes", "3", "--device", "cpu"]
        return _cli_error(CliRunner().invoke(app, args))

    _refused(case, workdir, run)


def test_stdin_as_a_checkpoint_is_named(workdir: Path) -> None:
    """``/dev/stdin`` given a pipe, through the installed command in its own process."""
    import subprocess
    import sys

    inputs = clients(workdir)
    before = snapshot(workdir)
    done = subprocess.run(
        [sys.executable, "-m", "fusekit", "fuse", *map(str, inputs), "/dev/stdin",
         "-o", str(workdir / "out" / "f.st")],
        input=b"not a checkpoint", capture_output=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert done.stderr.decode().strip() == (
        "error: /dev/stdin: cannot read the checkpoint file: expected a regular file, found a "
        "FIFO (named pipe)")
    assert snapshot(workdir) == before


# ---- data folders and files (``--data-dir``, ``--data-path``) ----

class _Executes:
    """Unpickling this would create the file ``target``."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (open, (self.target, "w"))


def cifar_folder(folder: Path) -> dict[str, Any]:
    import pickle

    data = folder / "cifar"
    data.mkdir()
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        (data / name).write_bytes(pickle.dumps({b"data": _Executes(folder / "pwned"),
                                                b"labels": [0]}))
    return {"name": "cifar10", "data_dir": data}


def npz_file(content: bytes) -> Callable[[Path], dict[str, Any]]:
    def build(folder: Path) -> dict[str, Any]:
        (folder / "bad.npz").write_bytes(content)
        return {"name": "npz", "path": folder / "bad.npz"}

    return build


DATA_CASES = [
    pytest.param(cifar_folder, r"data_batch_1: not a CIFAR-10 python batch \(refused global "
                               r"(builtins|_?io)\.open", id="cifar-code-execution"),
    pytest.param(npz_file(b"PK\3\4" + b"\0" * 60), r"bad\.npz: not a readable \.npz file",
                 id="npz-corrupt-zip"),
    pytest.param(npz_file(b"\x93NUMPY garbage"), r"bad\.npz: not a readable \.npz file",
                 id="npz-garbage"),
]


@pytest.mark.parametrize(("build", "culprit"), DATA_CASES)
@pytest.mark.parametrize("front", ["api", "cli"])
def test_data_refused(build, culprit: str, front: str, workdir: Path) -> None:
    from fusekit.core.errors import DataError
    from fusekit.toolkit.data import load_dataset

    source = build(workdir)
    before = snapshot(workdir)
    if front == "api":
        with pytest.raises(DataError) as caught:
            load_dataset(source["name"], data_dir=source.get("data_dir"),
                         path=source.get("path"))
        message = str(caught.value)
    else:
        flags = (["--data-dir", str(source["data_dir"])] if "data_dir" in source
                 else ["--data-path", str(source["path"])])
        checkpoint = clients(workdir)[0]
        before = snapshot(workdir)
        message = _cli_error(CliRunner().invoke(
            app, ["evaluate", str(checkpoint), "--data", source["name"], *flags]))
    assert "\n" not in message and re.search(culprit, message), message
    assert snapshot(workdir) == before
    assert not (workdir / "pwned").exists()
