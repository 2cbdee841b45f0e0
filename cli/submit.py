"""``fusekit submit``: a client uploads its checkpoint to a job, with a progress bar."""

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


def submit(
    server: Annotated[str, typer.Argument(help="The service's URL.", show_default=False)],
    checkpoint: Annotated[Path, typer.Argument(help="Your checkpoint (.safetensors).",
                                               show_default=False)],
    job: Annotated[str, typer.Option("--job", help="The job's id.")],
    client: Annotated[str, typer.Option("--client", help="Your client name in the job.")],
    token: Annotated[str, typer.Option(
        "--token", envvar="FUSEKIT_TOKEN",
        help="Your upload token (better: the FUSEKIT_TOKEN variable, which ps does not "
        "show).")],
) -> None:
    """Upload a checkpoint into your slot of a job (resumable).

    Run it again after an interruption: a file the slot already holds (same SHA-256) is
    not sent again, and a service that does not answer is tried again a few times. A busy
    service (HTTP 429/503) is tried again after the wait it asks for, with backoff, for up
    to 10 minutes; a line on stderr says each time."""
    from fusekit.client import Client

    columns = ("{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn())
    with (Progress(*columns, console=stderr) as bar,
          Client(server, token, on_retry=lambda line: bar.console.print(
              line, highlight=False, soft_wrap=True)) as service):
        task = bar.add_task(f"{checkpoint.name} → {client}", total=checkpoint.stat().st_size
                            if checkpoint.is_file() else None)
        slot = service.submit(job, client, checkpoint,
                              progress=lambda sent, total: bar.update(task, completed=sent))
    stdout.print(f"{client}: accepted {slot['size']} bytes, sha256 {slot['sha256']}",
                 highlight=False)
