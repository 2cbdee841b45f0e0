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
    report = run_demo(DemoConfig(**TINY), out_dir=tmp_path)
    assert [m.method for m in report.methods] == registered_methods()
    assert "avg" in registered_methods()
    assert not report.failed
    assert len(report.clients) == 3 and report.ensemble is not None
    assert len(list((tmp_path / "clients").glob("*.safetensors"))) == 3
    for run in report.methods:
        assert (tmp_path / f"fused-{run.method}.safetensors").is_file()
        assert 0 <= run.score.accuracy <= 1 and run.fuse_time_s >= 0
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
    assert 0 <= payload["mean_client_accuracy"] <= 1
    assert payload["ensemble"]["kind"] == "ensemble"
