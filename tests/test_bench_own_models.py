"""benchmarks/bench_own_models.py run small: plain torch clients, the CLI protocol to its
last refit round, fusekit evaluate against torch on the same arrays."""

from __future__ import annotations

import bench_own_models as bom


def test_a_small_case_runs_the_protocol_to_its_end(tmp_path, monkeypatch):
    monkeypatch.setitem(bom.CASES, "bn_mlp", ("ot", 2))
    run = bom.run_case("bn_mlp", 0, tmp_path)
    (row,) = run["methods"]
    assert row["widths"] == [100, 100] and row["rounds"] == 1 + 1 + 3  # calibrate, align, refits
    assert run["evaluate - torch"] == 0.0  # the same arrays, the same tensors
    assert 0.0 <= row["one-shot"] <= 1.0 and len(run["clients"]) == 3
    assert "| bn_mlp, 0 |" in bom.table([run]) and "ot (100, 100)" in bom.table([run])
