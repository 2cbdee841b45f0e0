"""``fusekit submit``: a client uploads its checkpoint (or, to a job that calibrates, its
statistics of the fused model) with a progress bar; ``fusekit fetch`` downloads that fused
model with the client's token."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from fusekit._cli.output import stderr, stdout

Server = Annotated[str, typer.Argument(help="The service's URL.", show_default=False)]
JobOption = Annotated[str, typer.Option("--job", help="The job's id.")]
ClientOption = Annotated[str, typer.Option("--client", help="Your client name in the job.")]
TokenOption = Annotated[str, typer.Option(
    "--token", envvar="FUSEKIT_TOKEN",
    help="Your upload token (better: the FUSEKIT_TOKEN variable, which ps does not show).")]


def submit(
    server: Server,
    checkpoint: Annotated[Path, typer.Argument(
        help="Your checkpoint (.safetensors), your statistics of the job's fused model "
        "(fusekit stats FUSED --mode batch ...) or of your own checkpoint (fusekit stats "
        "OWN ...: the targets).", show_default=False)],
    job: JobOption,
    client: ClientOption,
    token: TokenOption,
) -> None:
    """Upload a checkpoint into your slot of a job (resumable).

    A statistics file (told by its metadata) goes to your slots of a job that calibrates:
    statistics of its fused model to your statistics slot, statistics of your own
    checkpoint to your targets slot (REPAIR's targets, for layers without BatchNorm).
    Run it again after an interruption: a file the slot already holds (same SHA-256) is
    not sent again, and a service that does not answer is tried again a few times. A busy
    service (HTTP 429/503) is tried again after the wait it asks for, with backoff, for up
    to 10 minutes; a line on stderr says each time."""
    from fusekit.client import Client
    from fusekit.core import metadata as meta
    from fusekit.core.checkpoint import load_checkpoint

    statistics = meta.STATS in load_checkpoint(checkpoint).metadata
    columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with (Progress(*columns, console=stderr) as bar,
          Client(server, token, on_retry=lambda line: bar.console.print(
              line, highlight=False, soft_wrap=True)) as service):
        task = bar.add_task(f"{checkpoint.name} → {client}", total=checkpoint.stat().st_size)
        progress = lambda sent, total: bar.update(task, completed=sent)  # noqa: E731
        if statistics:
            kind, slot = service.submit_any_statistics(job, client, checkpoint, progress)
        else:
            kind, slot = "checkpoint", service.submit(job, client, checkpoint, progress)
    what = {"checkpoint": "", "statistics": "statistics ", "targets": "targets "}[kind]
    stdout.print(f"{client}: accepted {what}{slot['size']} bytes, sha256 {slot['sha256']}",
                 highlight=False)


def fetch(
    server: Server,
    job: JobOption,
    client: ClientOption,
    token: TokenOption,
    output: Annotated[Path, typer.Option("--output", "-o", help="Where to write it.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing file.")] = False,
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds to wait at most for the fusion to finish.")] = 3600.0,
) -> None:
    """Download the fused model of a job that calibrates, once fused (waits for it).

    Compute your statistics of it on your own data (fusekit stats FUSED --mode batch
    --data-path ... -o STATS) and upload them with fusekit submit."""
    from fusekit.client import Client
    from fusekit.core.checkpoint import check_output_path, private_files

    check_output_path(output, force=force)
    with Client(server, token, on_retry=lambda line: stderr.print(
            line, highlight=False, soft_wrap=True)) as service, private_files():
        state = service.wait(job, timeout=timeout)
        service.fused(job, output)  # a job that failed or does not calibrate: its refusal
    stdout.print(f"wrote {output} (job {job}: {state['state']})", highlight=False)
