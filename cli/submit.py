"""``fusekit submit``: a client uploads its checkpoint (or, to a job that calibrates, its
statistics of a round's model) with a progress bar; ``fusekit fetch`` downloads the current
round's model with the client's token; ``fusekit contribute`` does every calibration round
for a client."""

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

from fusekit._cli.calibrate import ClientDataOption, client_inputs
from fusekit._cli.options import (
    DataDirOption,
    DataPathOption,
    DeviceOption,
    NormalizeOption,
    normalization_option,
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


def contribute(
    server: Server,
    model: Annotated[Path, typer.Argument(
        help="Your own checkpoint (.safetensors, or a Hugging Face model folder): the one "
        "you submitted to the job.", show_default=False)],
    job: JobOption,
    client: ClientOption,
    token: TokenOption,
    work_dir: Annotated[Path, typer.Option(
        "--work-dir", help="Where the rounds' models and your statistics files are kept.")
    ] = Path("."),
    data: ClientDataOption = None,
    data_dir: DataDirOption = None,
    data_path: DataPathOption = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Inputs per forward pass.")
                          ] = 1024,
    device: DeviceOption = "cpu",
    timeout: Annotated[float, typer.Option(
        "--timeout", help="Seconds to take part at most.")] = 3600.0,
    normalize: NormalizeOption = None,
) -> None:
    """Take part in a job's calibration rounds until the job has finished.

    Each round the job asks every client for one file computed on its own data: your
    statistics of the round's model, cross statistics of it and your own model (an
    alignment round), or refit statistics of one layer (a refit round); and, where the
    job needs them, your targets (statistics of your own model). This downloads each
    round's model, computes what the round asks and uploads it, round after round; only
    these aggregates leave your machine (docs/calibration.md, "What leaves a client").
    The data is used as stored; each model normalises it as its checkpoint records
    (fusekit.preprocess), or as --normalize says, as fusekit stats does."""
    from fusekit.client import Client
    from fusekit.core.checkpoint import private_files

    normalization = normalization_option(normalize)
    name, inputs = client_inputs(data, data_dir, data_path)
    work_dir.mkdir(parents=True, exist_ok=True)
    tell = lambda line: stderr.print(line, highlight=False, soft_wrap=True)  # noqa: E731
    with Client(server, token, on_retry=tell) as service, private_files():
        state = service.take_part(job, client, model, inputs, work_dir, timeout=timeout,
                                  batch_size=batch_size, device=device,
                                  normalization=normalization,
                                  on_round=lambda asks: tell(f"{client}: {asks} ({name})"))
    reason = f": {state['error']}" if state.get("error") else ""
    stdout.print(f"job {job}: {state['state']}{reason}", highlight=False, soft_wrap=True)
    if state["state"] != "succeeded":
        raise typer.Exit(1)


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
    """Download the model of a calibrating job's current round (waits for the fusion).

    In the first round it is the fused model; for a transformer job given its config, a
    folder (config.json, model.safetensors).

    Compute what the round asks of it on your own data (job status says; one pass:
    fusekit stats MODEL --mode batch --data-path ... -o STATS) and upload it with fusekit
    submit; fusekit contribute does every round for you."""
    from fusekit.client import Client
    from fusekit.core.checkpoint import check_output_path, private_files

    check_output_path(output, force=force)
    with Client(server, token, on_retry=lambda line: stderr.print(
            line, highlight=False, soft_wrap=True)) as service, private_files():
        state = service.wait(job, timeout=timeout)
        if not state.get("calibrate"):
            service.fused(job, output)  # its refusal: the job does not calibrate
        service.model(job, output)  # a job that failed: its refusal
    asks = (state.get("round") or {}).get("asks", "")
    stdout.print(f"wrote {output} (job {job}: {state['state']}; {asks})", highlight=False,
                 soft_wrap=True)
