import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from typer.testing import CliRunner

import fusekit
from conftest import file_digest, mlp, write, write_raw
from fusekit._cli.app import app
from fusekit.core.checkpoint import load_checkpoint
from fusekit.core.errors import OutputError, ParameterError

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def test_version_reports_the_core():
    result = run("--version")
    assert result.exit_code == 0
    assert "C++ core: loaded" in result.stdout


def test_fuse_end_to_end(mlp_clients, tmp_path):
    out = tmp_path / "fused.safetensors"
    result = run("fuse", *mlp_clients, "--method", "avg", "-o", out)
    assert result.exit_code == 0, result.output
    assert "fused with avg" in result.stdout
    assert load_checkpoint(out).metadata["fusekit.method"] == "avg"


def test_fuse_json_is_clean_on_stdout(mlp_clients, tmp_path):
    out = tmp_path / "fused.safetensors"
    result = run("fuse", *mlp_clients, "-o", out, "--json", "--class-weighted")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert payload["output"] == str(out)
    assert payload["params"] == {"class_weighted": True}
    assert payload["widths"] == [5]


def test_default_output_name(mlp_clients, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run("fuse", *mlp_clients).exit_code == 0
    assert (tmp_path / "fused-avg.safetensors").is_file()


def test_existing_output_needs_force(mlp_clients, tmp_path):
    out = tmp_path / "fused.safetensors"
    assert run("fuse", *mlp_clients, "-o", out).exit_code == 0
    before = file_digest(out)
    result = run("fuse", *mlp_clients[:2], "-o", out)
    assert result.exit_code == 2
    assert "output file exists; pass --force" in result.stderr
    assert file_digest(out) == before
    assert run("fuse", *mlp_clients[:2], "-o", out, "--force").exit_code == 0
    assert file_digest(out) != before


def test_errors_name_the_options_where_the_api_names_keywords(mlp_clients, tmp_path):
    """``--width-ratio``, not ``width_ratio``; ``--force``, not ``force=True``; an option is
    left out, never None. From Python the same errors say the keyword arguments."""
    out = tmp_path / "fused.safetensors"
    ratio = run("fuse", *mlp_clients, "--method", "pfnm", "--width-ratio", "0.5", "-o", out)
    assert ratio.exit_code == 2
    assert ratio.stderr.strip().splitlines()[-1] == (
        "error: --width-ratio: expected a finite number >= 1, found 0.5 (float)")
    both = run("fuse", *mlp_clients, "--method", "pfnm", "--width", "10", "--width-ratio",
               "1.5", "-o", out)
    assert "error: --width and --width-ratio: expected one of them, found both" in both.stderr
    other = run("fuse", *mlp_clients, "--method", "avg", "--width-ratio", "2", "-o", out)
    assert other.stderr.strip().splitlines()[-1] == (
        "error: method 'avg' does not take parameter(s) --width-ratio; it takes: "
        "--class-weighted")
    with pytest.raises(ParameterError, match=r"^width_ratio: expected a finite number >= 1, "
                                             r"or None, found 0\.5"):
        fusekit.fuse(mlp_clients, method="pfnm", width_ratio=0.5)
    assert run("fuse", *mlp_clients, "-o", out).exit_code == 0
    again = run("fuse", *mlp_clients, "-o", out)
    assert again.exit_code == 2
    assert again.stderr.strip().endswith("output file exists; pass --force to replace it")
    with pytest.raises(OutputError, match="output file exists; pass force=True to replace it"):
        fusekit.fuse(mlp_clients).save(out)


def test_help_lists_each_command_on_one_line():
    """The command list shows each docstring's first paragraph whole, on one line where the
    terminal is wide enough: no line break from the docstring cuts it mid-sentence."""
    shown = subprocess.run([sys.executable, "-m", "fusekit", "--help"], capture_output=True,
                           text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert shown.returncode == 0, shown.stderr
    panel = shown.stdout[shown.stdout.index("─ Commands ─"):].splitlines()[1:]
    rows = [line[2:].rstrip("│ ") for line in panel if line.startswith("│ ")]
    assert len(rows) >= 15
    continued = [row for row in rows if row.startswith(" ")]  # no command name: a wrapped line
    assert not continued, continued
    assert any(row.startswith("stats ") and row.endswith("(its training inputs).")
               for row in rows)


def _corrupt(tmp_path):
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(b"\xff" * 64)
    return path


def _nan(tmp_path):
    sd = {k: v.numpy().copy() for k, v in mlp(batchnorm=True).state_dict().items()}
    sd["0.bias"][0] = np.nan
    return write_raw(tmp_path / "nan.safetensors", sd)


def _other_arch(tmp_path):
    return write(tmp_path / "deep.safetensors", mlp(widths=(6, 5, 5, 3), batchnorm=True))


def _int_weights(tmp_path):
    sd = {k: v.numpy() for k, v in mlp(batchnorm=True).state_dict().items()}
    sd["3.weight"] = sd["3.weight"].astype(np.int64)
    return write(tmp_path / "int.safetensors", sd)


@pytest.mark.parametrize(("make_bad", "message"), [
    (lambda tmp: tmp / "missing.safetensors",
     r"missing\.safetensors: checkpoint file does not exist"),
    (_corrupt, r"corrupt\.safetensors: safetensors header claims \d+ bytes; expected at most"),
    (_nan, r"nan\.safetensors: tensor '0\.bias' has 1 non-finite value"),
    (_other_arch, r"architectures cannot be fused: .* has 2 layers, .*deep\.safetensors has 3"),
    (_int_weights, r"int\.safetensors: tensor '3\.weight' has dtype I64; expected a floating"),
])
def test_bad_input_exits_2_and_leaves_nothing(mlp_clients, tmp_path, make_bad, message):
    import re

    bad = make_bad(tmp_path)
    before = [file_digest(p) for p in mlp_clients]
    out = tmp_path / "fused.safetensors"
    result = run("fuse", *mlp_clients, bad, "-o", out)
    assert result.exit_code == 2, result.output
    assert re.search(message, " ".join(result.stderr.split())), result.stderr
    assert not out.exists()
    assert [file_digest(p) for p in mlp_clients] == before


def test_unknown_method(mlp_clients, tmp_path):
    result = run("fuse", *mlp_clients, "-m", "magic", "-o", tmp_path / "f.safetensors")
    assert result.exit_code == 2
    assert "unknown fusion method 'magic'; choose one of: " in result.stderr
    assert "avg" in result.stderr


def test_output_directory_missing(mlp_clients, tmp_path):
    result = run("fuse", *mlp_clients, "-o", tmp_path / "nowhere" / "f.safetensors")
    assert result.exit_code == 2
    assert "output directory" in result.stderr and "nowhere does not exist" in result.stderr


def test_mismatched_shapes_for_avg(mlp_clients, tmp_path):
    wide = write(tmp_path / "wide.safetensors", mlp(widths=(6, 8, 3), batchnorm=True))
    result = run("fuse", mlp_clients[0], wide, "-o", tmp_path / "f.safetensors")
    assert result.exit_code == 2
    assert "'avg' needs equal shapes" in " ".join(result.stderr.split())


def test_inspect_shows_layers_and_groups(mlp_clients):
    result = run("inspect", mlp_clients[0])
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert "hidden widths: [5]" in text
    assert "permutation group 0" in text
    assert "fusekit.num_samples" in text


def test_inspect_json_reports_what_blocks_fusion(mlp_clients, tmp_path):
    deep = _other_arch(tmp_path)
    corrupt = _corrupt(tmp_path)
    result = run("inspect", mlp_clients[0], deep, corrupt, "--json")
    assert result.exit_code == 2
    payload = json.loads(result.stdout)
    assert payload["fusable_together"] is False
    assert "architectures cannot be fused" in payload["problem"]
    assert "header claims" in payload["files"][2]["problems"][0]
    assert payload["files"][0]["hidden_widths"] == [5]


def test_verbose_shows_traceback(tmp_path):
    result = runner.invoke(app, ["-v", "fuse", str(tmp_path / "none.safetensors")])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr


def test_error_text_with_brackets_is_printed_verbatim(tmp_path):
    result = run("fuse", tmp_path / "[/bold]x.safetensors")
    assert result.exit_code == 2
    assert "[/bold]x.safetensors: checkpoint file does not exist" in result.stderr


def test_inspect_names_what_limits_a_pan_checkpoint(tmp_path):
    import torch

    sd = {**mlp(batchnorm=True).state_dict(), "2.encoding": torch.ones(5)}
    path = write(tmp_path / "pan.safetensors", sd)
    result = run("inspect", path, "--json")
    assert result.exit_code == 0, result.output
    (limit,) = json.loads(result.stdout)["files"][0]["limits"]
    assert "position-aware neurons" in limit and "--method avg" in limit


def test_job_without_a_token_names_every_way_to_give_one(monkeypatch):
    monkeypatch.delenv("FUSEKIT_ADMIN_TOKEN", raising=False)
    monkeypatch.delenv("FUSEKIT_ADMIN_TOKEN_FILE", raising=False)
    result = run("job", "status", "0" * 32)
    assert result.exit_code == 2
    assert all(way in result.stderr for way in
               ("FUSEKIT_ADMIN_TOKEN,", "FUSEKIT_ADMIN_TOKEN_FILE", "--admin-token-file"))
    assert len(result.stderr.strip().splitlines()) == 1


class _Trap:
    """Unpickling this writes a file: proof that a pickle was loaded."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
def test_torch_files_are_named_with_a_conversion_never_unpickled(tmp_path, legacy):
    import shlex
    import subprocess
    import sys

    import torch

    model = tmp_path / "model.pt"
    marker = tmp_path / "unpickled"
    torch.save({"w": torch.ones(3, 2), "trap": _Trap(marker)}, model,
               _use_new_zipfile_serialization=not legacy)
    result = run("fuse", model, model, "-o", tmp_path / "out.safetensors")
    assert result.exit_code == 2 and not marker.exists()
    line = result.stderr.strip().replace("\n", "")
    assert "model.pt: a torch.save (zip) or pickle file, not safetensors" in line
    assert "header claims" not in line
    command = shlex.split(line.split("Convert a state_dict with: ")[1])
    torch.save({"w": torch.ones(3, 2)}, model, _use_new_zipfile_serialization=not legacy)
    subprocess.run([sys.executable, *command[1:]], check=True, timeout=120)
    assert load_checkpoint(tmp_path / "model.safetensors").tensor("w").shape == (3, 2)


def test_the_conversion_of_a_renamed_torch_file_writes_beside_it(tmp_path):
    import shlex
    import subprocess
    import sys

    import torch

    model = tmp_path / "model.safetensors"  # a torch.save file under a safetensors name
    torch.save({"w": torch.ones(3, 2)}, model)
    before = file_digest(model)
    result = run("fuse", model, model, "-o", tmp_path / "out.safetensors")
    assert result.exit_code == 2
    line = result.stderr.strip().replace("\n", "")
    command = shlex.split(line.split("Convert a state_dict with: ")[1])
    subprocess.run([sys.executable, *command[1:]], check=True, timeout=120, cwd=tmp_path)
    assert file_digest(model) == before  # the input, untouched
    converted = load_checkpoint(tmp_path / "model.converted.safetensors")
    assert converted.tensor("w").shape == (3, 2)


def test_plain_pickles_are_named_never_unpickled(tmp_path):
    import pickle

    path = tmp_path / "weights.pkl"
    marker = tmp_path / "unpickled"
    path.write_bytes(pickle.dumps({"trap": _Trap(marker)}, protocol=4))
    result = run("inspect", path)
    assert result.exit_code == 2 and not marker.exists()
    # Rich wraps the line where the terminal ends, inside a word too: compare without spaces.
    assert "weights.pkl:atorch.save(zip)orpicklefile" in "".join(result.stdout.split())


def test_summary_shows_the_widths_delivered_never_none(tmp_path):
    clients = [write(tmp_path / f"c{i}.safetensors", mlp((6, 8, 7, 3), seed=i), num_samples=10)
               for i in range(3)]
    shown = run("fuse", *clients, "-m", "pfnm", "-o", tmp_path / "a.safetensors")
    assert shown.exit_code == 0, shown.output
    as_json = run("fuse", *clients, "-m", "pfnm", "-o", tmp_path / "b.safetensors", "--json")
    widths = json.loads(as_json.stdout)["widths"]
    text = " ".join(shown.stdout.split()).replace("│ │ ", "")
    assert f"width={widths[0]},{widths[1]}" in text
    assert "None" not in shown.stdout and "width_ratio" not in shown.stdout
    assert "sigma=auto" in text
    asked = run("fuse", *clients, "-m", "pfnm", "--width", "9", "-o", tmp_path / "c.safetensors")
    assert "width=9" in asked.stdout and "width_ratio=auto" in asked.stdout


@pytest.mark.parametrize("columns", [80, 100])
def test_fuse_help_keeps_every_metavar_whole(columns):
    import click
    import typer.main

    result = runner.invoke(app, ["fuse", "--help"], env={"COLUMNS": str(columns)})
    assert result.exit_code == 0
    assert "Usage: fusekit fuse [OPTIONS] [CHECKPOINTS...]" in result.stdout
    group = typer.main.get_command(app)
    command = group.resolve_command(click.Context(group), ["fuse"])[1]
    metavars = {p.metavar for p in command.params if p.metavar}
    assert {"NAME", "N|N1,N2,...", "top1|topk|full"} <= metavars
    for metavar in metavars:
        assert metavar in result.stdout, metavar


# What only running a command may import: `fusekit --help` and each command's help start
# in a fraction of a second (`fuse --help` needs the methods' declarations, so SciPy).
HEAVY = ("torch", "scipy", "ot", "sklearn", "fusekit.methods", "fusekit.api", "fastapi",
         "flwr")


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["job", "--help"],
                                  ["inspect", "--help"], ["simulate", "--help"],
                                  ["calibrate", "--help"],
                                  ["fuse", "--help"]])
def test_help_imports_nothing_heavy(args):
    import subprocess
    import sys

    code = ("import atexit, sys\n"
            "atexit.register(lambda: print('loaded:', *sorted(m for m in "
            f"{HEAVY!r} if m in sys.modules)))\n"
            f"sys.argv = ['fusekit', *{args!r}]\n"
            "from fusekit._cli.app import main\n"
            "main()\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    loaded = result.stdout.rsplit("loaded:", 1)[1].split()
    assert loaded == (["fusekit.methods"] if args[0] == "fuse" else [])


def test_startup_benchmark_runs(tmp_path):
    from bench_cli import main

    json_out = tmp_path / "cli.json"
    assert main(["--runs", "1", "--no-write", "--json-out", str(json_out)]) == 0
    times = json.loads(json_out.read_text())["times"]
    assert len(times) == 5 and all(len(t) == 1 and t[0] > 0 for t in times.values())


@pytest.mark.parametrize(("method", "steps"), [("avg", "tensors averaged"),
                                               ("pfnm", "layers matched"),
                                               ("ot", "layers aligned")])
def test_fuse_shows_its_steps_on_stderr_when_not_a_terminal(mlp_clients, tmp_path, monkeypatch,
                                                            method, steps):
    from fusekit._cli import output

    monkeypatch.setattr(output, "PROGRESS_AFTER_S", 0.0)  # every fusion is long enough here
    monkeypatch.setattr(output, "PLAIN_EVERY_S", 0.0)
    result = run("fuse", *mlp_clients, "-m", method, "-o", tmp_path / "out.safetensors")
    assert result.exit_code == 0, result.output
    lines = [line for line in result.stderr.splitlines() if steps in line]
    assert lines and lines[-1].startswith(f"fusing with {method}: "), result.stderr
    done, total = map(int, lines[-1].split(": ")[1].split(" ")[0:3:2])
    assert done == total > 0
    from fusekit.core import progress  # the CLI's listener is gone after the fusion

    assert not progress.LOGGER.handlers and progress.LOGGER.propagate


def test_piped_commands_print_plain_progress_lines_on_stderr(tmp_path, monkeypatch):
    """Not on a terminal (here: captured), simulate, evaluate and demo say how far they have
    got in plain lines on stderr, through the one helper fuse uses; stdout keeps only the
    result."""
    from fusekit._cli import output

    monkeypatch.setattr(output, "PROGRESS_AFTER_S", 0.0)  # every run is long enough here
    clients = tmp_path / "clients"
    simulated = run("simulate", "--clients", "2", "--epochs", "1", "--out", clients)
    assert simulated.exit_code == 0, simulated.output
    assert "simulate: 2 of 2 clients trained" in simulated.stderr
    assert "clients trained" not in simulated.stdout
    rounds = run("simulate", "--clients", "2", "--epochs", "1", "--rounds", "2",
                 "--out", tmp_path / "rounds")
    assert rounds.exit_code == 0, rounds.output
    assert re.search(r"simulate: 2 of 2 rounds \(accuracy 0\.\d{4}\)", rounds.stderr)
    scored = run("evaluate", *sorted(clients.glob("*.safetensors")), "--json")
    assert scored.exit_code == 0, scored.output
    assert "evaluate: 2 of 2 models scored" in scored.stderr
    assert json.loads(scored.stdout)["scores"]  # stdout: the JSON alone
    demo = run("demo", "--clients", "2", "--epochs", "1", "-m", "avg", "-m", "pfnm")
    assert demo.exit_code == 0, demo.output
    assert "demo: 2 of 2 clients trained" in demo.stderr
    assert "demo: 2 of 2 methods fused and scored" in demo.stderr
