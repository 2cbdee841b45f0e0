"""Load test of the fusion service on loopback (benchmarks/bench_service.py).

A real ``fusekit serve`` (uvicorn + worker processes) on 127.0.0.1. For each body size
(1 MB and 20 MB by default), ``--clients`` concurrent clients each upload one checkpoint into
their own slot of one job (capped at ``--max-uploads`` concurrent uploads server-side:
``fusekit.client`` waits out each 429 as its Retry-After and backoff say, so the latency
includes those waits); then the job is fused (avg of all of them, the cheapest method, so
the numbers are the service's). Reported: uploads/s, MB/s, p50/p99 upload latency, the
server's peak RSS (uploads stream to disk, so it must not grow with the body size), lost or
corrupted uploads (each slot's SHA-256 against the file sent), and the fusion's queue+run
time. Then the same with the queue on a real Redis server (``redis-server`` on an
ephemeral port, started and stopped here) when one is installed.

``ServiceProcess`` (start, wait healthy, kill -9, stop by process group) is shared with the
tests.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from bench_support import machine_info, status_mb, write_json

from fusekit.client import Client
from fusekit.core.checkpoint import save_checkpoint
from fusekit.toolkit.processes import end_groups


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServiceProcess:
    """``fusekit serve`` in its own process group, on 127.0.0.1 and a free port."""

    data_dir: Path
    options: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    port: int = field(default_factory=free_port)
    process: subprocess.Popen | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> ServiceProcess:
        self.log = self.data_dir.parent / f"{self.data_dir.name}-{self.port}.log"
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "fusekit", "serve", "--data-dir", str(self.data_dir),
                 "--port", str(self.port), *self.options],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                env={**os.environ, **self.env})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"fusekit serve exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"fusekit serve not healthy after {timeout} s")

    def kill(self) -> None:
        """kill -9 of the server and its workers, as a crash of the machine would."""
        if self.process is not None:
            end_groups([self.process], terminate_first=False)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the group (and any its members started), SIGKILL to what is left after
        ``timeout``."""
        if self.process is not None:
            end_groups([self.process], grace=timeout)

    def memory_mb(self, field: str = "VmHWM") -> float:
        """The API server's peak (VmHWM) or current (VmRSS) resident memory, in MB."""
        return status_mb(field, self.process.pid)

    def reset_peak_memory(self) -> None:
        """Start VmHWM again from the current RSS (Linux ``clear_refs``), so each round
        reports its own peak."""
        Path(f"/proc/{self.process.pid}/clear_refs").write_text("5")


@contextlib.contextmanager
def redis_server(redis: str, workdir: Path):
    """A private redis-server on a free loopback port, stopped (by process group) on exit."""
    port = free_port()
    process = subprocess.Popen(
        [redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "yes", "--appendfsync", "always", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        end_groups([process], terminate_first=False)


def write_clients(folder: Path, n_clients: int, megabytes: float) -> list[Path]:
    """Same-shape MLP checkpoints (float32) of about ``megabytes`` each."""
    width = max(1, int(megabytes * 1e6 / 4 / 1024))
    paths = []
    for s in range(n_clients):
        rng = np.random.default_rng(s)
        state = {"0.weight": rng.normal(0, 0.03, (width, 1024)).astype(np.float32),
                 "0.bias": np.zeros(width, np.float32),
                 "2.weight": rng.normal(0, 0.1, (10, width)).astype(np.float32),
                 "2.bias": np.zeros(10, np.float32)}
        paths.append(save_checkpoint(folder / f"c{s}.safetensors", state,
                                     {"fusekit.num_samples": str(100 + s)}))
    return paths


def upload_round(service: ServiceProcess, admin: str, paths: list[Path], concurrency: int
                 ) -> dict[str, Any]:
    names = [p.stem for p in paths]
    with Client(service.url, admin) as coordinator:
        job = coordinator.create_job("avg", names)
    service.reset_peak_memory()
    rss_before = service.memory_mb("VmRSS")
    latencies: list[float] = []
    busy: list[str] = []  # the clients' retry lines (429: Retry-After, backoff with jitter)

    def send(path: Path) -> None:
        with Client(service.url, job["tokens"][path.stem], timeout=300,
                    on_retry=busy.append) as client:
            start = time.perf_counter()
            client.submit(job["id"], path.stem, path)
            latencies.append(time.perf_counter() - start)

    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, paths))
    wall = time.perf_counter() - start
    peak = service.memory_mb("VmHWM")
    with Client(service.url, admin) as coordinator:
        slots = coordinator.status(job["id"])["slots"]
        lost = sum(not slots[n]["filled"] for n in names)
        corrupted = sum(slots[n].get("sha256") != _sha256(p) for n, p in zip(names, paths,
                                                                                strict=True))
        fuse_start = time.perf_counter()
        coordinator.run(job["id"])
        state = coordinator.wait(job["id"], timeout=600, every=0.1)
        fuse_s = time.perf_counter() - fuse_start
        coordinator.delete(job["id"])
    total_mb = sum(p.stat().st_size for p in paths) / 1e6
    return {"uploads": len(paths), "mb_each": round(total_mb / len(paths), 2),
            "wall_s": round(wall, 2), "uploads_per_s": round(len(paths) / wall, 1),
            "mb_per_s": round(total_mb / wall, 1),
            "p50_ms": round(1e3 * float(np.percentile(latencies, 50)), 1),
            "p99_ms": round(1e3 * float(np.percentile(latencies, 99)), 1),
            "retries_429": len(busy), "lost": lost, "corrupted": corrupted,
            "fusion_state": state["state"], "queue_and_fuse_s": round(fuse_s, 2),
            "server_rss_before_mb": round(rss_before, 1), "server_peak_rss_mb": round(peak, 1)}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def run(args: argparse.Namespace, broker: str, workdir: Path) -> list[dict[str, Any]]:
    admin = secrets.token_urlsafe(32)
    service = ServiceProcess(workdir / f"data-{broker.split(':')[0] or 'sqlite'}",
                             options=("--max-uploads", str(args.max_uploads), "--broker", broker),
                             env={"FUSEKIT_ADMIN_TOKEN": admin})
    rows = []
    service.start()
    try:
        for megabytes in args.sizes:
            folder = workdir / f"clients-{megabytes}"
            folder.mkdir(exist_ok=True)
            paths = write_clients(folder, args.clients, megabytes)
            row = {"queue": "redis" if broker else "sqlite",
                   **upload_round(service, admin, paths, args.clients)}
            print(row, flush=True)
            rows.append(row)
            shutil.rmtree(folder)
    finally:
        service.stop()
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--sizes", type=float, nargs="+", default=[1.0, 20.0])
    parser.add_argument("--max-uploads", type=int, default=16)
    parser.add_argument("--redis", default=shutil.which("redis-server") or "",
                        help="redis-server binary for the second run ('' to skip)")
    parser.add_argument("--json-out", default="benchmarks/results/bench_service.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="fusekit-bench-service-") as tmp:
        workdir = Path(tmp)
        rows = run(args, "", workdir)
        if args.redis:
            with redis_server(args.redis, workdir) as url:
                rows += run(args, url, workdir)
    machine = machine_info(load_average_before=load_before, load_average_after=os.getloadavg())
    write_json(args.json_out, {"machine": machine,
                               "clients": args.clients, "max_uploads": args.max_uploads,
                               "rows": rows})


if __name__ == "__main__":
    main()
