"""A Hugging Face checkpoint directory: its safetensors files, read by
slices (each device reads only the rows and columns of its own shard), and
the fields of its ``config.json``."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def required(hf: dict[str, Any], name: str, reader: str) -> Any:
    """Field ``name`` of a parsed ``config.json``, or a ValueError from
    ``reader`` (the config reader, for the message) naming it."""
    if name not in hf:
        raise ValueError(f"{reader}: config.json has no {name!r}")
    return hf[name]


class Checkpoint:
    """The safetensors files of a checkpoint directory, read by slices."""

    def __init__(self, path: str):
        from safetensors import safe_open

        index = os.path.join(path, "model.safetensors.index.json")
        if os.path.exists(index):
            with open(index) as f:
                self.files = dict(json.load(f)["weight_map"])
        elif os.path.exists(os.path.join(path, "model.safetensors")):
            with safe_open(os.path.join(path, "model.safetensors"), "numpy") as f:
                self.files = {name: "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"from_pretrained: {path} has neither model.safetensors "
                                    f"nor model.safetensors.index.json")
        self.path = path
        self._open = {}
        self._safe_open = safe_open

    def slice(self, name: str):
        if name not in self.files:
            raise ValueError(f"from_pretrained: the checkpoint has no weight {name!r}")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = self._safe_open(os.path.join(self.path, file), "numpy")
        return self._open[file].get_slice(name)

    def read(self, name: str, *index: slice) -> np.ndarray:
        """Rows and columns ``index`` of weight ``name``, float32."""
        return np.asarray(self.slice(name)[index], np.float32)


def span(index: slice, size: int, unit: int) -> tuple[int, int, int]:
    """Units [first, last) of width ``unit`` covering ``index`` of ``size``,
    and the offset of ``index``'s start in the first one."""
    start, stop, _ = index.indices(size)
    return start // unit, -(-stop // unit), start % unit
