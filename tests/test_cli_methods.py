"""Every command in text and --json mode for every method; parameters declared once;
recipes and output folders."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import typer
import yaml
from typer.testing import CliRunner

import fusekit
from conftest import mlp, write
from fusekit._cli.app import app
from fusekit._cli.fuse import fuse_command, method_options
from fusekit._cli.output import handle_errors
from fusekit.core.arch import mlp_arch, validate_arch
from fusekit.core.checkpoint import load_checkpoint, save_checkpoint
from fusekit.core.errors import CheckpointError, ParameterError
from fusekit.core.spec import infer_spec
from fusekit.methods import METHODS
from fusekit.methods.base import FusionMethod
from fusekit.methods.params import method_params, parameter_reference
from fusekit.toolkit.nn import build_model

runner = CliRunner()
EVERY_METHOD = sorted(METHODS)
DOCS = Path(__file__).parents[1] / "docs" / "PARAMETERS.md"


def run(*args, cli=app):
    return runner.invoke(cli, [str(a) for a in args])


def text(result) -> str:
    return " ".join(result.output.split())


def inputs_for(method: str, mlp_clients: list[Path], tmp_path: Path) -> list[Path]:
    """The 6-5-3 MLP clients, or for fed2 three 6-5-3 Fed² clients (one class a group)."""
    if method != "fed2":
        return mlp_clients
    arch = validate_arch({**mlp_arch(6, [5], 3), "fed2": {"groups": 3, "depth": 2}})
    (tmp_path / "fed2").mkdir()
    return [write(tmp_path / "fed2" / f"client{i}.safetensors", build_model(arch, seed=i),
                  num_samples=10 + i, class_counts=str([5, 3, 2 + i]), arch=json.dumps(arch))
            for i in range(3)]


def few_steps(method: str) -> list[str]:
    """What these tests check of distill is its front door, not its training: a few
    student updates."""
    return ["--steps", "3"] if method == "distill" else []


@pytest.mark.parametrize("method", EVERY_METHOD)
@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_fuse_inspect_evaluate_every_method(mlp_clients, tmp_path, method, as_json):
    mlp_clients = inputs_for(method, mlp_clients, tmp_path)
    out = tmp_path / f"{method}.safetensors"
    flag = ["--json"] if as_json else []
    result = run("fuse", *mlp_clients, "-m", method, "-o", out, *few_steps(method), *flag)
    assert result.exit_code == 0, result.output
    if as_json:
        payload = json.loads(result.stdout)
        assert payload["method"] == method and payload["output"] == str(out)
    else:
        assert f"fused with {method}" in result.stdout
    inspected = run("inspect", out, *flag)
    assert inspected.exit_code == 0, inspected.output
    if as_json:
        (report,) = json.loads(inspected.stdout)["files"]
        assert report["problems"] == []
        widths = report["hidden_widths"]
        widening = ("pfnm", "nafi", "distill")  # distill: pfnm's width by default
        assert widths == ([[5]] * 3 if method == "ams" else widths if method in widening
                          else [5])
    else:
        assert "hidden widths" in inspected.stdout
    scored = run("evaluate", *mlp_clients, out, "--data", "synthetic", "--features", 6,
                 "--classes", 3, "--samples", 200, "--device", "cpu", *flag)
    assert scored.exit_code == 0, scored.output
    if as_json:
        scores = json.loads(scored.stdout)["scores"]
        assert method in [s["method"] for s in scores]
    else:
        assert f"fused ({method})" in scored.stdout


@pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
def test_simulate_text_and_json(tmp_path, as_json):
    result = run("simulate", "-o", tmp_path / "clients", "--clients", 2, "--epochs", 1,
                 "--arch", "mlp:8", "--device", "cpu", *(["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    assert len(list((tmp_path / "clients").glob("client_*.safetensors"))) == 2
    if as_json:
        assert len(json.loads(result.stdout)["clients"]) == 2
    else:
        assert "2 clients on digits" in text(result) and "mlp 64-8-10" in text(result)


def test_help_and_version_import_no_torch_pot_or_sklearn():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from fusekit._cli.app import app\n"
        "for args in (['--version'], ['--help'], ['fuse', '--help'], ['demo', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0, args\n"
        "print(sorted(m for m in ('torch', 'ot', 'sklearn') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "[]"


def test_verbose_after_the_command(tmp_path):
    result = run("fuse", tmp_path / "none.safetensors", "-v")
    assert result.exit_code == 2
    assert "Traceback" in result.stderr


def test_help_shows_every_declared_parameter_plainly():
    result = runner.invoke(app, ["fuse", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    help_text = result.stdout
    for placeholder in ("<bool>", "<str>", "<int>", "<float>", "<list", "{checkpoints}"):
        assert placeholder not in help_text
    assert not re.search(r" \.\s*│", help_text), "a stray ' .' at a line end"
    assert "./fused-<method>.safetensors" in help_text
    assert all(f"{name}: " in help_text for name in EVERY_METHOD)  # --method NAME's list
    assert "mask|zeros" in help_text and "[default: mask]" in help_text
    assert "[default: 5]" in help_text and "<= 1000" in help_text
    for name in EVERY_METHOD:
        for spec in method_params(METHODS[name]):
            if spec.kind != "object":
                assert spec.flag in help_text, spec.flag
    assert re.search(r"nafi / pfnm options", help_text)


def test_a_parameter_several_methods_declare_has_one_kind():
    """The CLI gives a shared name one option, typed by one declaration: a second kind would
    make the other methods' values unparsable (``--anchor c0.safetensors`` read as a float)."""
    kinds: dict[str, set[str]] = {}
    for name in EVERY_METHOD:
        for spec in method_params(METHODS[name]):
            kinds.setdefault(spec.name, set()).add(spec.kind)
    assert {name: k for name, k in kinds.items() if len(k) > 1} == {}


@pytest.mark.parametrize(("method", "params", "culprit"), [
    ("nafi", {"lam": "0.1"}, r"lam: expected a finite number >= 0, or None, found '0\.1' \(str\)"),
    ("avg", {"class_weighted": "no"}, r"class_weighted: expected a bool .*found 'no' \(str\)"),
    ("pfnm", {"width": 3.5}, r"width: expected an integer >= 1, a list of them \(one per layer\), "
                             r"or 'unlimited', or None, found 3\.5"),
    ("pfnm", {"width": "14,9"}, r"width: .* found '14,9' \(str\)"),
    ("pfnm", {"width": [14, 0]}, r"width: .* found \[14, 0\]"),
    ("pfnm", {"seed": "1"}, r"seed: expected an integer >= 0, found '1' \(str\)"),
    ("pfnm", {"seed": -1}, r"seed: expected an integer >= 0, found -1 \(int\)"),
    ("pfnm", {"seed": True}, r"seed: expected an integer >= 0, found True \(bool\)"),
    ("nafi", {"sweeps": 1001}, r"sweeps: expected an integer >= 0, <= 1000, found 1001"),
    ("pfnm", {"gamma": 0}, r"gamma: expected a finite number > 0, or None, found 0"),
    ("pfnm", {"mu0": float("nan")}, r"mu0: expected a finite number, found nan"),
    ("pfnm", {"unobserved": "zero"}, r"unobserved: expected one of 'mask', 'zeros'"),
    ("pfnm", {"sigma": [1.0, "2"]}, r"sigma: expected a finite number > 0, or one such"),
    ("ams", {"k": 1.0}, r"k: expected an integer >= 1, or None, found 1\.0 \(float\)"),
    ("ot", {"anchor": 3}, r"anchor: expected a string, or None, found 3 \(int\)"),
])
def test_api_refuses_wrong_types_choices_and_bounds(mlp_clients, method, params, culprit):
    with pytest.raises(ParameterError, match=culprit):
        fusekit.fuse(mlp_clients, method=method, **params)


def test_floats_accept_ints_and_a_path_is_not_a_list(mlp_clients):
    assert fusekit.fuse(mlp_clients, method="nafi", lam=0, sigma=[1, 2, 1]).method == "nafi"
    with pytest.raises(ParameterError, match=r"inputs: expected a list of checkpoints, found "
                                             r"one PosixPath"):
        fusekit.fuse(mlp_clients[0], method="avg")
    with pytest.raises(ParameterError, match="found one str"):
        fusekit.fuse(str(mlp_clients[0]))


def test_a_single_checkpoint_warns_once_it_is_read(mlp_clients, tmp_path, caplog):
    with caplog.at_level("WARNING"):
        fusekit.fuse(mlp_clients[:1], method="pfnm")
    assert "fusing a single checkpoint with pfnm" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"), pytest.raises(CheckpointError, match="does not exist"):
        fusekit.fuse([tmp_path / "missing.safetensors"], method="pfnm")
    assert "single checkpoint" not in caplog.text  # the error alone


def test_docs_parameter_reference_is_current():
    assert DOCS.read_text() == parameter_reference(METHODS), (
        "regenerate: python -m fusekit.methods > docs/PARAMETERS.md")


class _Plain(FusionMethod):
    """A method whose parameters are plain keyword-only arguments (no Param)."""

    name = "plain-for-test"
    summary = "returns the first client, scaled"

    def fuse(self, checkpoints, specs, *, scale: float = 1.0, rounds=2,
             mode: str = "a", flags: bool = False, per_client: float | Sequence[float] = 1.0,
             anything: Any = None):
        state = {k: checkpoints[0].tensor(k) * scale for k in checkpoints[0].tensors}
        return self.result(state, checkpoints, specs[0], {"scale": scale, "rounds": rounds,
                                                          "per_client": per_client})


@pytest.fixture
def plain_method(monkeypatch):
    monkeypatch.setitem(METHODS, _Plain.name, _Plain)
    cli = typer.Typer()
    cli.command()(handle_errors(fuse_command()))
    return cli


def test_plain_parameters_get_options_and_validation(mlp_clients, tmp_path, plain_method):
    names = {p.name for p in method_options()}
    assert {"scale", "rounds", "mode", "flags", "per_client"} <= names
    out = tmp_path / "plain.safetensors"
    result = run(*mlp_clients, "-m", _Plain.name, "--scale", 2, "--rounds", 3,
                 "--per-client", 1, "--per-client", 2, "--per-client", 3, "-o", out, "--json",
                 cli=plain_method)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    given = dict(zip(map(str, mlp_clients), [1.0, 2.0, 3.0], strict=True))
    # the method sees per-client values in the clients' canonical order
    assert summary["params"] == {"scale": 2.0, "rounds": 3, "per_client": [
        given[label] for label in summary["report"]["clients"]]}
    refused = run(*mlp_clients, "-m", _Plain.name, "--rounds", "2.5", cli=plain_method)
    assert refused.exit_code == 2
    with pytest.raises(ParameterError, match=r"rounds: expected an integer, found 2\.5"):
        fusekit.fuse(mlp_clients, method=_Plain.name, rounds=2.5)
    with pytest.raises(ParameterError, match="flags: expected a bool"):
        fusekit.fuse(mlp_clients, method=_Plain.name, flags=1)
    assert "anything" not in names  # no text spells "any value": Python only
    assert fusekit.fuse(mlp_clients, method=_Plain.name, anything=object()).method == _Plain.name


def test_recipe_file_with_command_line_override(mlp_clients, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "method": "nafi", "inputs": [p.name for p in mlp_clients],
        "parameters": {"lam": "1e-3", "sweeps": 2}, "output": "from-recipe.safetensors"}))
    result = run("fuse", "--config", recipe, "--sweeps", 3, "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["output"] == str(tmp_path / "from-recipe.safetensors")
    assert payload["params"]["lam"] == 1e-3 and payload["params"]["sweeps"] == 3
    recipe.write_text("method: avg\ninputs: [a.safetensors]\nweights: [1, 2]\n")
    refused = run("fuse", "--config", recipe)
    assert refused.exit_code == 2
    assert "unknown key 'weights'" in text(refused) and str(recipe) in text(refused)


@pytest.mark.parametrize("method", EVERY_METHOD)
def test_output_folder_and_a_loader_without_fusekit(mlp_clients, tmp_path, method,
                                                     monkeypatch):
    mlp_clients = inputs_for(method, mlp_clients, tmp_path)
    folder = tmp_path / "out"
    result = run("fuse", *mlp_clients, "-m", method, "-o", f"{folder}/", *few_steps(method),
                 "--json")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        ["fused.safetensors", "recipe.yaml", "report.json", "README.md"])
    assert json.loads((folder / "report.json").read_text()) == json.loads(result.stdout)
    card = (folder / "README.md").read_text()
    for digest in json.loads(load_checkpoint(folder / "fused.safetensors")
                             .metadata["fusekit.inputs"]):
        assert digest in card
    snippet = card.split("```python\n")[1].split("```")[0]
    assert "fusekit" not in "\n".join(line for line in snippet.splitlines()
                                      if line.startswith(("import", "from")))
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(7, 6)).astype(np.float32))
    expected = fusekit.load_fused(folder / "fused.safetensors", "cpu")(x)
    torch.testing.assert_close(_run_card_loader(folder, x, monkeypatch), expected,
                               rtol=1e-5, atol=1e-5)
    rerun = run("fuse", "--config", folder / "recipe.yaml", "-o", tmp_path / "again.safetensors")
    assert rerun.exit_code == 0, rerun.output
    again = load_checkpoint(tmp_path / "again.safetensors")
    for name in again.tensors:
        np.testing.assert_array_equal(again.tensor(name),
                                      load_checkpoint(folder / "fused.safetensors").tensor(name))


def test_an_output_folder_moved_with_its_inputs_still_reruns(tmp_path, monkeypatch):
    import shutil

    work = tmp_path / "work"
    (work / "ckpts").mkdir(parents=True)
    (work / "runs").mkdir()
    clients = [write(work / "ckpts" / f"c{i}.safetensors", mlp((6, 8, 3), seed=i),
                     num_samples=10) for i in range(2)]
    spec = work / "spec.json"
    spec.write_text(json.dumps(infer_spec(load_checkpoint(clients[0]).state_dict()).to_json()))
    monkeypatch.chdir(work)
    result = run("fuse", *clients, "-m", "pfnm", "--spec", spec, "-o", "runs/pfnm/")
    assert result.exit_code == 0, result.output
    as_run = yaml.safe_load((work / "runs/pfnm/recipe.yaml").read_text())
    assert as_run["inputs"] == ["../../ckpts/c0.safetensors", "../../ckpts/c1.safetensors"]
    assert as_run["spec"] == "../../spec.json"
    card = (work / "runs/pfnm/README.md").read_text()
    assert "| ../../ckpts/c0.safetensors |" in card and str(tmp_path) not in card
    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(work, moved)
    monkeypatch.chdir(tmp_path)
    rerun = run("fuse", "--config", moved / "runs/pfnm/recipe.yaml", "-o", "again.safetensors")
    assert rerun.exit_code == 0, rerun.output
    first = load_checkpoint(moved / "runs/pfnm/fused.safetensors")
    again = load_checkpoint(tmp_path / "again.safetensors")
    for name in first.tensors:
        np.testing.assert_array_equal(first.tensor(name), again.tensor(name))


def _run_card_loader(folder: Path, x: torch.Tensor, monkeypatch) -> torch.Tensor:
    card = (folder / "README.md").read_text()
    snippet = card.split("```python\n")[1].split("```")[0]
    monkeypatch.chdir(folder)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    return namespace["predict"](x)


@pytest.mark.parametrize("method", ["avg", "ams"])
@pytest.mark.parametrize("kind", ["mlp", "convnet"])
def test_card_loader_applies_position_aware_neurons(tmp_path, method, kind, monkeypatch):
    from fusekit.toolkit.nn import build_model, convnet_arch, mlp_arch

    pan = {"mode": "additive" if kind == "mlp" else "multiplicative", "amplitude": 0.5,
           "period": 1.0}
    arch = (mlp_arch(64, [7, 5], 3, pan=pan) if kind == "mlp"
            else convnet_arch((1, 8, 8), [4, 3], 3, hidden=[5], pan=pan))
    paths = [save_checkpoint(tmp_path / f"pan{i}.safetensors",
                             {k: v.numpy() for k, v in build_model(arch, seed=i)
                              .state_dict().items()},
                             {"fusekit.arch": json.dumps(arch), "fusekit.num_samples": "5"})
             for i in range(2)]
    folder = tmp_path / "out"
    result = run("fuse", *paths, "-m", method, "-o", f"{folder}/")
    assert result.exit_code == 0, result.output
    x = torch.from_numpy(np.random.default_rng(1).normal(size=(5, 64)).astype(np.float32))
    expected = fusekit.load_fused(folder / "fused.safetensors", "cpu")(x)
    torch.testing.assert_close(_run_card_loader(folder, x, monkeypatch), expected,
                               rtol=1e-5, atol=1e-5)


def test_an_output_folder_that_holds_an_input_is_refused_even_with_force(mlp_clients,
                                                                         tmp_path):
    hashes = [hashlib.sha256(p.read_bytes()).hexdigest() for p in mlp_clients]
    result = run("fuse", *mlp_clients, "-o", f"{tmp_path}/", "--force")
    assert result.exit_code == 2
    assert f"the output folder holds the input {mlp_clients[0]}" in text(result)
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in mlp_clients] == hashes


def test_output_names_that_are_refused_or_warned(mlp_clients, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "existing").mkdir()
    result = run("fuse", *mlp_clients, "-o", "existing")
    assert result.exit_code == 2
    assert "existing: is a directory; to write an output folder end the name with a slash" \
        in text(result)
    result = run("fuse", *mlp_clients, "-o", "")
    assert result.exit_code == 2 and "found an empty string" in text(result)
    before = sorted(p.name for p in tmp_path.iterdir())
    folder = run("fuse", *mlp_clients, "-o", "existing/")
    assert folder.exit_code == 2 and "output folder exists; pass --force" in text(folder)
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert run("fuse", *mlp_clients, "-o", "existing/", "--force").exit_code == 0
    assert (tmp_path / "existing" / "fused.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no staging folder left
    pt = run("fuse", *mlp_clients, "-o", "out.pt")
    assert pt.exit_code == 0 and "written in safetensors format" in text(pt)
    if Path("/proc/self").is_dir():  # a folder that refuses new files
        for name in ("/proc/self/x", "/proc/self/x/"):
            refused = run("fuse", *mlp_clients, "-o", name)
            assert refused.exit_code == 2
            assert re.search(rf"error: {re.escape(name)}: (cannot write the output|output "
                             "directory /proc/self is not writable)", text(refused))


def test_load_fused_keeps_the_checkpoint_tensor_names(tmp_path):
    model = torch.nn.Sequential()
    model.add_module("fc1", torch.nn.Linear(6, 5))
    model.add_module("bn1", torch.nn.BatchNorm1d(5))
    model.add_module("act", torch.nn.ReLU())
    model.add_module("fc2", torch.nn.Linear(5, 3))
    model.eval()
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    path = save_checkpoint(tmp_path / "named.safetensors", state)
    loaded = fusekit.load_fused(path, "cpu")
    assert sorted(loaded.state_dict()) == sorted(state)
    x = torch.randn(4, 6)
    torch.testing.assert_close(loaded(x), model(x))


def test_activation_options_need_activations(mlp_clients, tmp_path):
    result = run("fuse", *mlp_clients, "-m", "ot", "--activation-samples", 5,
                 "-o", tmp_path / "f.safetensors")
    assert result.exit_code == 2
    assert "need --activations" in text(result)



def test_ot_activation_recipe_reruns_from_anywhere(mlp_clients, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    np.save("inputs.npy", np.random.default_rng(2).normal(size=(30, 6)))
    result = run("fuse", *mlp_clients, "-m", "ot", "--activations", "inputs.npy",
                 "--activation-samples", 20, "--activation-seed", 3, "-o", "ot/")
    assert result.exit_code == 0, result.output
    as_run = yaml.safe_load((tmp_path / "ot" / "recipe.yaml").read_text())
    assert as_run["activations"] == {"source": "../inputs.npy", "samples": 20, "seed": 3}
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    rerun = run("fuse", "--config", "../ot/recipe.yaml", "-o", "again.safetensors", "--json")
    assert rerun.exit_code == 0, rerun.output
    assert json.loads(rerun.stdout)["report"]["cost"] == "activations"
    first = load_checkpoint(tmp_path / "ot" / "fused.safetensors")
    again = load_checkpoint("again.safetensors")
    for name in first.tensors:
        np.testing.assert_array_equal(first.tensor(name), again.tensor(name))


@pytest.mark.parametrize(("given", "widths"), [("6", [6]), ("7,", None), ("unlimited", None)])
def test_width_as_the_command_line_spells_it(mlp_clients, tmp_path, given, widths):
    result = run("fuse", *mlp_clients, "--method", "pfnm", "--width", given,
                 "-o", tmp_path / "f.safetensors", "--json")
    if given == "7,":
        assert result.exit_code == 2 and "width: expected an integer" in text(result)
        return
    assert result.exit_code == 0, result.output
    fused = json.loads(result.stdout)["widths"]
    assert fused == widths if widths else fused[0] >= 5
