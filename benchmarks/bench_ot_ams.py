"""OT fusion and AMS inference benchmark (see fusekit.bench.ot_ams).

OMP_NUM_THREADS=1 python benchmarks/bench_ot_ams.py [--clients 10 30] [--json out.json]
"""

import sys

from fusekit.bench.ot_ams import main

if __name__ == "__main__":
    sys.exit(main())
