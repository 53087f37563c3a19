"""Mamba-2 in the Hugging Face ``transformers`` layout, for
:mod:`.pretrained`: its ``config.json`` as a :class:`MambaConfig`, and its
weights as the model's parameters and back.

``transformers`` lays in_proj's outputs out by kind: z for every head, then
the convolution's channels (x for every head, B for every group, C for
every group), then dt for every head. The model lays them out by B/C group
(its tensor-parallel unit): per group its heads' z, x, its B, its C, its
heads' dt; the convolution's channels likewise, x, B, C per group. Heads
belong to groups in order in both (head h reads group h // (heads /
groups)), so each group's columns are contiguous runs of the checkpoint's
rows, and a device reads only the groups of its own shard.

state-spaces' own ``mamba_ssm`` checkpoints (``d_model``, ``n_layer`` in
``config.json``, weights in ``pytorch_model.bin``) are not read: convert
them with ``transformers``' Mamba-2 conversion script first.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ._checkpoint import Checkpoint, required, span
from .mamba_config import MambaConfig

__all__ = ["mamba2_config"]


def mamba2_config(hf: dict[str, Any], **overrides: Any) -> MambaConfig:
    """The :class:`MambaConfig` of a Hugging Face Mamba-2 ``config.json``.

    Args:
      hf: the parsed ``config.json``.
      **overrides: fields of the result to set (``dtype``, ``impl``,
        ``max_seq_len``, ``sharding``, ...).

    Raises:
      ValueError: a field the model cannot express (bias terms in the
        projections, no convolution bias, an activation other than SiLU,
        clamped step sizes, heads that do not fill the inner width), or a
        missing one; the message names it.
    """
    need = functools.partial(required, hf, reader="mamba2_config")

    if "d_model" in hf and "hidden_size" not in hf:
        raise ValueError("mamba2_config: config.json is in mamba_ssm's layout (d_model, "
                         "n_layer); convert the checkpoint with transformers' Mamba-2 "
                         "conversion script first")
    model_type = hf.get("model_type")
    if model_type != "mamba2":
        raise ValueError(f"mamba2_config: model_type is {model_type!r}; only 'mamba2' "
                         f"checkpoints load into Mamba2")
    if hf.get("use_bias"):
        raise ValueError("mamba2_config: use_bias is true; the model's projections have no "
                         "bias terms")
    if not hf.get("use_conv_bias", True):
        raise ValueError("mamba2_config: use_conv_bias is false; the model's convolution "
                         "has a bias")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"mamba2_config: hidden_act is {hf['hidden_act']!r}; the model "
                         f"activates with silu")
    if not hf.get("rms_norm", True):
        raise ValueError("mamba2_config: rms_norm is false; the model's norms are RMSNorm")
    low, high = (_number(v) for v in hf.get("time_step_limit", (0.0, math.inf)))
    if low > 0.0 or high != math.inf:
        raise ValueError(f"mamba2_config: time_step_limit is {[low, high]}; the model does "
                         f"not clamp its step sizes (only (0, inf) loads)")
    embed_dim, expand = need("hidden_size"), need("expand")
    heads, head_dim = need("num_heads"), need("head_dim")
    if heads * head_dim != expand * embed_dim:
        raise ValueError(f"mamba2_config: num_heads={heads} x head_dim={head_dim} must be "
                         f"the inner width expand x hidden_size = {expand * embed_dim}")
    fields = dict(
        vocab_size=need("vocab_size"), num_layers=need("num_hidden_layers"),
        embed_dim=embed_dim, state_dim=need("state_size"), head_dim=head_dim,
        num_groups=need("n_groups"), expand=expand, conv_width=need("conv_kernel"),
        chunk_size=need("chunk_size"), norm_eps=float(need("layer_norm_epsilon")),
        tie_embeddings=bool(hf.get("tie_word_embeddings")))
    return dataclasses.replace(MambaConfig(**fields), **overrides)


def _number(value: Any) -> float:
    """A float of config.json: a number, or transformers 5's spelling of one
    JSON has no literal for ({"__float__": "Infinity"})."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def _group_runs(config: MambaConfig) -> tuple[Callable, Callable]:
    """(group -> the checkpoint's in_proj rows of that group, in the model's
    column order, as [start, stop) runs; the same for the convolution's
    channels)."""
    heads_per_group = config.num_heads // config.num_groups
    width, n = heads_per_group * config.head_dim, config.state_dim
    inner, bc = config.inner_dim, config.num_groups * n

    def conv(g):  # x, B, C
        return [(g * width, (g + 1) * width), (inner + g * n, inner + (g + 1) * n),
                (inner + bc + g * n, inner + bc + (g + 1) * n)]

    def in_proj(g):  # z, then the convolution's channels, then dt
        dt = 2 * inner + 2 * bc + g * heads_per_group
        return [(g * width, (g + 1) * width),
                *[(inner + a, inner + b) for a, b in conv(g)],
                (dt, dt + heads_per_group)]

    return in_proj, conv


def _order(runs: Callable, groups: int) -> np.ndarray:
    """The checkpoint's row of each of the model's columns."""
    return np.concatenate([np.arange(a, b) for g in range(groups) for a, b in runs(g)])


def builders(config: MambaConfig, ckpt: Checkpoint) -> dict[tuple, Callable]:
    """Our parameter path -> ``f(index)`` building that shard (float32) from
    the checkpoint's weights."""
    in_proj_runs, conv_runs = _group_runs(config)
    groups = config.num_groups

    def grouped(name, runs, read):
        """A parameter whose last axis holds the groups' columns in order;
        ``read(name, rows)`` gives the checkpoint's rows as the last axis."""
        group_width = sum(b - a for a, b in runs(0))

        def build(idx):
            cols = idx[-1]
            g0, g1, skip = span(cols, groups * group_width, group_width)
            block = np.concatenate([read(name, slice(a, b), *idx[:-1])
                                    for g in range(g0, g1) for a, b in runs(g)], axis=-1)
            start, stop, _ = cols.indices(groups * group_width)
            return block[..., skip:skip + stop - start]
        return build

    def rows_last(name, rows, *lead):  # torch's [out, in] read as [in, out]
        return ckpt.read(name, rows, *lead).T

    def taps_first(name, channels, taps=slice(None)):  # conv1d's [c, 1, k] as [k, c]
        return ckpt.read(name, channels, slice(None), taps)[:, 0, :].T

    def plain(name):
        return lambda idx: ckpt.read(name, *idx)

    out = {("embedding",): plain("backbone.embeddings.weight"),
           ("final_norm", "weight"): plain("backbone.norm_f.weight")}
    if not config.tie_embeddings:
        out[("head",)] = lambda idx: ckpt.read("lm_head.weight", idx[1], idx[0]).T
    for i in range(config.num_layers):
        p, b = f"backbone.layers.{i}", ("blocks", i, "mixer")
        out |= {
            ("blocks", i, "norm", "weight"): plain(f"{p}.norm.weight"),
            (*b, "in_proj", "kernel"): grouped(f"{p}.mixer.in_proj.weight", in_proj_runs,
                                               rows_last),
            (*b, "conv_weight"): grouped(f"{p}.mixer.conv1d.weight", conv_runs, taps_first),
            (*b, "conv_bias"): grouped(f"{p}.mixer.conv1d.bias", conv_runs,
                                       lambda name, rows: ckpt.read(name, rows)),
            (*b, "dt_bias"): plain(f"{p}.mixer.dt_bias"),
            (*b, "a_log"): plain(f"{p}.mixer.A_log"),
            (*b, "d_skip"): plain(f"{p}.mixer.D"),
            (*b, "norm", "weight"): plain(f"{p}.mixer.norm.weight"),
            (*b, "out_proj", "kernel"): (lambda name: lambda idx: ckpt.read(
                name, idx[1], idx[0]).T)(f"{p}.mixer.out_proj.weight"),
        }
    return out


def tensors(config: MambaConfig, flat: dict[tuple, np.ndarray]) -> dict[str, np.ndarray]:
    """The checkpoint's weights (torch's [out, in] for linear layers, conv1d's
    [c, 1, k]) from the model's parameters by path, float32."""
    in_proj_runs, conv_runs = _group_runs(config)
    in_proj_rows = _order(in_proj_runs, config.num_groups)
    conv_rows = _order(conv_runs, config.num_groups)

    def unordered(values, rows):  # the model's columns (last axis) back in the file's order
        out = np.empty_like(values)
        out[..., rows] = values
        return out

    out = {"backbone.embeddings.weight": flat[("embedding",)],
           "backbone.norm_f.weight": flat[("final_norm", "weight")]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = flat[("head",)].T
    for i in range(config.num_layers):
        p, b = f"backbone.layers.{i}", ("blocks", i, "mixer")
        out |= {
            f"{p}.norm.weight": flat[("blocks", i, "norm", "weight")],
            f"{p}.mixer.in_proj.weight": unordered(flat[(*b, "in_proj", "kernel")],
                                                   in_proj_rows).T,
            f"{p}.mixer.conv1d.weight": unordered(flat[(*b, "conv_weight")], conv_rows).T[:, None],
            f"{p}.mixer.conv1d.bias": unordered(flat[(*b, "conv_bias")], conv_rows),
            f"{p}.mixer.dt_bias": flat[(*b, "dt_bias")],
            f"{p}.mixer.A_log": flat[(*b, "a_log")],
            f"{p}.mixer.D": flat[(*b, "d_skip")],
            f"{p}.mixer.norm.weight": flat[(*b, "norm", "weight")],
            f"{p}.mixer.out_proj.weight": flat[(*b, "out_proj", "kernel")].T,
        }
    return out


def hf_config(config: MambaConfig, dtype: str) -> dict[str, Any]:
    """The ``config.json`` of ``config``, its weights stored as ``dtype``."""
    return {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
            "vocab_size": config.vocab_size, "hidden_size": config.embed_dim,
            "state_size": config.state_dim, "num_hidden_layers": config.num_layers,
            "num_heads": config.num_heads, "head_dim": config.head_dim,
            "n_groups": config.num_groups, "expand": config.expand,
            "conv_kernel": config.conv_width, "chunk_size": config.chunk_size,
            "layer_norm_epsilon": config.norm_eps,
            "tie_word_embeddings": config.tie_embeddings, "use_bias": False,
            "use_conv_bias": True, "hidden_act": "silu", "rms_norm": True,
            "time_step_limit": [0.0, math.inf], "torch_dtype": dtype}
