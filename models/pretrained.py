"""Checkpoints in the Hugging Face layout: read into a sharded
:class:`~jax_flashoverlap.models.Transformer` (Llama) or
:class:`~jax_flashoverlap.models.Mamba2` (Mamba-2), and written back.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or
shards named by ``model.safetensors.index.json``); its ``model_type``
("llama" or "mamba2") picks the model. Each device reads only the rows and
columns of its own shard of every weight, straight from the files
(``safetensors`` slices): no process ever holds a whole weight it does not
need. How each architecture's weights map onto the model's fused layouts:
:mod:`.pretrained_llama`, :mod:`.pretrained_mamba2`.

Memory: :func:`from_pretrained` builds the model abstract (shapes and
shardings, no parameters) and places each loaded shard straight into it, so
a device holds its shard of the parameters once, in the config's
``param_dtype``: at Llama-3.1-8B's shape and tensor size 1, 32 GB in
float32 or 16 GB in bfloat16, and each process reads one weight's rows at a
time besides.
"""

from __future__ import annotations

import json
import os
from types import ModuleType
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from . import pretrained_llama, pretrained_mamba2
from ._checkpoint import Checkpoint
from .config import TransformerConfig
from .mamba import Mamba2
from .mamba_config import MambaConfig
from .pretrained_llama import llama_config
from .pretrained_mamba2 import mamba2_config
from .transformer import Transformer

__all__ = ["llama_config", "mamba2_config", "pretrained_config", "from_pretrained",
           "save_pretrained"]

# save_pretrained's dtype names -> the files' numpy dtypes.
_FILE_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}
# model_type -> (its config reader, the model, the config's type, the layout's module).
_ARCHITECTURES = {
    "llama": (llama_config, Transformer, TransformerConfig, pretrained_llama),
    "mamba2": (mamba2_config, Mamba2, MambaConfig, pretrained_mamba2),
}


def pretrained_config(path: str | os.PathLike, **overrides: Any
                      ) -> TransformerConfig | MambaConfig:
    """The model config of checkpoint directory ``path`` (its ``config.json``).

    Args:
      path: the checkpoint directory.
      **overrides: fields of the result to set (``dtype``, ``impl``, ...).

    Raises:
      ValueError: a ``model_type`` other than "llama" and "mamba2", or a
        config the model cannot express; the message names the field.
    """
    with open(os.path.join(os.fspath(path), "config.json")) as f:
        hf = json.load(f)
    model_type = hf.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"from_pretrained: model_type is {model_type!r}; the models load "
                         f"{sorted(_ARCHITECTURES)} checkpoints")
    return _ARCHITECTURES[model_type][0](hf, **overrides)


def _layout(config: TransformerConfig | MambaConfig) -> tuple[type, ModuleType]:
    for _, model, config_type, layout in _ARCHITECTURES.values():
        if isinstance(config, config_type):
            return model, layout
    raise TypeError(f"from_pretrained: a {type(config).__name__} has no Hugging Face layout; "
                    f"pass a TransformerConfig or MambaConfig")


def from_pretrained(path: str | os.PathLike, *,
                    config: TransformerConfig | MambaConfig | None = None,
                    **overrides: Any) -> Transformer | Mamba2:
    """A checkpoint in the Hugging Face layout as a :class:`Transformer`
    (Llama) or :class:`Mamba2` (Mamba-2).

    Call it under the mesh the model runs on (``with jax.set_mesh(mesh):``,
    a (data, tensor) mesh); each device reads its own shards.

    Args:
      path: the checkpoint directory (``config.json``, safetensors files).
      config: the model's config, where the caller built it already with
        :func:`pretrained_config` from the same ``config.json`` (then
        ``overrides`` must be empty); default: that, with ``overrides``.
      **overrides: config fields, e.g. ``dtype="bfloat16"`` (the compute
        dtype), ``param_dtype`` (how the weights are kept: "float32", the
        default, widens the checkpoint's values exactly; "bfloat16" halves
        the memory and keeps a bfloat16 checkpoint's values as they are),
        ``impl``, ``max_seq_len``.

    Returns:
      The model, its ``config`` built by :func:`pretrained_config`.

    Raises:
      ValueError: a config the model cannot express, or a weight missing or
        of another shape than the config implies, named.
    """
    path = os.fspath(path)
    if config is None:
        config = pretrained_config(path, **overrides)
    elif overrides:
        raise TypeError(f"from_pretrained: pass either config or overrides "
                        f"({sorted(overrides)}), not both")
    model_class, layout = _layout(config)
    if jax.sharding.get_abstract_mesh().empty:
        raise ValueError("from_pretrained: call it under the mesh the model runs on, "
                         "`with jax.set_mesh(mesh):`, a mesh with the config's data and "
                         "tensor axes (each device reads its own shards)")
    ckpt = Checkpoint(path)
    model = nnx.eval_shape(lambda: model_class(config, rngs=nnx.Rngs(0)))
    builders = layout.builders(config, ckpt)
    flat = dict(nnx.to_flat_state(nnx.state(model)))
    missing = set(builders) - set(flat)
    if missing:
        raise ValueError(f"from_pretrained: the model has no parameters {sorted(missing)}")
    mesh = jax.sharding.get_mesh()
    for key, param in flat.items():
        if key not in builders:
            raise ValueError(f"from_pretrained: nothing in the checkpoint fills {key}")
        abstract = param.get_value()  # a ShapeDtypeStruct with the parameter's sharding
        build = builders[key]

        def shard(index, build=build, key=key, abstract=abstract):
            block = build(tuple(index) + (slice(None),) * (len(abstract.shape) - len(index)))
            want = tuple(len(range(*s.indices(n))) for s, n in zip(index, abstract.shape))
            if block.shape != want:
                raise ValueError(f"from_pretrained: {key} needs a shard of shape {want}, the "
                                 f"checkpoint gives {block.shape}: the config does not match "
                                 f"the weights")
            return block.astype(abstract.dtype)

        sharding = NamedSharding(mesh, abstract.sharding.spec)
        param.set_value(jax.make_array_from_callback(abstract.shape, sharding, shard))
    return model


def save_pretrained(model: Transformer | Mamba2, path: str | os.PathLike, *,
                    dtype: str = "bfloat16") -> None:
    """Writes ``model`` in the Hugging Face layout of its architecture
    (``config.json`` and ``model.safetensors``), which :func:`from_pretrained`
    and ``transformers`` read. Weights are gathered to this process: call it
    from one process of a job, on a model that fits in its memory.

    Args:
      model: a :class:`Transformer` (written as Llama) or :class:`Mamba2`.
      path: the directory (created).
      dtype: the weights' dtype in the file: "bfloat16" (default),
        "float16" or "float32".
    """
    from safetensors.numpy import save_file

    if dtype not in _FILE_DTYPES:
        raise ValueError(f"save_pretrained: dtype must be one of {list(_FILE_DTYPES)}, "
                         f"got {dtype!r}")
    _, layout = _layout(model.config)
    flat = {key: np.asarray(jax.device_get(p[...]), np.float32)
            for key, p in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    out = layout.tensors(model.config, flat)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    save_file({k: np.ascontiguousarray(v.astype(_FILE_DTYPES[dtype])) for k, v in out.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(layout.hf_config(model.config, dtype), f, indent=2)
