"""``fusekit serve`` and ``fusekit worker``: run the fusion service (needs the serve extra)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from fusekit._cli.output import stderr
from fusekit.core.checkpoint import VALUE_CHECK_BYTES
from fusekit.core.stats import DEFAULT_MIN_SAMPLES

DataDir = Annotated[Path, typer.Option(
    "--data-dir", envvar="FUSEKIT_DATA_DIR",
    help="Jobs, uploads, results, the SQLite queue and admin.token; shared by every server "
    "and worker of one service.")]
Broker = Annotated[str, typer.Option(
    "--broker", envvar="FUSEKIT_BROKER",
    help="Redis URL of the queue, for workers on several machines [default: SQLite in "
    "--data-dir].")]
Lease = Annotated[float, typer.Option(
    "--job-lease", envvar="FUSEKIT_LEASE_S",
    help="Seconds without a sign of life after which a running job's worker is taken for "
    "dead and the job is run again.")]


def serve(
    data_dir: DataDir,
    host: Annotated[str, typer.Option("--host", help="Address to bind; 0.0.0.0 exposes the "
                                      "service to the network (put TLS in front).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8420,
    workers: Annotated[int, typer.Option(
        "--workers", min=0, help="Worker processes to start (0: run `fusekit worker` "
        "elsewhere).")] = 1,
    broker: Broker = "",
    max_checkpoint_bytes: Annotated[int, typer.Option(
        "--max-checkpoint-bytes", min=1, help="Largest upload a job may accept.")] = 4 * 1024**3,
    max_uploads: Annotated[int, typer.Option(
        "--max-uploads", min=1, help="Uploads received at once; more get HTTP 429.")] = 16,
    max_jobs: Annotated[int, typer.Option(
        "--max-jobs", min=1, help="Jobs kept by the service; more get HTTP 429.")] = 1000,
    lease: Lease = 30.0,
    upload_idle: Annotated[float, typer.Option(
        "--upload-idle-timeout", min=0.001,
        help="Seconds an upload may send nothing before it is abandoned.")] = 60.0,
    upload_min_rate: Annotated[float, typer.Option(
        "--upload-min-rate", min=1,
        help="Bytes per second an upload must average after its first "
        "--upload-idle-timeout seconds, else it is abandoned.")] = 100_000.0,
    upload_check_bytes: Annotated[int, typer.Option(
        "--upload-check-bytes", min=1024**2,
        help="Memory one upload's value check works in, whatever the tensors' size.")
                                  ] = VALUE_CHECK_BYTES,
    min_stats_samples: Annotated[int, typer.Option(
        "--min-stats-samples", min=1,
        help="A calibrating job refuses statistics files over fewer inputs (the moments of a "
        "few samples reveal them).")] = DEFAULT_MIN_SAMPLES,
    max_job_memory: Annotated[int | None, typer.Option(
        "--max-job-memory", min=1, show_default="the machine's memory",
        help="Bytes one job's fusion may need: wider fused widths are refused when the job "
        "is created.")] = None,
) -> None:
    """Run the fusion service: the HTTP API and its worker processes, until Ctrl-C."""
    from fusekit.service.server import serve as run_server
    from fusekit.service.settings import Settings

    settings = Settings(data_dir=data_dir.resolve(), broker=broker,
                        max_checkpoint_bytes=max_checkpoint_bytes, max_uploads=max_uploads,
                        max_jobs=max_jobs, lease_s=lease, upload_idle_s=upload_idle,
                        upload_min_rate=upload_min_rate,
                        upload_check_bytes=upload_check_bytes,
                        min_stats_samples=min_stats_samples,
                        **({} if max_job_memory is None else {"max_job_memory": max_job_memory}))
    run_server(settings, host=host, port=port, workers=workers,
               announce=lambda line: stderr.print(line, highlight=False, soft_wrap=True))


def worker(data_dir: DataDir, broker: Broker = "", lease: Lease = 30.0) -> None:
    """Run one worker process of the fusion service, until Ctrl-C or SIGTERM."""
    from fusekit.service.settings import Settings
    from fusekit.service.worker import work

    settings = Settings.from_env({**os.environ, "FUSEKIT_DATA_DIR": str(data_dir.resolve()),
                                  "FUSEKIT_BROKER": broker, "FUSEKIT_LEASE_S": str(lease)})
    parent = os.environ.get("FUSEKIT_PARENT_PID")
    work(settings, parent=int(parent) if parent else None)
