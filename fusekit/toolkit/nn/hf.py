"""Hugging Face model folders back as ``transformers`` modules (the ``[hf]`` extra).

The only place fusekit imports ``transformers``: fusion itself reads and writes the folders
with numpy (:mod:`fusekit.core.checkpoint`, :mod:`fusekit.core.transformer`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fusekit.core.checkpoint import HF_CONFIG
from fusekit.core.errors import CheckpointError
from fusekit.core.metadata import read_json_file


def load_pretrained(folder: str | os.PathLike[str], device: Any = "cpu"):
    """The model class ``config.json`` names (``architectures[0]``, e.g.
    ``ViTForImageClassification``; ``AutoModel`` when it names none), loaded with
    ``from_pretrained`` from the folder, in eval mode.

    Raises:
        CheckpointError: transformers is not installed, or the config names a class it
            does not have.
    """
    try:
        import transformers
    except ImportError:
        raise CheckpointError(f"{folder}: loading a Hugging Face model folder needs the "
                              "transformers package: pip install 'fusekit-oneshot[hf]'") from None
    config = read_json_file(Path(folder) / HF_CONFIG, "model config", CheckpointError)
    names = config.get("architectures") or ["AutoModel"]
    cls = getattr(transformers, names[0], None)
    if cls is None:
        raise CheckpointError(f"{folder}: config.json names the class {names[0]!r}, which "
                              f"transformers {transformers.__version__} does not have")
    return cls.from_pretrained(folder).to(device).eval()
