"""The README.md model card of an output folder, with a loader that needs only torch and
safetensors (no fusekit): the layer list of each (sub-)model is written into the snippet."""

from __future__ import annotations

import json
import pprint
from typing import Any

from fusekit.core import metadata as meta
from fusekit.core.spec import PermutationSpec, spec_from_json

_FORWARD = '''\
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

t = load_file("fused.safetensors")
MODELS = {models}
K = {k}  # logits summed per input: those of the K most confident models (AMS)


def forward(model, x):
    x = x.reshape(len(x), *model["input"]) if model["input"] else x.flatten(1)
    for i, layer in enumerate(model["layers"]):
        if layer["kind"] == "linear":
            x = F.linear(x.flatten(1), t[layer["weight"]], t.get(layer["bias"]))
        else:
            x = F.conv2d(x, t[layer["weight"]], t.get(layer["bias"]), padding=layer["padding"])
        if layer["batchnorm"]:
            weight, bias, mean, var = (t.get(name) for name in layer["batchnorm"])
            x = F.batch_norm(x, mean, var, weight, bias, training=False, eps=layer["eps"])
        if i < len(model["layers"]) - 1:
            x = F.relu(x)
            if layer["encoding"]:  # position-aware neurons: a fixed per-neuron encoding
                code = t[layer["encoding"]]
                x = x + code if model["pan"] == "additive" else x * code
            if layer["pool"]:
                x = F.max_pool2d(x, 2)
    return x


def predict(x):
    """Logits (B, C) of inputs x (B, ...)."""
    logits = torch.stack([forward(model, x) for model in MODELS])  # (S, B, C)
    confidence = logits.amax(dim=2)  # most confident first, lower index on ties
    chosen = torch.sort(confidence, dim=0, descending=True, stable=True).indices[:K]
    return logits.gather(0, chosen[:, :, None].expand(-1, -1, logits.shape[2])).sum(0)
'''


def model_card(result, recipe: dict[str, Any]) -> str:
    """Markdown: method, parameters, inputs with content hashes, widths, a loader."""
    hashes = json.loads(result.metadata.get(meta.INPUTS, "[]"))
    clients = result.report.get("clients", [])
    inputs = "\n".join(f"| {label} | `{digest}` |" for label, digest in zip(clients, hashes,
                                                                             strict=False))
    params = "\n".join(f"| `{k}` | `{json.dumps(v, default=str)}` |"
                       for k, v in result.params.items()) or "| (none) | |"
    models, k = loader_models(result)
    widths = ", ".join(map(str, result.widths)) or "per sub-model: " + "; ".join(
        str(w) for w in result.report.get("hidden_widths", []))
    return f"""# Fused model ({result.method})

Made by fusekit from {len(hashes)} client checkpoint(s) in one shot, without data.

- method: `{result.method}`
- hidden widths: {widths}
- version: fusekit {result.metadata.get(meta.VERSION, "")}

## Parameters

| parameter | value |
|---|---|
{params}

## Inputs

| checkpoint | content hash (SHA-256 of the tensor names, dtypes, shapes and values) |
|---|---|
{inputs}

`recipe.yaml` reruns this fusion (`fusekit fuse --config recipe.yaml`); `report.json` is the
full report.

## Loading without fusekit

Only `torch` and `safetensors` are needed:

```python
{_FORWARD.format(models=pprint.pformat(models, width=88, sort_dicts=False), k=k)}
logits = predict(torch.zeros(2, {_input_size(models[0])}))
```

With fusekit: `fusekit.load_fused("fused.safetensors")`.
"""


def loader_models(result) -> tuple[list[dict[str, Any]], int]:
    """The layer lists the loader snippet runs, and how many models' logits it sums."""
    shapes = {name: tuple(a.shape) for name, a in result.state_dict.items()}
    if meta.AMS in result.metadata:
        description = json.loads(result.metadata[meta.AMS])
        models = []
        for entry in description["models"]:
            own = {n[len(entry["prefix"]):]: s for n, s in shapes.items()
                   if n.startswith(entry["prefix"])}
            spec = spec_from_json(entry["spec"], own, label=entry["prefix"])
            models.append(_layers(spec, entry.get("arch"), entry["prefix"], own))
        return models, int(description["k"])
    spec = spec_from_json(json.loads(result.metadata[meta.SPEC]), shapes, label="fused")
    arch = json.loads(result.metadata[meta.ARCH]) if meta.ARCH in result.metadata else None
    return [_layers(spec, arch, "", shapes)], 1


def _layers(spec: PermutationSpec, arch: dict[str, Any] | None, prefix: str,
            shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    convnet = arch is not None and arch.get("type") == "convnet"
    pan = (arch or {}).get("pan")
    # fusekit's models hold one encoding buffer per hidden layer, in layer order.
    encodings = sorted((n for n in shapes if n.endswith(".encoding")),
                       key=lambda n: [(0, int(p), "") if p.isdigit() else (1, 0, p)
                                      for p in n.split(".")])
    layers = []
    for index, layer in enumerate(spec.layers):
        norm = layer.norm
        layers.append({
            "kind": layer.kind,
            "weight": prefix + layer.weight,
            "bias": prefix + layer.bias if layer.bias else None,
            "batchnorm": [prefix + n if n else None for n in (
                norm.weight, norm.bias, norm.running_mean, norm.running_var)] if norm else None,
            "eps": norm.eps if norm else None,
            "padding": layer.kernel_size[0] // 2 if layer.kind == "conv2d" else 0,
            "pool": bool(convnet and arch.get("pool", True) and layer.kind == "conv2d"),
            "encoding": prefix + encodings[index] if pan and index < len(encodings) else None,
        })
    model_input = [arch["in_channels"], *arch["image_size"]] if convnet else None
    return {"input": model_input, "pan": pan["mode"] if pan else None, "layers": layers}


def _input_size(model: dict[str, Any]) -> str:
    if model["input"]:
        return ", ".join(map(str, model["input"]))
    first = model["layers"][0]
    return f"t[{first['weight']!r}].shape[1]"
