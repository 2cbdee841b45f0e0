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

Then the hostile cases (``--cases``), each on a server of its own:

- ``reuploads``: 15 threads upload three different files in turn into one slot, for several
  rounds; after each round the slot's record must name the one file on disk, with its
  SHA-256 (mismatches and lost slots reported; 429s of the one-upload-per-slot rule too);
- ``slow``: 16 uploads trickling one byte a second with one client token, while 8 other
  clients upload normally: how many trickles were refused at once (one upload per slot),
  how long the one let in held its place before the minimum rate cut it (408), and the
  other clients' 429s and latency;
- ``big-tensor``: one checkpoint holding a single F32 tensor of ``--big-tensor-mb`` MB
  (1024: 1 GiB), uploaded once;
- ``big-header``: one checkpoint of ``--header-tensors`` one-element tensors (200,000: a
  header of about 14 MB).

For the last two: the API server's and the checker processes' peak resident memory above
what they held before, the upload's time, and ``/healthz`` latency (median, p99, max)
sampled every 20 ms while the upload runs.

``ServiceProcess`` (start, wait healthy, kill -9, stop by process group) is shared with the
tests.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing
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
import safetensors.numpy
from bench_support import machine_info, status_mb, write_json

from fusekit.client import Client, tls_context
from fusekit.core.checkpoint import save_checkpoint
from fusekit.toolkit.processes import end_groups


HOSTILE = ("reuploads", "slow", "big-tensor", "big-header")


def http(method: str, url: str, **options: Any) -> httpx.Response:
    """One request, as ``httpx.request`` makes it, with the TLS context fusekit's clients
    share: one of its own costs 35 ms of CPU, more than a request to a local server."""
    return httpx.request(method, url, verify=tls_context(), **options)


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
                if http("GET", f"{self.url}/healthz", timeout=2).status_code == 200:
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


# ---- hostile cases ----

def children(pid: int) -> list[int]:
    """The live child processes of ``pid``, started by any of its threads (Linux /proc)."""
    return sorted(int(child) for task in Path(f"/proc/{pid}/task").iterdir()
                  for child in (task / "children").read_text().split())


def spawned(pid: int) -> list[int]:
    """The processes ``pid`` started afresh through multiprocessing: a server's upload
    checkers (not multiprocessing's resource tracker)."""
    return [child for child in children(pid)
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes()]


def _folder(workdir: Path, name: str) -> Path:
    (workdir / name).mkdir(exist_ok=True)
    return workdir / name


def hostile_service(workdir: Path, name: str, admin: str, *options: str) -> ServiceProcess:
    return ServiceProcess(workdir / f"data-{name}", options=options,
                          env={"FUSEKIT_ADMIN_TOKEN": admin}).start()


def put(service: ServiceProcess, job: str, client: str, token: str, body: Any,
        timeout: float = 600) -> httpx.Response:
    return http("PUT", f"{service.url}/v1/jobs/{job}/clients/{client}/checkpoint", content=body,
                headers={"Authorization": f"Bearer {token}"}, timeout=timeout)


def reuploads_case(workdir: Path, rounds: int = 10) -> dict[str, Any]:
    admin = secrets.token_urlsafe(32)
    paths = write_clients(_folder(workdir, "reuploads"), 3, 0.05)
    bodies = [p.read_bytes() for p in paths]
    service = hostile_service(workdir, "reuploads", admin)
    statuses: list[int] = []
    mismatches = lost = 0
    try:
        with Client(service.url, admin) as coordinator:
            job = coordinator.create_job("avg", ["a"])

            def upload(i: int) -> None:
                for _ in range(400):  # bounded: a busy slot answers 429
                    status = put(service, job["id"], "a", job["tokens"]["a"],
                                 bodies[i % 3]).status_code
                    statuses.append(status)
                    if status != 429:
                        return
                    time.sleep(0.01)

            for _ in range(rounds):
                with ThreadPoolExecutor(15) as pool:
                    list(pool.map(upload, range(15)))
                folder = service.data_dir / "jobs" / job["id"]
                record = json.loads((folder / "job.json").read_text())["slots"].get("a")
                files = sorted((folder / "clients").iterdir())
                lost += record is None or not files
                mismatches += bool(record and (
                    [f.name for f in files] != [record["file"]]
                    or _sha256(files[0]) != record["sha256"]))
    finally:
        service.stop()
    return {"case": "reuploads", "rounds": rounds, "uploads": 15 * rounds,
            "accepted": statuses.count(201), "busy_429": statuses.count(429),
            "other_statuses": sorted(set(statuses) - {201, 429}),
            "slot_mismatches": mismatches, "slots_lost": lost}


def slow_case(workdir: Path, trickles: int = 16, others: int = 8) -> dict[str, Any]:
    """Trickling uploads against a server cutting uploads below 1000 bytes/s after 3 s."""
    admin = secrets.token_urlsafe(32)
    paths = write_clients(_folder(workdir, "slow"), others + 1, 0.05)
    service = hostile_service(workdir, "slow", admin, "--upload-idle-timeout", "3",
                              "--upload-min-rate", "1000")
    body = paths[0].read_bytes()
    try:
        with Client(service.url, admin) as coordinator:
            job = coordinator.create_job("avg", ["slow", *[f"c{i}" for i in range(others)]])
        answers: list[tuple[int, float]] = []

        def trickle() -> None:
            start = time.perf_counter()
            with socket.create_connection(("127.0.0.1", service.port), timeout=30) as sock:
                sock.sendall(f"PUT /v1/jobs/{job['id']}/clients/slow/checkpoint HTTP/1.1\r\n"
                             f"Host: x\r\nAuthorization: Bearer {job['tokens']['slow']}\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode())
                sock.settimeout(1.0)
                for byte in body[:120]:  # one byte a second, at most two minutes
                    with contextlib.suppress(OSError):
                        sock.sendall(bytes([byte]))
                    with contextlib.suppress(TimeoutError):
                        answer = sock.recv(65536)
                        if answer:
                            answers.append((int(answer.split()[1]),
                                            time.perf_counter() - start))
                            return
                answers.append((0, time.perf_counter() - start))

        latencies, busy = [], []

        def normal(i: int) -> None:
            time.sleep(1.0)  # once the trickles hold what they can
            with Client(service.url, job["tokens"][f"c{i}"], on_retry=busy.append) as client:
                start = time.perf_counter()
                client.submit(job["id"], f"c{i}", paths[i + 1])
                latencies.append(time.perf_counter() - start)

        with ThreadPoolExecutor(trickles + others) as pool:
            futures = [pool.submit(trickle) for _ in range(trickles)]
            futures += [pool.submit(normal, i) for i in range(others)]
            for future in futures:
                future.result()
    finally:
        service.stop()
    held = [seconds for status, seconds in answers if status == 408]
    return {"case": "slow", "trickles": trickles,
            "refused_at_once_429": sum(status == 429 for status, _ in answers),
            "cut_by_min_rate_408": len(held),
            "held_place_s": round(max(held), 1) if held else None,
            "never_answered": sum(status == 0 for status, _ in answers),
            "other_clients": others, "other_clients_429": len(busy),
            "other_upload_p50_ms": round(1e3 * float(np.percentile(latencies, 50)), 1),
            "other_upload_max_ms": round(1e3 * max(latencies), 1)}


def big_file_case(workdir: Path, case: str, tensors: dict[str, Any]) -> dict[str, Any]:
    """One upload of ``tensors``: memory of the API server and its checkers, /healthz."""
    admin = secrets.token_urlsafe(32)
    path = workdir / f"{case}.safetensors"
    write_start = time.perf_counter()
    safetensors.numpy.save_file(tensors, path)
    write_s = time.perf_counter() - write_start
    del tensors
    size = path.stat().st_size
    service = hostile_service(workdir, case, admin,
                              "--max-checkpoint-bytes", str(size + 2**20))
    try:
        with Client(service.url, admin) as coordinator:
            job = coordinator.create_job("avg", ["a"])
            first = coordinator.create_job("avg", ["a"])  # its upload starts a checker
            coordinator.submit(first["id"], "a", save_checkpoint(
                workdir / f"{case}-first.safetensors", {"w": np.ones(2, np.float32)}, {}))
        processes = {"api": service.process.pid,
                     **{f"checker{i}": pid for i, pid in
                        enumerate(spawned(service.process.pid))}}
        before = {name: status_mb("VmRSS", pid) for name, pid in processes.items()}
        for pid in processes.values():
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        idle = probe_healthz(service.url, lambda: time.sleep(3))  # the peer: no upload
        timing: dict[str, float] = {}

        def upload() -> None:
            start = time.perf_counter()
            with Client(service.url, admin, timeout=600) as client:
                client.submit(job["id"], "a", path)
            timing["upload_s"] = time.perf_counter() - start

        busy = probe_healthz(service.url, upload)
        grown = {name: round(status_mb("VmHWM", pid) - before[name], 1)
                 for name, pid in processes.items()}
    finally:
        service.stop()
        path.unlink(missing_ok=True)
    return {"case": case, "file_mb": round(size / 1e6, 1), "write_s": round(write_s, 1),
            "upload_and_check_s": round(timing["upload_s"], 1),
            "api_rss_before_mb": round(before["api"], 1),
            "api_peak_growth_mb": grown["api"],
            "checker_peak_growth_mb": max(v for k, v in grown.items() if k != "api"),
            **_latencies("healthz_idle", idle), **_latencies("healthz_during_upload", busy)}


def probe_healthz(url: str, during: Any) -> list[float]:
    """/healthz latencies (s), asked every 20 ms by a process of its own (this one's GIL,
    busy hashing and checking the upload's file, must not delay the answers) while
    ``during()`` runs here."""
    context = multiprocessing.get_context("spawn")
    ready, stop, results = context.Event(), context.Event(), context.Queue()
    prober = context.Process(target=_probe, args=(url, ready, stop, results))
    prober.start()
    try:
        if not ready.wait(120):
            raise TimeoutError("the /healthz prober did not start")
        during()
    finally:
        stop.set()
        latencies = results.get(timeout=120)
        prober.join(30)
    return latencies


def _probe(url: str, ready: Any, stop: Any, results: Any) -> None:
    latencies = []
    with httpx.Client(timeout=60, verify=tls_context()) as session:
        session.get(f"{url}/healthz").raise_for_status()  # connected
        ready.set()
        while not stop.is_set():
            asked = time.perf_counter()
            session.get(f"{url}/healthz").raise_for_status()
            latencies.append(time.perf_counter() - asked)
            time.sleep(0.02)
    results.put(latencies)


def _latencies(name: str, seconds: list[float]) -> dict[str, Any]:
    ms = 1e3 * np.array(seconds)
    return {f"{name}_samples": len(ms), f"{name}_p50_ms": round(float(np.median(ms)), 1),
            f"{name}_p99_ms": round(float(np.percentile(ms, 99)), 1),
            f"{name}_max_ms": round(float(ms.max()), 1)}


def hostile(args: argparse.Namespace, workdir: Path) -> list[dict[str, Any]]:
    cases = {
        "reuploads": lambda: reuploads_case(workdir),
        "slow": lambda: slow_case(workdir),
        "big-tensor": lambda: big_file_case(workdir, "big-tensor", {
            "w": np.ones(args.big_tensor_mb * 2**20 // 4, np.float32)}),
        "big-header": lambda: big_file_case(workdir, "big-header", {
            f"layer.{i}.w": np.ones(1, np.float32) for i in range(args.header_tensors)}),
    }
    rows = []
    for name in args.cases:
        if name in cases:
            row = cases[name]()
            print(row, flush=True)
            rows.append(row)
    return rows


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
    parser.add_argument("--cases", nargs="+", default=["load", *HOSTILE],
                        choices=["load", *HOSTILE], help="what to run (default: all)")
    parser.add_argument("--big-tensor-mb", type=int, default=1024)
    parser.add_argument("--header-tensors", type=int, default=200_000)
    parser.add_argument("--json-out", default="benchmarks/results/bench_service.json")
    args = parser.parse_args(argv)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="fusekit-bench-service-") as tmp:
        workdir = Path(tmp)
        if "load" in args.cases:
            rows += run(args, "", workdir)
            if args.redis:
                with redis_server(args.redis, workdir) as url:
                    rows += run(args, url, workdir)
        hostile_rows = hostile(args, workdir)
    machine = machine_info(load_average_before=load_before, load_average_after=os.getloadavg())
    write_json(args.json_out, {"machine": machine,
                               "clients": args.clients, "max_uploads": args.max_uploads,
                               "rows": rows, "hostile": hostile_rows})


if __name__ == "__main__":
    main()
