"""Start-up time of the command line: `fusekit --help` and friends against a bare
`python -c "import numpy"` (the target: `fusekit --help` at most 4x), measured as
hyperfine does, by repeated runs (interleaved, so that a busy machine slows each command
alike) and their median.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from bench_support import add_output_arguments, machine_info, write_json, write_section

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- cli:begin -->", "<!-- cli:end -->"
TARGET = 4.0
COMMANDS = {
    'python -c "import numpy"': ["-c", "import numpy"],
    "fusekit --help": ["-m", "fusekit", "--help"],
    "fusekit --version": ["-m", "fusekit", "--version"],
    "fusekit job --help": ["-m", "fusekit", "job", "--help"],
    "fusekit fuse --help": ["-m", "fusekit", "fuse", "--help"],
}


def measure(runs: int) -> dict[str, list[float]]:
    """Wall times of each command, ``runs`` rounds of all of them in turn (one unrecorded
    round first, to warm the file cache)."""
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for round_ in range(runs + 1):
        for name, args in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL, check=True,
                           timeout=120)
            if round_:
                times[name].append(time.perf_counter() - start)
    return times


def render(payload: dict) -> str:
    medians = {name: statistics.median(t) for name, t in payload["times"].items()}
    base = medians['python -c "import numpy"']
    ratio = medians["fusekit --help"] / base
    lines = [
        f"Median wall time of {payload['runs']} runs of each command, interleaved, on "
        f"{payload['machine']['cpus']} cores (load average {payload['load_average']:.1f}, "
        "shared with other jobs: single runs vary by tens of percent). Run: `python "
        f"benchmarks/bench_cli.py --runs {payload['runs']}`.",
        "",
        "| command | median s | x `import numpy` |",
        "|---|---|---|",
        *(f"| `{name}` | {m:.3f} | {m / base:.2f} |" for name, m in medians.items()),
        "",
        f"Target `fusekit --help` <= {TARGET:g}x `import numpy`: "
        f"**{'met' if ratio <= TARGET else 'not met'}** ({ratio:.2f}x). `fuse --help` imports "
        "the methods (SciPy) for their parameter declarations; no help imports torch.",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="runs of each command [20]")
    add_output_arguments(parser, HERE / "results" / "cli.json")
    args = parser.parse_args(argv)
    payload = {"machine": machine_info(), "runs": args.runs, "times": measure(args.runs),
               "load_average": os.getloadavg()[0]}
    write_json(args.json_out, payload)
    section = "## Command-line start-up\n\n" + render(payload)
    print(section)
    if not args.no_write:
        write_section(args.results_md, section, BEGIN, END)
    return 0


if __name__ == "__main__":
    sys.exit(main())
