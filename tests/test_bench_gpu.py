"""benchmarks/bench_gpu.py, run small with the torch kernels on the CPU: the rows it writes
(kernels compared with the C++ core, a fusion in its own process compared file to file)."""

from __future__ import annotations

import json

import bench_gpu

from conftest import mlp, write


def test_bench_gpu_writes_its_rows_and_tables(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_gpu, "SHAPES", [("small ot", "sqeuclidean", 24, 20, 9),
                                              ("small rebasin", "inner", 16, 16, 30),
                                              ("small pfnm", "posterior", 30, 12, 17)])
    monkeypatch.setattr(bench_gpu, "resnet_files", lambda folder, n: [
        write(tmp_path / f"c{s}.safetensors", mlp((12, 10, 3), seed=s), num_samples=5 + s)
        for s in range(n)])
    out = tmp_path / "out"
    bench_gpu.main(["--device", "cpu", "--repeats", "1", "--methods", "ot",
                    "--scratch", str(tmp_path / "scratch"), "--timeout", "120",
                    "--json-out", str(out / "rows.json"), "--md-out", str(out / "rows.md")])
    payload = json.loads((out / "rows.json").read_text())
    kernels = payload["kernels"]
    assert [(r["case"], r["precision"]) for r in kernels] == [
        ("small ot", "-"), ("small rebasin", "-"), ("small pfnm", "scalar"),
        ("small pfnm", "per coordinate")]
    assert all(r["max_rel_diff"] < 1e-12 and r["cpu_ms"] > 0 for r in kernels)
    [fusion] = payload["fusions"]
    assert fusion["status"] == "cpu ok, cpu ok" and fusion["max_abs_diff"] == 0.0
    assert fusion["matrices"].startswith("0 / ")  # device="cpu": none went elsewhere
    table = (out / "rows.md").read_text()
    assert "| small pfnm | per coordinate | 30 x 12 x 17 |" in table
    assert "| ResNet-50 | 2 | ot | defaults |" in table
    results = tmp_path / "RESULTS.md"
    bench_gpu.main(["--from-json", str(out / "rows.json"), "--results-md", str(results)])
    assert table.strip() in results.read_text()


def test_the_recorded_command_leaves_out_where_the_run_wrote():
    argv = ["--device", "cuda", "--json-out", "/machine/out/a.json", "--md-out=/machine/b.md",
            "--repeats", "3", "--results-md", "RESULTS.md"]
    assert bench_gpu.run_command(argv) == "python benchmarks/bench_gpu.py --device cuda --repeats 3"
