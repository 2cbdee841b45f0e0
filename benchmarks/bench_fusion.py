"""Fusion benchmark: PFNM / NAFI (fusekit.bench.fusion), then OT fusion and AMS inference
(fusekit.bench.ot_ams), each with its peer measured in the same run.

python benchmarks/bench_fusion.py          # both parts, default settings
fusekit bench fusion / fusekit bench ot-ams   # one part, with its options
"""

from fusekit.bench import fusion, ot_ams

if __name__ == "__main__":
    raise SystemExit(fusion.main([]) or ot_ams.main([]))
