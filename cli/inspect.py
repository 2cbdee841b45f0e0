"""``fusekit inspect``: what is in a checkpoint, and what would block fusing it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from fusekit._cli.options import JsonOption
from fusekit._cli.output import emit_json, stdout
from fusekit.core.errors import FusekitError

#: Longer metadata values are cut in the text output.
METADATA_CHARS = 300


def inspect(
    files: Annotated[
        list[Path], typer.Argument(help="Checkpoints to inspect.", show_default=False)
    ],
    as_json: JsonOption = False,
) -> None:
    """Show layers, widths, permutation groups and metadata; exit 2 if fusion is blocked."""
    from fusekit.api import describe_checkpoint
    from fusekit.core.checkpoint import load_checkpoint

    reports, loaded = [], []
    for path in files:
        try:
            checkpoint = load_checkpoint(path)
        except FusekitError as exc:
            reports.append({"path": str(path), "problems": [str(exc)]})
            continue
        reports.append(describe_checkpoint(checkpoint))
        if not reports[-1]["problems"]:
            loaded.append(checkpoint)
    together = _fusion_problem(loaded) if len(loaded) > 1 else None
    if as_json:
        emit_json({"files": reports, "fusable_together": together is None and
                   all(not r["problems"] for r in reports), "problem": together})
    else:
        for report in reports:
            _print_report(report)
        if together:
            stdout.print(f"[bold red]cannot fuse these files together:[/] {together}")
    if together or any(r["problems"] for r in reports):
        raise typer.Exit(2)


def _fusion_problem(checkpoints) -> str | None:
    from fusekit.core.model_spec import check_compatible, client_spec

    try:
        check_compatible(checkpoints, [client_spec(c, None) for c in checkpoints])
    except FusekitError as exc:
        return str(exc)
    return None


def _print_report(report: dict[str, Any]) -> None:
    stdout.rule(report["path"])
    for problem in report["problems"]:
        stdout.print(f"[bold red]problem:[/] {problem}", highlight=False)
    if "ams" in report:
        ams = report["ams"]
        stdout.print(f"AMS artefact: {len(ams['models'])} models, mode {ams['mode']}, "
                     f"k {ams['k']}", highlight=False)
        for model in ams["models"]:
            stdout.print(_layer_table(model["layers"], title=f"model {model['prefix']}*"))
    if "layers" in report:
        stdout.print(_layer_table(report["layers"]))
    if "hidden_widths" not in report:
        return
    stdout.print(f"hidden widths: {report['hidden_widths']}  ·  {report['tensors']} tensors, "
                 f"{report['parameters']:,} values")
    names = report.get("group_names", [])
    for name, group in zip(names, report.get("permutation_groups", []), strict=True):
        stdout.print(f"permutation group {name}: " + ", ".join(group), highlight=False)
    for limit in report.get("limits", []):
        stdout.print(f"[bold yellow]limit:[/] {escape(limit)}", highlight=False)
    if report.get("other_tensors"):
        stdout.print("not permuted: " + ", ".join(report["other_tensors"]), highlight=False)
    for key, value in report["metadata"].items():
        text = str(value)
        if len(text) > METADATA_CHARS:  # e.g. fusekit.assignments: one index per neuron
            text = f"{text[:METADATA_CHARS]}... ({len(text):,} characters; --json shows all)"
        stdout.print(f"[dim]{key}[/] = {escape(text)}", highlight=False)


def _layer_table(layers: list[dict[str, Any]], title: str | None = None) -> Table:
    table = Table("layer", "kind", "in", "out", "kernel", "BatchNorm", "flatten block",
                  title=title)
    for layer in layers:
        kernel = "x".join(map(str, layer["kernel_size"])) if layer["kind"] == "conv2d" else ""
        table.add_row(layer["name"], layer["kind"], str(layer["in_features"]),
                      str(layer["out_features"]), kernel, layer["norm"] or "",
                      str(layer["input_block"]) if layer["input_block"] > 1 else "")
    return table
