"""The README.md model card of an output folder, with a loader that needs only torch and
safetensors (no fusekit): the layer list of each (sub-)model is written into the snippet."""

from __future__ import annotations

import json
import pprint
from typing import Any

from fusekit.core import metadata as meta
from fusekit.core.arch import infer_arch, resnet_blocks
from fusekit.core.spec import PermutationSpec, Spec, spec_from_json
from fusekit.methods.ams import ams_class_counts, read_ams_metadata
from fusekit.methods.avg import shares_of_counts

#: Input size of the example call in the card for torchvision families (any size >= 32
#: works for them: the pools are adaptive).
_IMAGE = (32, 32)

_FORWARD = '''\
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

t = load_file("fused.safetensors")
MODELS = {models}
K = {k}  # answers summed per input: those of the K most confident models (AMS)
CONFIDENCE = {confidence}  # AMS: logit, probability or class-share
SHARES = torch.tensor({shares})  # class-share: model s's share of class c's training samples


def forward(model, x):
    if model.get("resnet"):
        return forward_resnet(model, x)
    if model.get("vgg"):
        return forward_vgg(model, x)
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


def conv(model, x, name, stride=1):
    weight = t[model["prefix"] + name + ".weight"]
    return F.conv2d(x, weight, t.get(model["prefix"] + name + ".bias"), stride=stride,
                    padding=weight.shape[-1] // 2)


def norm(model, x, name):
    weight, bias, mean, var = (t[model["prefix"] + name + suffix] for suffix in
                               (".weight", ".bias", ".running_mean", ".running_var"))
    return F.batch_norm(x, mean, var, weight, bias, training=False, eps=model["eps"])


def forward_resnet(model, x):  # torchvision's ResNet (CIFAR stem: 3x3, no max pool); x: images
    net = model["resnet"]
    x = F.relu(norm(model, conv(model, x, "conv1", net["stem_stride"]), "bn1"))
    if net["stem_stride"] == 2:
        x = F.max_pool2d(x, 3, 2, 1)
    for block in net["blocks"]:
        out, name = x, block["name"]
        for i in range(1, block["convs"] + 1):
            stride = block["stride"] if i == block["stride_conv"] else 1
            out = norm(model, conv(model, out, f"{name}.conv{i}", stride), f"{name}.bn{i}")
            out = F.relu(out) if i < block["convs"] else out
        if block["downsample"]:
            x = norm(model, conv(model, x, f"{name}.downsample.0", block["stride"]),
                     f"{name}.downsample.1")
        x = F.relu(out + x)
    x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)
    return F.linear(x, t[model["prefix"] + "fc.weight"], t[model["prefix"] + "fc.bias"])


def forward_vgg(model, x):  # torchvision's VGG: features, 7x7 average pool, classifier; x: images
    net, index = model["vgg"], 0
    for item in net["config"]:
        if item == "M":
            x, index = F.max_pool2d(x, 2, 2), index + 1
            continue
        x, index = conv(model, x, f"features.{index}"), index + 1
        if net["batchnorm"]:
            x, index = norm(model, x, f"features.{index}"), index + 1
        x, index = F.relu(x), index + 1
    x = torch.flatten(F.adaptive_avg_pool2d(x, (7, 7)), 1)
    for k in range(net["hidden"] + 1):
        name = f"{model['prefix']}classifier.{3 * k}"
        x = F.linear(x, t[name + ".weight"], t[name + ".bias"])
        x = F.relu(x) if k < net["hidden"] else x
    return x


def predict(x):
    """Logits (B, C) of inputs x (B, ...)."""
    logits = torch.stack([forward(model, x) for model in MODELS])  # (S, B, C)
    answers = logits
    if CONFIDENCE == "class-share":
        answers = SHARES[:, None, :] * logits.softmax(dim=2)
    confidence = (logits.softmax(dim=2) if CONFIDENCE == "probability" else answers).amax(dim=2)
    if K == len(MODELS):
        chosen = torch.arange(K)[:, None].expand(K, len(x))
    else:  # most confident first, lower index on ties
        chosen = torch.sort(confidence, dim=0, descending=True, stable=True).indices[:K]
    fused = answers.gather(0, chosen[:, :, None].expand(-1, -1, logits.shape[2])).sum(0)
    if CONFIDENCE == "class-share":  # the log of the mixture
        return fused.clamp_min(torch.finfo(fused.dtype).tiny).log()
    return fused
'''


def model_card(result, recipe: dict[str, Any], clients: list[str]) -> str:
    """Markdown: method, parameters, inputs (``clients``: their paths as the card names
    them, in the order of the result's report) with content hashes, widths, a loader."""
    hashes = json.loads(result.metadata.get(meta.INPUTS, "[]"))
    inputs = "\n".join(f"| {label} | `{digest}` |" for label, digest in zip(clients, hashes,
                                                                             strict=False))
    params = "\n".join(f"| `{k}` | `{json.dumps(v, default=str)}` |"
                       for k, v in result.params.items()) or "| (none) | |"
    if result.config is not None:
        loading = _hf_loading(result)
    elif _packs_transformers(result):
        loading = _hf_ams_loading()
    else:
        loading = _torch_loading(result)
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

{loading}"""


def _torch_loading(result) -> str:
    models, rule = loader_models(result)
    # str.replace, not str.format: the snippet's own f-strings hold braces.
    forward = _FORWARD.replace("{models}", pprint.pformat(models, width=88, sort_dicts=False))
    for key, value in rule.items():
        forward = forward.replace("{" + key + "}", value)
    return f"""## Loading without fusekit

Only `torch` and `safetensors` are needed:

```python
{forward}
logits = predict(torch.zeros(2, {_input_size(models[0])}))
```

With fusekit: `fusekit.load_fused("fused.safetensors")`.
"""


def _packs_transformers(result) -> bool:
    """An AMS artefact of Hugging Face classifiers (each rebuilt from its config)."""
    if meta.AMS not in result.metadata:
        return False
    return any("config" in m for m in json.loads(result.metadata[meta.AMS])["models"])


def _hf_ams_loading() -> str:
    return """## Loading

Every client's classifier, rebuilt by `transformers` from the config stored with it, behind
the selection rule (needs fusekit's `[hf]` extra):

```python
import fusekit

model = fusekit.load_fused("fused.safetensors")  # inputs (B, ...) -> logits (B, classes)
```
"""


def _hf_loading(result) -> str:
    """A Hugging Face model folder: config.json and model.safetensors, for transformers."""
    name = (result.config.get("architectures") or ["AutoModel"])[0]
    return f"""## Loading

A Hugging Face model folder (`config.json`, `model.safetensors`), for `transformers`:

```python
from transformers import {name}

model = {name}.from_pretrained("path/to/this/folder")
```

With fusekit: `fusekit.load_fused("path/to/this/folder")` (needs the `[hf]` extra).
"""


def loader_models(result) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """The layer lists the loader snippet runs, and its selection rule as the snippet's
    constants: ``k`` (models whose answers it sums), ``confidence`` and class ``shares``."""
    shapes = {name: tuple(a.shape) for name, a in result.state_dict.items()}
    if meta.AMS in result.metadata:
        description = read_ams_metadata(result.metadata, "fused")
        models = []
        for entry in description["models"]:
            own = {n[len(entry["prefix"]):]: s for n, s in shapes.items()
                   if n.startswith(entry["prefix"])}
            spec = spec_from_json(entry["spec"], own, label=entry["prefix"])
            models.append(_model(spec, entry.get("arch"), entry["prefix"], own))
        counts = ams_class_counts(description, "fused")
        shares = [] if counts is None else shares_of_counts(counts).round(8).tolist()
        return models, {"k": str(int(description["k"])),
                        "confidence": repr(description["confidence"]), "shares": str(shares)}
    spec = spec_from_json(json.loads(result.metadata[meta.SPEC]), shapes, label="fused")
    arch = json.loads(result.metadata[meta.ARCH]) if meta.ARCH in result.metadata else None
    return [_model(spec, arch, "", shapes)], {"k": "1", "confidence": "'logit'", "shares": "[]"}


def _model(spec: Spec, arch: dict[str, Any] | None, prefix: str,
           shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """What the snippet runs for one (sub-)model: torchvision's ResNet / VGG structure when
    the architecture is one of them, else its layer list."""
    arch = arch if arch is not None else infer_arch(shapes)
    if arch is None or arch["type"] not in ("resnet", "vgg"):
        return _layers(spec, arch, prefix, shapes)
    eps = next(layer.norm.eps for layer in spec.layers if layer.norm) if any(
        layer.norm for layer in spec.layers) else 1e-5
    model = {"prefix": prefix, "input": [arch["in_channels"], *_IMAGE], "eps": eps}
    if arch["type"] == "vgg":
        return {**model, "vgg": {"config": arch["config"], "batchnorm": arch["batchnorm"],
                                 "hidden": len(arch["hidden"])}}
    bottleneck = arch["block"] == "bottleneck"
    blocks = [{"name": b["name"], "stride": b["stride"], "downsample": b["downsample"],
               "convs": 3 if bottleneck else 2, "stride_conv": 2 if bottleneck else 1}
              for b in resnet_blocks(arch)]
    return {**model, "resnet": {"stem_stride": 2 if arch["stem"] == "imagenet" else 1,
                                "blocks": blocks}}


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
    return {"prefix": prefix, "input": model_input, "pan": pan["mode"] if pan else None,
            "layers": layers}


def _input_size(model: dict[str, Any]) -> str:
    if model["input"]:
        return ", ".join(map(str, model["input"]))
    first = model["layers"][0]
    return f"t[{first['weight']!r}].shape[1]"
