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


def calibrated_row(partition, seed, pairs):
    """A frontier row whose fused columns were also calibrated: label -> (before, after)."""
    out = row(partition, 10, seed, {label: before for label, (before, _) in pairs.items()})
    for label, (_, after) in pairs.items():
        out["methods"][label].update(calibrated=after, calibration_s=0.01)
    return out


def test_calibration_targets_are_checked_cell_by_cell_on_the_mean_over_seeds(tmp_path):
    # pfnm@1.5 loses 0.9 then 0.3 points (mean -0.6: NOT met); ot@1 loses 0.9 in one seed
    # only (mean -0.2: met); avg@1 gains; ams-class (no calibration) is a peer, not a cell.
    rows = [calibrated_row("dir-0.5", 0, {"pfnm@1.5": (0.900, 0.891), "ot@1": (0.800, 0.791),
                                          "avg@1": (0.400, 0.700)}),
            calibrated_row("dir-0.5", 1, {"pfnm@1.5": (0.900, 0.897), "ot@1": (0.800, 0.805),
                                          "avg@1": (0.400, 0.600)})]
    rows[0]["methods"]["ams-class"] = {"accuracy": 0.95, "time_s": 0.1, "widths": [100]}
    pairs = bq.calibration_pairs(rows)
    lines = bq.calibration_checks(pairs)
    assert lines[0].startswith("- never more than 0.5 point lower in any cell: 2 of 3 cells "
                               "(NOT met); the smallest change -0.6 points (digits dir-0.5 10 "
                               "pfnm@1.5)")
    assert lines[1] == ("  - NOT met: digits dir-0.5 10 pfnm@1.5: -0.6 points (per seed -0.9, "
                        "-0.3)")
    # Means over the three cells: (0.9 + 0.8 + 0.4) / 3 = 70.00 -> (0.894 + 0.798 + 0.65) / 3.
    assert lines[2] == "- the mean over cells rises: 70.00 → 78.07 % (+8.07 points; met)"
    assert lines[3].startswith("- single seeds (not a target): 2 of 6 calibrated models")
    table = bq.calibration_table(rows, pairs)
    assert "| pfnm@1.5 (150) | ot@1 (100) | avg@1 (100) |" in table
    assert "| 90.0 → 89.4 (-0.6) | 80.0 → 79.8 (-0.2) | 40.0 → 65.0 (+25.0) |" in table
    assert "ams-class" not in table


def test_calibration_section_is_written_between_its_own_markers(tmp_path):
    rows = [calibrated_row("dir-0.5", s, {"pfnm@1": (0.85, 0.86), "pfnm@unlimited": (0.9, 0.9)})
            for s in range(2)]
    rows[1]["methods"]["pfnm@unlimited"]["widths"] = [160]
    payload = {"machine": {"platform": "test", "torch": "x", "core": "y"}, "seeds": 2,
               "elapsed_s": 1.0, "calibrate": True, "studies": {"frontier": rows},
               "grid": {"data": ["digits"], "partitions": ["dir-0.5"], "clients": [10]}}
    md = tmp_path / "RESULTS.md"
    md.write_text("# results\n\n<!-- fusion-frontier-digits:begin -->\nkept\n"
                  "<!-- fusion-frontier-digits:end -->\n")
    args = argparse.Namespace(plot=tmp_path / "q.png", note="", no_write=False, results_md=md)
    assert bq.publish_frontier(payload, args) == 0
    text = md.read_text()
    assert "kept" in text and text.count("frontier-calibration-digits:begin") == 1
    assert "90.0 → 90.0 (+0.0) [130]" in text  # the inferred width, mean over seeds
    assert "- the mean over cells rises: 87.50 → 88.00 % (+0.50 points; met)" in text
    assert not (tmp_path / "frontier-digits.png").exists()


def test_the_runner_calibrates_every_fused_model_that_matched_neurons(tmp_path, monkeypatch):
    """One real cell (digits, 3 clients, 2 epochs): pfnm and avg get their calibrated
    counterpart, AMS (no single fused model) does not."""
    from fusekit.toolkit.data import load_dataset

    data = load_dataset("digits")
    cell = bq.Cell("digits", "dir-0.5", 3, "mlp:100", 0)
    runner = bq.Runner({"digits": data}, "cpu", tmp_path, calibrate=True)
    monkeypatch.setitem(bq.EPOCHS, "digits", 2)
    row = runner.row(cell, {"pfnm@1": ("pfnm", {"width_ratio": 1.0}), "avg@1": ("avg", {}),
                            "ams-class": ("ams", {"confidence": "class-share"})})
    methods = row["methods"]
    for label in ("pfnm@1", "avg@1"):
        assert 0.0 <= methods[label]["calibrated"] <= 1.0, methods[label]
        assert methods[label]["calibration_s"] > 0
    assert "calibrated" not in methods["ams-class"] and "accuracy" in methods["ams-class"]
    assert not list(tmp_path.rglob("calibrated-*"))  # scored, then removed
