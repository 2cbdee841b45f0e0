"""The main job (`fusekit demo`): every registered method appears, JSON is clean."""

import json

import pytest
from typer.testing import CliRunner

from fusekit._cli.app import app
from fusekit.core.errors import UnknownMethodError
from fusekit.methods import METHODS
from fusekit.methods.base import FusionMethod
from fusekit.toolkit.demo import DemoConfig, registered_methods, run_demo

TINY = {"clients": 3, "epochs": 1, "arch": "mlp:16", "device": "cpu"}


def test_demo_runs_every_registered_method(tmp_path):
    # Seeded on the CPU: 3 clients, 3 epochs, 64-16-10 MLPs, Dirichlet alpha 0.5 on digits.
    report = run_demo(DemoConfig(**{**TINY, "epochs": 3}), out_dir=tmp_path)
    assert [m.method for m in report.methods] == registered_methods()
    assert "avg" in registered_methods()
    assert not report.failed
    assert len(report.clients) == 3 and report.ensemble is not None
    assert len(list((tmp_path / "clients").glob("*.safetensors"))) == 3
    by_name = {run.method: run for run in report.methods}
    for run in report.methods:
        assert (tmp_path / f"fused-{run.method}.safetensors").is_file()
        assert run.fuse_time_s > 0
    # Matching fuses skewed clients into a better model than the clients are on average
    # (measured: mean client 44%, pfnm 54% and nafi 46% at the default fused width
    # 24 = 1.5 x 16, after 3 epochs; the full demo's 20 epochs give 95% at width 150).
    for method in ("pfnm", "nafi"):
        assert by_name[method].score.accuracy > report.mean_client_accuracy, method
        assert by_name[method].widths == [24]
    assert by_name["ot"].widths == by_name["avg"].widths == [16]
    assert json.loads(json.dumps(report.as_dict()))["config"]["clients"] == 3


class _Broken(FusionMethod):
    name = "broken-for-test"
    summary = "always fails"

    def fuse(self, checkpoints, specs):
        raise ValueError("deliberately broken")


def test_a_failing_method_is_reported_and_others_still_run(monkeypatch):
    monkeypatch.setitem(METHODS, _Broken.name, _Broken)
    report = run_demo(DemoConfig(**TINY, methods=["broken-for-test", "avg"]))
    assert [m.method for m in report.failed] == ["broken-for-test"]
    assert "deliberately broken" in report.failed[0].error
    assert report.methods[1].score is not None
    result = CliRunner().invoke(
        app,
        [
            "demo",
            "--clients",
            "3",
            "--epochs",
            "1",
            "--arch",
            "mlp:8",
            "--device",
            "cpu",
            "-m",
            "broken-for-test",
            "-m",
            "avg",
        ],
    )
    assert result.exit_code == 1 and "failed" in result.stdout


def test_unknown_method():
    with pytest.raises(UnknownMethodError, match="nope"):
        run_demo(DemoConfig(**TINY, methods=["nope"]))


def test_cli_demo_json():
    result = CliRunner().invoke(
        app,
        ["demo", "--clients", "3", "--epochs", "1", "--arch", "mlp:8", "--device", "cpu", "--json"],
    )
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [m["method"] for m in payload["methods"]] == registered_methods()
    clients = [c["accuracy"] for c in payload["clients"]]
    assert len(clients) == 3
    assert payload["mean_client_accuracy"] == pytest.approx(sum(clients) / 3)
    assert [m["widths"] for m in payload["methods"] if m["method"] in ("avg", "ot")] == [[8], [8]]
    assert payload["ensemble"]["kind"] == "ensemble"


def test_the_table_fits_80_columns_with_both_protocol_columns():
    """``fusekit demo --calibrate --align`` in an 80-column terminal: every heading whole
    (it read ``calibra…``), every row within the width."""
    import io

    from rich.console import Console

    from fusekit._cli.demo import demo_table
    from fusekit.toolkit.demo import DemoReport, MethodRun
    from fusekit.toolkit.evaluate import Score

    def score(accuracy, kind="fused"):
        return Score("m", kind, accuracy, 0.5, 450)

    report = DemoReport(DemoConfig(calibrate=True, align=True), "cpu",
                        clients=[score(0.58, "client"), score(0.89, "client")],
                        ensemble=score(0.89, "ensemble"), simulate_time_s=14.0)
    for method, widths in (("pfnm", [150]), ("rebasin", [100, 100])):
        report.methods.append(MethodRun(method, 0.5, widths, score(0.94), None, score(0.95),
                                        score(0.96)))
    screen = io.StringIO()
    Console(file=screen, width=80).print(demo_table(report))
    text = screen.getvalue()
    assert "calibrated" in text and "refit" in text and "…" not in text, text
    assert max(map(len, text.splitlines())) <= 80
