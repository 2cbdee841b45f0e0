"""benchmarks/bench_quality.py --frontier: the target checks and the report, on made-up rows."""

from __future__ import annotations

import argparse

import bench_quality as bq


def row(partition, clients, seed, accuracies, widths=None):
    widths = widths or {}
    methods = {}
    for label, accuracy in accuracies.items():
        asked = bq.asked_width(label)
        delivered = widths.get(label, [asked] if asked else [100])
        methods[label] = {"accuracy": accuracy, "time_s": 0.1, "widths": delivered,
                          "inferred": [300]}
    return {"cell": {"data": "digits", "partition": partition, "clients": clients,
                     "arch": "mlp:100", "seed": seed},
            "local_mean": 0.5, "ensemble": 0.8, "ensemble_softmax": 0.9, "methods": methods}


GOOD = {"pfnm@1": 0.85, "nafi@1": 0.86, "pfnm@1.5": 0.88, "nafi@1.5": 0.875, "ot@1": 0.7,
        "avg@1": 0.4, "pfnm@unlimited": 0.9}


def test_targets_are_checked_cell_by_cell():
    rows = [row("dir-0.5", 10, s, GOOD) for s in range(2)]
    rows += [row("labels", 20, 0, {**GOOD, "nafi@1": 0.6, "pfnm@1": 0.65})]
    lines = bq.frontier_checks(rows)
    assert "digits dir-0.5 S=10: best of pfnm/nafi - best of ot/avg = +16.0 points (met)" in (
        lines[0])
    assert "digits labels S=20" in lines[1] and "-5.0 points (NOT met)" in lines[1]
    # Best fused model at ratio <= 1.5 (not the unlimited one): pfnm@1.5, 2 points below.
    assert "softmax ensemble - best fused (pfnm@1.5) = +2.0 points (target: within 3 points: met)" \
        in lines[2]
    assert "(target" not in lines[3]  # the target is for alpha 0.5, S = 10 only
    # Every model with a width in its label is checked, ot@1 and avg@1 included (6 per row).
    assert lines[-1] == "- width asked = width delivered: 18 of 18 fused models (met)"


def test_a_width_mismatch_is_reported():
    rows = [row("dir-0.5", 10, 0, GOOD, widths={"pfnm@1.5": [149]})]
    line = bq.frontier_checks(rows)[-1]
    assert line.startswith("- width asked = width delivered: 5 of 6 fused models (NOT met")
    assert "'pfnm@1.5', [149]" in line


def test_the_section_names_every_width_and_plots(tmp_path):
    rows = {"frontier": [row("dir-0.5", 10, s, GOOD) for s in range(2)],
            "lambda": [row("dir-0.5", 10, 0, {"nafi-λ0@1": 0.8, "nafi-λ1@1": 0.82})]}
    payload = {"machine": {"platform": "test", "torch": "x", "core": "y"}, "seeds": 2,
               "elapsed_s": 1.0, "studies": rows,
               "grid": {"data": ["digits"], "partitions": ["dir-0.5"], "clients": [10]}}
    args = argparse.Namespace(plot=tmp_path / "q.png", note="load 3", no_write=False,
                              results_md=tmp_path / "RESULTS.md")
    assert bq.publish_frontier(payload, args) == 0
    text = args.results_md.read_text()
    assert "## Accuracy against fused width (digits)" in text and "load 3" in text
    assert "| pfnm@1 | nafi@1 | pfnm@1.5 | nafi@1.5 |" in text
    assert "| digits | dir-0.5 | 10 | 100 | 100 | 150 | 150 | 100 | 100 |" in text
    assert (tmp_path / "frontier-digits.png").stat().st_size > 1000
    # Writing again replaces the section instead of appending a second one.
    bq.publish_frontier(payload, args)
    assert args.results_md.read_text().count("fusion-frontier-digits:begin") == 1


def test_noniid_floor_and_ams_targets_are_checked_with_widths(tmp_path):
    noniid = {**GOOD, "pfnm@1.5": 0.5, "nafi@1.5": 0.72, "ot@1": 0.71, "avg@1": 0.3,
              "ams-class": 0.95, "ams-logit": 0.6, "ams-prob": 0.7}
    rows = [row("dir-0.05", 10, s, noniid) for s in range(2)]
    rows += [row("dir-0.5", 10, 0, {**GOOD, "ams-class": 0.85})]
    for r in rows:
        r["methods"]["pfnm@1.5"].update(class_contrast=0.4, compact_ok=False)
    lines = "\n".join(bq.noniid_section(rows)).splitlines()
    assert "### Non-iid floor" in lines
    table = next(line for line in lines if line.startswith("| digits | dir-0.05 |"))
    assert "| 0.40 (2/2) |" in table and "50.0 ± 0.0 (150)" in table  # width in brackets
    assert "dir-0.5 | 10 |" not in "\n".join(lines[:lines.index("Targets, cell by cell "
                                                              "(mean over seeds):")])
    assert ("- floor, digits dir-0.05 S=10: pfnm@1.5 - ot@1 = -21.0 points (NOT met)"
            in lines)
    assert "- floor, digits dir-0.05 S=10: nafi@1.5 - ot@1 = +1.0 points (met)" in lines
    # AMS is checked in every cell of the run, the iid-er ones included.
    assert ("- AMS, digits dir-0.05 S=10: ams-class - ensemble-softmax = +5.0 points (met)"
            in lines)
    assert ("- AMS, digits dir-0.5 S=10: ams-class - ensemble-softmax = -5.0 points (NOT met)"
            in lines)
    assert bq.noniid_section([row("dir-0.5", 10, 0, GOOD)]) == []
