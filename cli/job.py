"""``fusekit job ...``: what a coordinator does with the service's jobs (the admin token)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from fusekit._cli.options import Command, Group, JsonOption
from fusekit._cli.output import emit_json, handle_errors, stderr, stdout
from fusekit.core.errors import ParameterError
from fusekit.service.states import job_in_state

app = typer.Typer(cls=Group, no_args_is_help=True,
                  help="Create, follow and collect fusion jobs on a fusekit service.")

Server = Annotated[str, typer.Option("--server", envvar="FUSEKIT_SERVER",
                                     help="The service's URL.")]
TokenFile = Annotated[Path | None, typer.Option(
    "--admin-token-file", envvar="FUSEKIT_ADMIN_TOKEN_FILE",
    help="File holding the admin token (e.g. DATA_DIR/admin.token) [default: the "
    "FUSEKIT_ADMIN_TOKEN variable].")]
JobId = Annotated[str, typer.Argument(help="The job's id.", show_default=False)]
DEFAULT_SERVER = "http://127.0.0.1:8420"


def command(name: str):
    """A ``fusekit job`` subcommand under the CLI's error policy."""
    return lambda function: app.command(name, cls=Command)(handle_errors(function))


def admin(server: str, token_file: Path | None):
    from fusekit.client import Client

    token = os.environ.get("FUSEKIT_ADMIN_TOKEN", "").strip()
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise ParameterError(f"--admin-token-file {token_file}: cannot read it "
                                 f"({exc.strerror})") from None
    if not token:
        raise ParameterError("admin token: expected FUSEKIT_ADMIN_TOKEN, FUSEKIT_ADMIN_TOKEN_FILE "
                             "or --admin-token-file, found none")
    return Client(server, token, on_retry=lambda line: stderr.print(
        line, highlight=False, soft_wrap=True))


@command("create")
def create(
    method: Annotated[str, typer.Option("--method", "-m", help="Fusion method.")],
    clients: Annotated[str, typer.Option("--clients", help="Client names, comma-separated.")],
    param: Annotated[list[str] | None, typer.Option(
        "--param", help="A method parameter NAME=VALUE (VALUE as JSON, else a string); "
        "repeat for several.")] = None,
    max_checkpoint_bytes: Annotated[int | None, typer.Option(
        "--max-checkpoint-bytes", min=1, help="Upload size limit of this job.")] = None,
    auto_run: Annotated[bool, typer.Option(
        "--auto-run", help="Run the job as soon as every client has submitted.")] = False,
    calibrate: Annotated[bool, typer.Option(
        "--calibrate", help="After fusion, calibrate the fused model with the statistics "
        "each client computes of it on its own data (one round).")] = False,
    protocol: Annotated[str, typer.Option(
        "--protocol", metavar="one-pass|layerwise|align",
        help="With --calibrate, its rounds: one-pass (one round), layerwise (one round per "
        "calibrated layer: exact), align (calibration, an alignment round, then one refit "
        "round per layer: for independently trained clients).")] = "one-pass",
    input_moments: Annotated[bool, typer.Option(
        "--input-moments", help="With --protocol layerwise: the first layer from the input "
        "moments of the clients' targets, without a round (docs/service.md: what they reveal).")
    ] = False,
    config: Annotated[Path | None, typer.Option(
        "--config", help="A transformer job: the clients' config.json; the fused model and "
        "the result are then served with it, at the fused widths, as model folders.",
        show_default=False)] = None,
    server: Server = DEFAULT_SERVER,
    token_file: TokenFile = None,
    as_json: JsonOption = False,
) -> None:
    """Create a job; prints its id and one upload token per client (shown only once)."""
    params = dict(_param(p) for p in param or [])
    with admin(server, token_file) as service:
        job = service.create_job(method, [c.strip() for c in clients.split(",")], params=params,
                                 max_checkpoint_bytes=max_checkpoint_bytes, auto_run=auto_run,
                                 calibrate=calibrate, protocol=protocol,
                                 input_moments=input_moments, config=_config(config))
    if as_json:
        emit_json(job)
        return
    stdout.print(f"job {job['id']}", highlight=False)
    for client, token in job["tokens"].items():
        stdout.print(f"  {client}: {token}", highlight=False)


def _config(path: Path | None) -> dict[str, Any] | None:
    from fusekit.core.metadata import load_json

    if path is None:
        return None
    try:
        text = path.read_text()
    except OSError as exc:
        raise ParameterError(f"--config {path}: cannot read it ({exc.strerror})") from None
    config = load_json(text, f"--config {path}", ParameterError)
    if not isinstance(config, dict):
        raise ParameterError(f"--config {path}: expected a JSON object (config.json), found "
                             f"{type(config).__name__}")
    return config


def _param(text: str) -> tuple[str, Any]:
    name, sep, raw = text.partition("=")
    if not sep or not name:
        raise ParameterError(f"--param {text!r}: expected NAME=VALUE")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


@command("list")
def list_jobs(server: Server = DEFAULT_SERVER, token_file: TokenFile = None,
              as_json: JsonOption = False) -> None:
    """Every job on the service, newest first: state, method, checkpoints received, age."""
    with admin(server, token_file) as service:
        jobs = service.jobs()
    if as_json:
        emit_json(jobs)
        return
    if not jobs:
        stdout.print(f"no jobs on {server}", highlight=False)
        return
    table = Table("state", "method", "checkpoints", "created")
    table.add_column("job", no_wrap=True)  # whole, to copy into the next command
    for job in jobs:
        notes = [job["progress"], job["statistics"] and f"{job['statistics']} statistics"]
        state = job["state"] + "".join(f", {note}" for note in notes if note)
        table.add_row(state, job["method"], f"{job['filled']} of {job['clients']}",
                      _age(time.time() - job["created_at"]), job["id"])
    stdout.print(table)


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{seconds:.0f} s ago"


@command("status")
def status(job: JobId, server: Server = DEFAULT_SERVER, token_file: TokenFile = None,
           as_json: JsonOption = False) -> None:
    """Who has submitted, and whether the job is queued, running, calibrating or done."""
    with admin(server, token_file) as service:
        state = service.status(job)
    if as_json:
        emit_json(state)
        return
    table = Table(title=f"job {job}: {state['state']}", show_header=False)
    table.add_row("method", f"{state['method']} {state['params'] or ''}")
    if state["progress"]:
        table.add_row("progress", state["progress"])
    for moment in ("created", "queued", "started", "finished"):
        if state[f"{moment}_at"]:
            table.add_row(moment, time.strftime("%Y-%m-%d %H:%M:%S",
                                                time.localtime(state[f"{moment}_at"])))
    if state["attempts"] > 1:
        table.add_row("attempts", str(state["attempts"]))
    if state["error"]:
        table.add_row("error", state["error"])
    if state["fused"]:
        table.add_row("fused model", _file(state["fused"]))
    if state.get("round") and state["state"] == "calibrating":
        table.add_row("round", f"{state['protocol']}: {state['round']['asks']}")
    for client, slot in state["slots"].items():
        table.add_row(client, _file(slot) if slot["filled"] else "waiting")
    for kind in ("statistics", "targets"):
        for client, slot in state.get(kind, {}).items():
            table.add_row(f"{client} {kind}", _file(slot) if slot["filled"] else "waiting")
    waiting = state.get("waiting_for") or {}
    if any(waiting.values()):
        table.add_row("waiting for", "; ".join(f"{kind} of {', '.join(clients)}"
                                               for kind, clients in waiting.items() if clients))
    stdout.print(table)


def _file(slot: dict[str, Any]) -> str:
    return f"{slot['size']} bytes, sha256 {slot['sha256'][:16]}…"


@command("run")
def run(job: JobId, server: Server = DEFAULT_SERVER, token_file: TokenFile = None) -> None:
    """Queue a job whose clients have all submitted."""
    with admin(server, token_file) as service:
        stdout.print(f"job {job}: {service.run(job)['state']}", highlight=False)


@command("wait")
def wait(job: JobId, timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds to wait at most.")] = 3600.0,
         server: Server = DEFAULT_SERVER, token_file: TokenFile = None) -> None:
    """Wait until the job has finished (exit 1: failed) or waits for statistics.

    A job that calibrates waits, once fused, for its clients' statistics (calibrating)."""
    with admin(server, token_file) as service:
        state = service.wait(job, timeout=timeout)
    if state["state"] == "succeeded":
        stdout.print(f"job {job}: succeeded", highlight=False)
        return
    if state["state"] == "calibrating":
        stdout.print(f"job {job}: calibrating: fused, waiting for the clients' statistics "
                     "(and targets where the fused model has no BatchNorm; fusekit job "
                     "calibrate to go on with those received)", highlight=False)
        return
    reason = f": {state['error']}" if state.get("error") else ""
    stdout.print(f"{job_in_state(job, state['state'])}{reason}", highlight=False,
                 soft_wrap=True)
    raise typer.Exit(1)


Output = Annotated[Path, typer.Option("--output", "-o", help="Where to write it.")]
Force = Annotated[bool, typer.Option("--force", help="Replace an existing file.")]


@command("calibrate")
def calibrate(job: JobId, server: Server = DEFAULT_SERVER, token_file: TokenFile = None
              ) -> None:
    """Calibrate now (finish the current round), with the statistics received so far.

    A calibrating job goes on by itself once every client's statistics of the round are in
    (and, where its fused model has no BatchNorm, every client's targets: then at least one
    client's are needed here). A refit round refits with the clients that sent theirs."""
    with admin(server, token_file) as service:
        stdout.print(f"job {job}: {service.calibrate(job)['state']}", highlight=False)


@command("result")
def result(job: JobId, output: Output, force: Force = False,
           server: Server = DEFAULT_SERVER, token_file: TokenFile = None) -> None:
    """Download the fused checkpoint of a job that succeeded (calibrated if it calibrates)."""
    _download(job, output, force, server, token_file, "result")


@command("fused")
def fused(job: JobId, output: Output, force: Force = False,
          server: Server = DEFAULT_SERVER, token_file: TokenFile = None) -> None:
    """Download the fused model of a job that calibrates, before calibration."""
    _download(job, output, force, server, token_file, "fused")


def _download(job: str, output: Path, force: bool, server: str, token_file: Path | None,
              which: str) -> None:
    from fusekit.core.checkpoint import check_output_path, private_files

    check_output_path(output, force=force)
    with admin(server, token_file) as service, private_files():
        getattr(service, which)(job, output)
    stdout.print(f"wrote {output}", highlight=False)


@command("report")
def report(job: JobId, server: Server = DEFAULT_SERVER, token_file: TokenFile = None) -> None:
    """The fusion report, as `fusekit fuse --json` prints it."""
    with admin(server, token_file) as service:
        emit_json(service.report(job))


@command("delete")
def delete(job: JobId, server: Server = DEFAULT_SERVER, token_file: TokenFile = None) -> None:
    """Cancel a job and remove its files."""
    with admin(server, token_file) as service:
        service.delete(job)
    stdout.print(f"job {job}: deleted", highlight=False)
