"""Matching engine benchmark: fusekit vs SciPy, lapx, lap, lapjv, POT (see fusekit.bench.matching).

python benchmarks/bench_matching.py [--quick] [--lapx-path DIR] [--json out.json]
"""

import sys

from fusekit.bench.matching import main

if __name__ == "__main__":
    sys.exit(main())
