"""benchmarks/bench_truth.py: the target checks and the report, on made-up rows."""

from __future__ import annotations

import bench_truth as bt


def truth_row(clients, inferred, recovered, default_s, fixed_s):
    default = {"inferred": inferred, "recovered": recovered, "width": 150, "time_s": default_s,
               "sigma2_relative": 0.038, "sigma0_2_relative": 0.97, "gamma0": 40.0,
               "em_rounds": 6, "em_converged": True}
    fixed = {"inferred": 140, "recovered": 0.9, "width": 150, "time_s": fixed_s}
    return {"clients": clients, "seed": 0, "default": default, "fixed": fixed}


def grid_row(partition, seed, accuracies):
    methods = {label: {"accuracy": accuracies.get(label, 0.5), "time_s": 0.1,
                       "widths": [100 if label in ("avg", "ot") else 150]}
               for label in bt.grid_variants()}
    return {"cell": {"data": "digits", "partition": partition, "clients": 10,
                     "arch": "mlp:100", "seed": seed},
            "local_mean": 0.5, "ensemble": 0.8, "ensemble_softmax": 0.9, "methods": methods}


def test_truth_targets_are_met_or_not_with_the_worst_row():
    good = [truth_row(10, 150, 1.0, 0.5, 0.5), truth_row(300, 152, 0.99, 6.0, 10.0)]
    lines = bt.truth_checks(good)
    assert all("**met**" in line for line in lines)
    bad = [*good, truth_row(30, 170, 0.9, 2.0, 1.0)]
    lines = bt.truth_checks(bad)
    assert all("**not met**" in line for line in lines)
    assert "13.3%" in lines[0] and "90.0%" in lines[1] and "2.00" in lines[2]


def test_grid_compares_the_defaults_with_the_best_fixed_setting():
    best = "fixed-0.1-3"
    rows = [grid_row(p, s, {"pfnm": 0.9, "nafi": 0.7, best: 0.8, "fixed-1-1": 0.85})
            for p in ("dir-0.1", "dir-0.5") for s in range(2)]
    rows[0]["methods"]["fixed-1-1"]["accuracy"] = 0.95  # the oracle of one cell
    summary = bt.grid_summary(rows)
    lines = bt.grid_checks(summary)
    assert "`fixed-1-1`" in lines[0]
    assert lines[1].startswith("- pfnm") and "in 2 of 2 cells" in lines[1]
    assert "**met**" in lines[1] and "**not met**" in lines[2]
    table = bt.grid_table(summary)
    assert len(table) == 2 + 2 and "90.0 (150)" in table[2]
    payload = {"machine": {"platform": "test", "core": "core"}, "elapsed_s": 1.0, "seeds": 2,
               "truth": [truth_row(10, 150, 1.0, 0.5, 0.5)], "grid": rows}
    text = bt.render(payload)
    assert "### Trained clients" in text and "| 10 | 0 | 150 | 100.0 % (150)" in text
