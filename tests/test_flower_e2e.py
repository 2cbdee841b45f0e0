"""A real Flower federation on 127.0.0.1: a SuperLink and three SuperNodes (Flower's own
processes, deployment engine), the example app run with ``flwr run`` once fused by FedAvg
(fusekit's avg) and once by PFNM; and a run that cannot finish, stopped at its timeout.
About 100 s on two cores for both; deselect with ``-m "not flower_e2e"``."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="needs the [flower] extra")

from fusekit.flower.local import LocalFederation
from fusekit.toolkit.processes import descendant_groups, group_alive

APP = Path(__file__).resolve().parents[1] / "examples" / "flower"

pytestmark = pytest.mark.flower_e2e


def test_one_round_pfnm_federation_beats_fedavg_of_the_same_federation(tmp_path):
    results = {}
    with LocalFederation(nodes=3, workdir=tmp_path / "federation") as federation:
        leaders = [p.pid for p in federation.processes]
        for method, evaluate in (("avg", 0.0), ("pfnm", 1.0)):
            result_file = tmp_path / f"{method}.json"
            federation.run(APP, {"method": method, "epochs": 10, "fraction-evaluate": evaluate,
                                 "result-file": str(result_file)}, timeout=420)
            results[method] = json.loads(result_file.read_text())
        groups = set(leaders) | descendant_groups(leaders)
        assert len(groups) > len(leaders)  # the SuperLink's SuperExec has a session of its own
    assert not any(group_alive(group) for group in groups)  # every process it started ended
    avg, pfnm = results["avg"], results["pfnm"]
    assert avg["hidden_widths"] == [100]
    assert pfnm["hidden_widths"] == [150]  # the default fused width: 1.5 × the widest node
    assert pfnm["accuracy"] > avg["accuracy"] + 0.05
    assert pfnm["left_out"] == {} and avg["left_out"] == {}
    round_one = pfnm["train_metrics"]["1"]
    assert round_one["pfnm.fused-replies"] == 3
    assert round_one["pfnm.fused-widths"] == pfnm["hidden_widths"]
    # The nodes rebuilt the fused model from the widths in the ConfigRecord and scored it.
    assert pfnm["client_evaluation"]["1"]["accuracy"] > 0.8


def test_a_run_that_cannot_finish_is_stopped_at_its_timeout(tmp_path):
    """Two nodes required, one started: the ServerApp would wait for ever; the run is
    stopped on the SuperLink at its timeout and leaving the block ends every process."""
    with LocalFederation(nodes=1, workdir=tmp_path / "federation") as federation:
        leaders = [p.pid for p in federation.processes]
        with pytest.raises(subprocess.TimeoutExpired):
            federation.run(APP, {"min-nodes": 2}, timeout=20)
        assert [run["status"] for run in federation.runs()] == ["finished:stopped"]
        groups = set(leaders) | descendant_groups(leaders)
    assert not any(group_alive(group) for group in groups)
