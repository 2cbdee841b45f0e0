"""OT fusion and AMS inference benchmark (``python benchmarks/bench_ot_ams.py``; the OT/AMS rows
of ``benchmarks/bench_fusion.py``).

OT fusion (ALGORITHMS.md §5), clients = noisy, permuted copies of one random network:

- 784-100-10 MLP, S clients, equal widths: fusekit (C++ assignment) against the same
  alignment with POT's ``ot.emd`` for every plan (what the authors' OTFusion code runs),
  weights mode; both in the same run, ratio = emd / fusekit.
- the same MLP with widths 90..110 (unequal: EMD for both), and with the activation cost
  on 256 inputs;
- 784-1000-10, 10 clients (where the plan solver dominates);
- a 3-conv CNN (64-96-128 channels, BatchNorm, 3x32x32), 16 clients.
Quality: relative L2 error of the fused model's logits against the original network on
random inputs (OT undoes the permutations; coordinate averaging cannot).

AMS inference (ALGORITHMS.md §6): samples/s of the loaded AMS module on batches of 1024,
top1 and full, S equal 784-100-10 MLPs and a mixed set (MLPs of depth 1-5 + a CNN), with
the same-architecture groups vectorised (vmap) or run model by model (the module's
default: vmap on CUDA only); CPU, and GPU when torch sees one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from bench_support import machine_info, permuted_copies, random_cnn, random_mlp, write_json

from fusekit.core import neurons
from fusekit.core.checkpoint import Checkpoint
from fusekit.core.spec import infer_spec
from fusekit.methods.base import sample_weights
from fusekit.methods.ot import align_to_anchor, average_layers


def _fuse_ot(clients: Sequence[Checkpoint], solver: str, inputs: np.ndarray | None):
    """OT fusion as ``fusekit.fuse(method="ot")`` runs it, with a choice of plan solver."""
    specs = [infer_spec({n: i.shape for n, i in c.tensors.items()}) for c in clients]
    pre = None
    if inputs is not None:
        from fusekit.toolkit.nn.fused import hidden_preactivations

        pre = [hidden_preactivations(c, s, inputs) for c, s in zip(clients, specs, strict=True)]
    layers = [neurons.client_layers(c, s) for c, s in zip(clients, specs, strict=True)]
    aligned, _, _ = align_to_anchor(layers, 0, pre, solver=solver)
    weights = sample_weights(clients)
    fused = [average_layers([a[i] for a in aligned], weights) for i in range(len(layers[0]))]
    return neurons.to_state_dict(clients, specs[0], fused)


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times)), out


def _logit_error(state: dict[str, np.ndarray], reference: dict[str, np.ndarray],
                 input_shape: tuple[int, ...]) -> float:
    from fusekit.toolkit.nn.fused import build_plain_model

    if len(input_shape) > 1:
        return float("nan")  # conv models need fusekit.arch to be rebuilt; timing only
    x = np.random.default_rng(1).normal(size=(256, *input_shape)).astype(np.float32)
    import torch

    with torch.no_grad():
        got = build_plain_model(state, None, None, "fused")(torch.from_numpy(x)).numpy()
        want = build_plain_model(reference, None, None, "reference")(torch.from_numpy(x)).numpy()
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def run_ot(sizes: Sequence[int], repeats: int) -> list[dict[str, Any]]:
    rows = []
    reference = random_mlp()
    for n_clients in sizes:
        rng = np.random.default_rng(n_clients)
        cases = [
            ("equal widths", permuted_copies(reference, n_clients, 0.05, n_clients), None),
            ("widths 90-110", permuted_copies(reference, n_clients, 0.05, n_clients,
                                              rng.integers(90, 111, n_clients)), None),
            ("activations", permuted_copies(reference, n_clients, 0.05, n_clients),
             np.random.default_rng(0).normal(size=(256, 784)).astype(np.float32)),
        ]
        for label, clients, inputs in cases:
            row = {"case": f"ot mlp784-100-10 S={n_clients} {label}"}
            for solver in ("auto", "emd"):
                _fuse_ot(clients[:2], solver, None if inputs is None else inputs[:8])  # warm-up
                seconds, state = _median_time(lambda c=clients, s=solver, x=inputs:
                                              _fuse_ot(c, s, x), repeats)
                row[f"{solver}_s"] = seconds
                if solver == "auto":
                    row["logit_error"] = _logit_error(state, reference, (784,))
            row["speedup_vs_emd"] = row["emd_s"] / row["auto_s"]
            rows.append(row)
            _print(row)
    avg = {k: np.mean([c.tensor(k) for c in permuted_copies(reference, 10, 0.05, 10)], axis=0)
           for k in reference}
    row = {"case": "avg mlp784-100-10 S=10 (no alignment)",
           "logit_error": _logit_error(avg, reference, (784,))}
    rows.append(row)
    _print(row)
    wide = random_mlp(1000)
    clients = permuted_copies(wide, 10, 0.05, 3)
    row = {"case": "ot mlp784-1000-10 S=10 equal widths"}
    for solver in ("auto", "emd"):
        row[f"{solver}_s"], state = _median_time(lambda s=solver: _fuse_ot(clients, s, None), 1)
        if solver == "auto":
            row["logit_error"] = _logit_error(state, wide, (784,))
    row["speedup_vs_emd"] = row["emd_s"] / row["auto_s"]
    rows.append(row)
    _print(row)
    clients = permuted_copies(random_cnn(), 16, 0.05, 7)
    row = {"case": "ot cnn 3x(64,96,128) S=16 equal widths"}
    for solver in ("auto", "emd"):
        row[f"{solver}_s"], _ = _median_time(lambda s=solver: _fuse_ot(clients, s, None), 1)
    row["speedup_vs_emd"] = row["emd_s"] / row["auto_s"]
    rows.append(row)
    _print(row)
    return rows


def run_ams(n_models: int, batch: int, repeats: int) -> list[dict[str, Any]]:
    import torch

    from fusekit.toolkit.nn import build_model, convnet_arch, mlp_arch
    from fusekit.toolkit.nn.ams import AMSModel

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    sets = {
        f"{n_models} x mlp784-100-10": [build_model(mlp_arch(784, [100], 10), seed=i)
                                        for i in range(n_models)],
        "mixed: mlp depth 1-5 + cnn": [build_model(mlp_arch(784, [100] * d, 10), seed=d)
                                       for d in range(1, 6)]
        + [build_model(convnet_arch((1, 28, 28), [16, 32], 10), seed=9)],
    }
    rows = []
    for device in devices:
        x = torch.randn(batch, 1, 28, 28, device=device)
        for label, models in sets.items():
            for mode in ("top1", "full"):
                row = {"case": f"ams {label} {mode} batch={batch}", "device": device}
                for vectorise in (True, False):  # the module's own choice is tested elsewhere
                    model = AMSModel(models, mode=mode).to(device).eval()
                    model.vectorise = vectorise

                    def step(m=model, inputs=x, on_gpu=device == "cuda"):
                        with torch.no_grad():
                            out = m(inputs)
                        if on_gpu:
                            torch.cuda.synchronize()
                        return out

                    step()  # warm-up
                    seconds, _ = _median_time(step, repeats)
                    key = "vectorised" if vectorise else "model_by_model"
                    row[f"{key}_samples_per_s"] = batch / seconds
                rows.append(row)
                _print(row)
    return rows


def _print(row: dict[str, Any]) -> None:
    cells = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
             if k != "case"]
    print(f"{row['case']:<48} " + "  ".join(cells), flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 30])
    parser.add_argument("--ams-models", type=int, default=10)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="benchmarks/results/bench_ot_ams.json")
    args = parser.parse_args(argv)
    import torch

    rows = run_ot(args.clients, args.repeats) + run_ams(args.ams_models, args.batch,
                                                       args.repeats)
    cuda = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    machine = machine_info(torch=torch.__version__, torch_threads=torch.get_num_threads(),
                           cuda=cuda)
    write_json(args.json, {"machine": machine, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
