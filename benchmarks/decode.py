"""Benchmark: prefill time and per-token decode latency of both models, per impl.

    python benchmarks/decode.py --json out.json                  # 1B models, TP=2, one process
    python benchmarks/decode.py --mesh 1x1 --batches 1 --contexts 512   # one GPU
    python -m jax_flashoverlap.cli.launch -n 2 --node-size 1 benchmarks/decode.py \\
        --impls xla auto --json out.json                        # NVSHMEM across 2 processes

For each model, impl, batch and context length it builds a
:class:`jax_flashoverlap.models.Generator` (random weights, bf16 on GPUs) for
a prompt of ``context`` tokens, checks its logits against the forward pass of
a float32 copy over the generated tokens (teacher forcing: no worse than the
model's own forward pass in its dtype, see :data:`CHECK_TOLERANCE`), then times:

- prefill: the prompt through the model and the first token (the time to
  first token), median of ``--reps`` runs;
- a decode step: (T(k2) - T(k1)) / (k2 - k1), T(k) the wall time of the
  compiled loop of k steps (``--steps k1 k2``): the timing protocol of
  :mod:`jax_flashoverlap.benchmarking` applied to the loop, so that what a
  call pays once cancels. "from idle" is T(k2) / k2.

Impls: "xla" (psum), "auto", "cuda", and "cuda:ALGORITHM" to force the
all-reduce kernel ("one_shot", "two_shot", "lamport"). The HBM floor per
token is the bytes one GPU must read per step, its weights (as decoding
holds them, in the compute dtype; the embedding table aside, of which a
step reads b rows) plus its cache (the keys and values up to the average
position of the timed steps; Mamba-2's convolution and SSM states), over
the GPU's datasheet HBM bandwidth (or ``--hbm-tb-s``). Results go to
``--json`` after each row; a table is printed last. Settings read while
tracing (``--split-positions``, ``--one-row-pad-below``, a forced
all-reduce algorithm) and XLA's options (``--xla-option-sets``) are swept
in one process, each case traced and compiled afresh.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import itertools
import json
import math
import statistics
import sys
import time
from typing import NamedTuple
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_flashoverlap import benchmarking, cuda_policy, distributed, models
from jax_flashoverlap.cli import train
from jax_flashoverlap.cli.devices import ensure_cpu_devices
from jax_flashoverlap.cli.flags import parse_mesh_shape

# The module, not the function the package exports under its name.
_decode_matmul_module = importlib.import_module("jax_flashoverlap.decode_matmul")

HBM_TB_S = benchmarking.H200_HBM_TB_S
# The decode loop's logits, against a float32 forward pass over the same
# tokens, may be off by twice the compute dtype's own forward pass (relative
# error, norm over a row's logits), or by this much: two paths through 16-48
# low-precision layers round differently, and neither is the reference.
CHECK_TOLERANCE = {"bfloat16": 5e-2, "float16": 2e-2, "float32": 1e-4}
CHECK_TOKENS = 8
# The check's forward passes take this many rows a data-parallel shard at a
# time where the batch divides into them: a float32 forward over a large
# batch and context (XLA's attention materializes its scores) would not fit
# a GPU.
CHECK_ROWS = 8


class Case(NamedTuple):
    model: str
    impl: str
    decode_matmul: str
    decode_attention: str
    decode_blocks: str
    decode_mixer: str | None
    split_positions: int | None
    packed_inputs: bool | None
    one_row_pad_below: int | None
    xla_option_set: tuple[tuple[str, bool | int | str], ...]  # (name, value) pairs
    batch: int
    context: int


def _impl_and_algorithm(name: str) -> tuple[str, str | None]:
    impl, _, algorithm = name.partition(":")
    if impl not in models.IMPLS or (algorithm and algorithm not in
                                    cuda_policy.ALL_REDUCE_ALGORITHMS):
        raise argparse.ArgumentTypeError(
            f"--impls {name!r}: expected one of {models.IMPLS}, or cuda:ALGORITHM with "
            f"ALGORITHM in {cuda_policy.ALL_REDUCE_ALGORITHMS}")
    return impl, algorithm or None


def _xla_option_set(text: str) -> dict:
    """"NAME=VALUE,NAME=VALUE" (or "" / "default": none) as a dict."""
    if text in ("", "default"):
        return {}
    return dict(_xla_option(pair) for pair in text.split(","))


def _xla_option(text: str) -> tuple[str, bool | int | str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"--xla-option {text!r}: expected NAME=VALUE")
    lowered = value.lower()
    if lowered in ("true", "false"):
        return name, lowered == "true"
    return name, int(value) if value.lstrip("-").isdigit() else value


@contextlib.contextmanager
def forced_algorithm(algorithm: str | None):
    """Within it, every all_reduce lowered picks ``algorithm`` (None: by size)."""
    if algorithm is None:
        yield
        return
    chosen = cuda_policy.all_reduce_algorithm
    cuda_policy.all_reduce_algorithm = lambda *args, **kwargs: algorithm
    try:
        yield
    finally:
        cuda_policy.all_reduce_algorithm = chosen


@contextlib.contextmanager
def _module_setting(module, name: str, value):
    """Within it, ``module.name`` is ``value`` (None: left as it is)."""
    if value is None:
        yield
        return
    with mock.patch.object(module, name, value):
        yield


def one_row_pad_set(below: int | None):
    """Within it, one-row weight dots traced are padded to two rows below
    ``below`` weight elements (None: the library's default; see
    ``jax_flashoverlap.decode_matmul.ONE_ROW_PAD_BELOW``)."""
    return _module_setting(_decode_matmul_module, "ONE_ROW_PAD_BELOW", below)


def packed_inputs_set(packed: bool | None):
    """Within it, the decode-attention kernel traced takes q, k and v packed
    in one array or apart (None: the module's default,
    ``PACKED_INPUTS``)."""
    return _module_setting(models.decode_attention_pallas, "PACKED_INPUTS", packed)


def split_positions_set(positions: int | None):
    """Within it, the decode-attention kernel traced splits the cache into
    pieces of at least ``positions`` (None: the module's default)."""
    return _module_setting(models.decode_attention_pallas, "MIN_SPLIT_POSITIONS", positions)


def build_model(name: str, size, impl: str, mesh, dtype: str | None, attention: str,
                decode_matmul: str = "xla", decode_attention: str = "model",
                decode_mixer: str = "xla", decode_blocks: str = "auto",
                param_dtype: str = "float32"):
    config = train.model_config(name, size, impl=impl, dtype=dtype, param_dtype=param_dtype,
                                decode_matmul=decode_matmul,
                                decode_blocks=decode_blocks,
                                **({"attention": attention, "decode_attention": decode_attention}
                                   if name == "transformer" else {"decode_mixer": decode_mixer}))
    _, model_cls = models.MODELS[name]
    with jax.set_mesh(mesh):
        return nnx.jit(lambda: model_cls(config, rngs=nnx.Rngs(0)))()


def floor_bytes(generator: models.Generator, steps: tuple[int, int]) -> tuple[int, int]:
    """(weight bytes, cache bytes) one GPU reads per decode step. A step
    reads one row of an untied embedding, but the whole of a tied one: it is
    the LM head."""
    model, shape = generator.model, generator.shape
    config = model.config
    weights = sum(leaf.addressable_shards[0].data.nbytes
                  for path, leaf in jax.tree_util.tree_leaves_with_path(generator.params)
                  if config.tie_embeddings or "embedding" not in jax.tree_util.keystr(path))
    mesh = jax.sharding.get_mesh()
    dp, tp = mesh.shape[config.sharding.data], mesh.shape[config.sharding.tensor]
    rows = shape.batch // dp
    itemsize = jnp.dtype(config.dtype).itemsize
    if isinstance(config, models.TransformerConfig):
        # Step i attends prompt_len + i + 1 positions; the timed steps are k1 .. k2 - 1.
        positions = shape.prompt_len + 1 + (steps[0] + steps[1] - 1) / 2
        cache = (2 * config.num_layers * rows * config.num_kv_heads // tp * config.head_dim
                 * itemsize * positions)
    else:
        heads = config.num_heads // tp
        conv = (config.conv_width - 1) * (heads * config.head_dim
                                          + 2 * config.num_groups // tp * config.state_dim)
        cache = config.num_layers * rows * (conv * itemsize
                                            + heads * config.head_dim * config.state_dim * 4)
    return int(weights), int(cache)


def floor_bandwidth(requested: float | None,
                    parser: argparse.ArgumentParser) -> tuple[float, str]:
    """(HBM TB/s for the floor, where the figure comes from): ``requested``
    (``--hbm-tb-s``), else the first device's datasheet bandwidth. A GPU
    the table does not know is an error asking for ``--hbm-tb-s``: a floor
    divided by another GPU's bandwidth would be a wrong ratio. CPU runs
    (smoke tests) take the H200's figure, their floor nominal."""
    if requested is not None:
        return requested, "--hbm-tb-s"
    device = jax.devices()[0]
    if device.platform != "gpu":
        return HBM_TB_S, f"the H200's datasheet; nominal on {device.platform}"
    tb_s = benchmarking.hbm_tb_s(device.device_kind)
    if tb_s is None:
        parser.error(f"no datasheet HBM bandwidth known for {device.device_kind!r}: pass "
                     "--hbm-tb-s TB/s for the floor")
    return tb_s, f"the {device.device_kind} datasheet"


def float32_copy(model):
    """The model with float32 compute, XLA's collectives and the same
    parameters (float32 in both), to check a low-precision model against;
    None for a float32 model. Built abstract, so that no second set of
    parameters is ever allocated (at Llama-3.1-8B's shape one is 32 GB)."""
    if model.config.dtype == "float32":
        return None
    config = dataclasses.replace(model.config, dtype="float32", impl="xla")
    exact = nnx.eval_shape(lambda: type(model)(config, rngs=nnx.Rngs(0)))
    nnx.update(exact, nnx.state(model))
    return exact


def check(model, exact, generator_args: dict, prompt: np.ndarray) -> tuple[float, float]:
    """A short generation's logits against a float32 forward pass.

    The prompt's last ``CHECK_TOKENS`` positions are dropped so that the
    forward runs over ``context`` tokens (a length the model splits).

    Args:
      model: the model timed.
      exact: :func:`float32_copy` of it (None: the model is float32).

    Returns:
      (largest relative error of the decode loop's logits, that of the
      model's own forward pass in its compute dtype), both against the
      forward pass in float32.
    """
    context = prompt.shape[1]
    short = prompt[:, :context - CHECK_TOKENS]
    generator = models.Generator(model, prompt_len=short.shape[1],
                                 max_new_tokens=CHECK_TOKENS + 1, return_logits=True,
                                 **generator_args)
    tokens, logits = generator(short)
    # The generator's weights in the decode step's layout are a second copy
    # of the blocks (16 GB at Llama-3.1-8B's shape): freed before the forwards.
    del generator
    got = np.asarray(logits, np.float64)
    if not np.all(np.isfinite(got)):
        raise FloatingPointError("non-finite logits in the decode loop")

    def forward(m):
        run = nnx.jit(lambda m, t: m(t)[:, -(CHECK_TOKENS + 1):])
        batch = tokens.shape[0]
        rows = CHECK_ROWS * jax.sharding.get_mesh().shape[m.config.sharding.data]
        rows = rows if batch % rows == 0 else batch
        return np.concatenate([np.asarray(run(m, tokens[i:i + rows, :-1]), np.float64)
                               for i in range(0, batch, rows)])

    def error(a, want):
        return float(np.max(np.linalg.norm(a - want, axis=-1)
                            / np.linalg.norm(want, axis=-1)))

    own = forward(model)
    if exact is None:
        return error(got, own), 0.0
    want = forward(exact)
    return error(got, want), error(own, want)


def measure(model, exact, case: Case, args: argparse.Namespace,
            rng: np.random.Generator) -> dict:
    """One row: ``model`` checked against ``exact`` (see :func:`check`), then timed.

    Traced afresh: jit keeps one trace per model config and shape, which
    would carry the first case's settings read while tracing (the forced
    all-reduce algorithm, the split positions) into every later case.
    """
    jax.clear_caches()
    k1, k2 = args.steps
    prompt = rng.integers(0, model.config.vocab_size, (case.batch, case.context), np.int32)
    options = {**args.xla_options, **dict(case.xla_option_set)}
    common = dict(batch=case.batch, compiler_options=options)
    error, forward_error = check(model, exact, common, prompt)
    tolerance = max(2 * forward_error, CHECK_TOLERANCE[model.config.dtype])
    if not error <= tolerance:
        raise AssertionError(f"{case}: decode logits differ from the float32 forward pass by "
                             f"{error:.3g} (relative), more than {tolerance:.3g} (the "
                             f"{model.config.dtype} forward pass: {forward_error:.3g})")
    generator = models.Generator(model, prompt_len=case.context, max_new_tokens=k2 + 1,
                                 **common)

    def wall(fn):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        return time.perf_counter() - start

    def decode_s(steps: int) -> float:
        prefilled = jax.block_until_ready(generator.prefill(prompt))
        return wall(lambda: generator.decode(prefilled, steps=steps))

    for steps in (k1, k2):  # warm-up
        decode_s(steps)
    prefill_s, per_step_s, idle_s = [], [], []
    for _ in range(args.reps):
        prefill_s.append(wall(lambda: generator.prefill(prompt)))
        short, long = decode_s(k1), decode_s(k2)
        per_step_s.append((long - short) / (k2 - k1))
        idle_s.append(long / k2)
    if args.profile:
        prefilled = jax.block_until_ready(generator.prefill(prompt))
        attention = "" if case.decode_attention == "model" else f"_{case.decode_attention}"
        if case.decode_blocks != "layers":
            attention = f"_blocks_{case.decode_blocks}"
        if case.split_positions is not None:
            attention += f"{case.split_positions}"
        if case.packed_inputs is not None:
            attention += "_packed" if case.packed_inputs else "_separate"
        if case.one_row_pad_below is not None:
            attention += f"_pad_below{case.one_row_pad_below}"
        if case.xla_option_set:
            attention += "_" + "_".join(f"{k}-{v}" for k, v in case.xla_option_set)
        if case.decode_mixer not in (None, "xla"):
            attention += f"_mixer_{case.decode_mixer}"
        trace_dir = (f"{args.profile}/{case.model}_{case.impl}{attention}_b{case.batch}"
                     f"_c{case.context}")
        with jax.profiler.trace(trace_dir):
            jax.block_until_ready(generator.decode(prefilled, steps=k2))
    per_step_s.sort()
    step = statistics.median(per_step_s)
    weights, cache = floor_bytes(generator, args.steps)
    floor_s = (weights + cache) / (args.hbm_tb_s * 1e12)
    mesh = jax.sharding.get_mesh()
    return {
        "model": case.model, "size": args.size, "impl": case.impl,
        "decode_matmul": case.decode_matmul, "decode_attention": case.decode_attention,
        "decode_blocks": case.decode_blocks,
        "decode_mixer": case.decode_mixer, "split_positions": case.split_positions,
        "packed_inputs": case.packed_inputs,
        "one_row_pad_below": case.one_row_pad_below,
        "xla_option_set": dict(case.xla_option_set), "xla_options": options,
        "batch": case.batch,
        "context": case.context, "mesh": "x".join(str(v) for v in mesh.devices.shape),
        "processes": jax.process_count(), "dtype": model.config.dtype,
        "param_dtype": model.config.param_dtype,
        "attention": getattr(model.blocks[0], "attn", None) and model.blocks[0].attn.implementation,
        "device": jax.devices()[0].device_kind,
        "prefill_ms": statistics.median(prefill_s) * 1e3,
        "prefill_ms_min": min(prefill_s) * 1e3, "prefill_ms_max": max(prefill_s) * 1e3,
        "per_token_ms": step * 1e3, "per_token_ms_min": per_step_s[0] * 1e3,
        "per_token_ms_max": per_step_s[-1] * 1e3,
        "per_token_ms_from_idle": statistics.median(idle_s) * 1e3,
        "tokens_per_s": case.batch / step, "weight_bytes": weights, "cache_bytes": cache,
        "hbm_floor_ms": floor_s * 1e3, "x_floor": step / floor_s,
        "check_error": error, "check_forward_error": forward_error,
        "compile_s": generator.compile_s,
    }


def _impl_label(row: dict) -> str:
    """A row's impl, with its case's XLA options (of --xla-option-sets) where any."""
    options = row.get("xla_option_set") or {}
    return row["impl"] + "".join(f", {k}={v}" for k, v in options.items())


def _matmul_label(row: dict) -> str:
    """A row's decode matmul, with the one-row padding's bound where set."""
    below = row.get("one_row_pad_below")
    return row["decode_matmul"] + ("" if below is None else f", padded below {below:,}")


def _attention_label(row: dict) -> str:
    """A row's decode attention, with the kernel's split positions and
    inputs where set (or the kernel that ran the whole blocks)."""
    if row.get("decode_blocks", "layers") != "layers":
        return f"in the blocks' {row['decode_blocks']} kernel"
    positions, packed = row.get("split_positions"), row.get("packed_inputs")
    label = row.get("decode_attention", "model")
    if positions is not None:
        label += f", splits of {positions}+"
    return label if packed is None else label + (", packed" if packed else ", separate")


def table(rows: list[dict]) -> str:
    """The rows as markdown; "vs xla" against impl "xla" with XLA's matmuls,
    the model's attention and the same mixer."""
    def key(r):
        return r["model"], r["batch"], r["context"], r.get("decode_mixer")
    xla = {key(r): r["per_token_ms"]
           for r in rows if r["impl"] == "xla" and r["decode_matmul"] == "xla"
           and r.get("decode_attention", "model") == "model"
           and r.get("decode_blocks", "layers") == "layers"
           and r.get("one_row_pad_below") is None and not r.get("xla_option_set")}
    lines = ["| model | impl | decode matmul | decode attention | decode mixer | batch | context "
             "| prefill (ms) | per token (ms), median [min, max] | tokens/s | HBM floor (ms) "
             "| × floor | vs xla |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = xla.get(key(r))
        lines.append(
            f"| {r['model']} | {_impl_label(r)} | {_matmul_label(r)} "
            f"| {_attention_label(r)} | {r.get('decode_mixer') or '–'} | {r['batch']} "
            f"| {r['context']} | "
            f"{r['prefill_ms']:.2f} | {r['per_token_ms']:.3f} [{r['per_token_ms_min']:.3f}, "
            f"{r['per_token_ms_max']:.3f}] | {r['tokens_per_s']:,.0f} | "
            f"{r['hbm_floor_ms']:.3f} | {r['x_floor']:.2f} | "
            f"{f'{base / r['per_token_ms']:.3f}x' if base else '–'} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    model_names = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(model_names), figsize=(6 * len(model_names), 4),
                             squeeze=False)
    for ax, name in zip(axes[0], model_names):
        for impl in dict.fromkeys(_impl_label(r) for r in rows):
            for matmul, attention, context in itertools.product(
                    dict.fromkeys(_matmul_label(r) for r in rows),
                    dict.fromkeys(_attention_label(r) for r in rows),
                    sorted({r["context"] for r in rows})):
                sel = sorted((r["batch"], r["per_token_ms"]) for r in rows
                             if (r["model"], _impl_label(r), _matmul_label(r),
                                 _attention_label(r), r["context"])
                             == (name, impl, matmul, attention, context))
                if sel:
                    ax.plot(*zip(*sel), marker="o",
                            label=f"{impl}, {matmul} matmuls, {attention} attention, "
                                  f"context {context}")
        contexts = sorted({r["context"] for r in rows if r["model"] == name})
        for context, style in zip(contexts, itertools.cycle(["k--", "k:", "k-."])):
            floor = sorted({(r["batch"], r["hbm_floor_ms"]) for r in rows
                            if (r["model"], r["context"]) == (name, context)})
            ax.plot(*zip(*floor), style, label=f"HBM floor, context {context}")
        ax.set(xscale="log", xlabel="batch", ylabel="ms per decode step", title=name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--json", help="write the rows here (after each one)")
    parser.add_argument("--plot", help="write a plot of the rows here (needs matplotlib)")
    parser.add_argument("--models", nargs="+", default=["transformer", "mamba"],
                        choices=tuple(models.MODELS))
    parser.add_argument("--size", default="1b", choices=tuple(models.SIZES))
    parser.add_argument("--config", default=None,
                        help=f"a published model's shape on random weights, one of "
                             f"{', '.join(models.shapes.NAMES)} (its real vocabulary, heads "
                             f"and rope), or a Llama checkpoint directory's config.json; "
                             f"replaces --models and --size")
    parser.add_argument("--mesh", type=parse_mesh_shape, default=(1, 2),
                        metavar="DATAxTENSOR")
    parser.add_argument("--impls", nargs="+", default=["xla", "auto", "cuda:lamport",
                                                       "cuda:one_shot", "cuda:two_shot"])
    parser.add_argument("--decode-matmuls", nargs="+", default=["xla"],
                        choices=models.DECODE_MATMUL_IMPLS,
                        help="the decode step's weight matmuls to compare (each with every impl)")
    parser.add_argument("--decode-attentions", nargs="+", default=["auto"],
                        choices=models.DECODE_ATTENTION_IMPLS,
                        help="the Transformer's decode attentions to compare (each with every "
                             "impl and matmul; default: the model's default, 'auto', each row "
                             "naming what it ran; Mamba-2 runs only 'model')")
    parser.add_argument("--decode-blocks", nargs="+", default=["auto"],
                        choices=models.DECODE_BLOCKS,
                        help="the Transformer's decode blocks to compare: each layer's own "
                             "decode, all in one CUDA kernel, or the kernel where it runs and "
                             "was measured faster (TransformerConfig.decode_blocks; default: "
                             "the model's default, 'auto', each row naming what it ran; with "
                             "the kernel the attention is its own, so --decode-attentions "
                             "adds no rows to it)")
    parser.add_argument("--tensor-parallel-kernel", action="store_true",
                        help="let --decode-blocks cuda run the one-kernel step above tensor "
                             "size 1 (models.transformer_decode_cuda.TENSOR_PARALLEL, "
                             "experimental; recorded in the JSON's settings)")
    parser.add_argument("--decode-mixers", nargs="+", default=["xla"],
                        choices=models.DECODE_MIXER_IMPLS,
                        help="Mamba-2's decode mixers to compare (each with every impl and "
                             "matmul)")
    parser.add_argument("--split-positions", nargs="+", type=int, default=[None],
                        help="with the attention kernel, each of these fewest cache positions "
                             "per split (models.decode_attention_pallas.MIN_SPLIT_POSITIONS; "
                             "default: its value)")
    parser.add_argument("--attention-inputs", nargs="+", choices=("separate", "packed"),
                        default=[None], help="with the attention kernel, its q, k and v "
                        "apart or packed in one array (models.decode_attention_pallas."
                        "PACKED_INPUTS; default: its value)")
    parser.add_argument("--one-row-pad-below", nargs="+", type=int, default=[None],
                        help="each of these weight sizes (elements) below which XLA's one-row "
                             "dots are padded to two rows (jax_flashoverlap.decode_matmul."
                             "ONE_ROW_PAD_BELOW; default: its value)")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 32, 128])
    parser.add_argument("--contexts", nargs="+", type=int, default=[512, 4096])
    parser.add_argument("--steps", nargs=2, type=int, default=(16, 48), metavar=("K1", "K2"),
                        help="decode loop lengths whose difference is timed")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on GPU")
    parser.add_argument("--param-dtype", default="float32", choices=models.PARAM_DTYPES,
                        help="how the model keeps its weights: bfloat16 halves their memory "
                             "(Llama-3.1-8B's shape: 16 GB against 32); the decode step reads "
                             "bfloat16 weights either way")
    parser.add_argument("--attention", default="auto", choices=models.ATTENTION_IMPLS,
                        help="the Transformer's attention (auto: cuDNN where supported)")
    parser.add_argument("--hbm-tb-s", type=float, default=None,
                        help="HBM bandwidth per GPU for the floor, TB/s (default: the GPU's "
                             "datasheet figure, e.g. 4.8 on an H200 and 3.35 on an H100 SXM)")
    parser.add_argument("--heap-mb", type=int, default=1024,
                        help="NVSHMEM heap per GPU, when started by the launcher")
    parser.add_argument("--xla-option", dest="xla_options", action="append", default=[],
                        type=_xla_option, metavar="NAME=VALUE",
                        help="an XLA option for every decode loop; repeatable")
    parser.add_argument("--xla-option-sets", nargs="+", default=[""], metavar="SET",
                        help="a sweep of XLA options for the decode loops, timed in one "
                             "process: each SET is NAME=VALUE pairs joined by commas, or "
                             "'default' for none (added to --xla-option's)")
    parser.add_argument("--profile", metavar="DIR", default=None,
                        help="also trace one decode loop of K2 steps per case, into "
                             "DIR/MODEL_IMPL_bBATCH_cCONTEXT (benchmarks/kernel_times.py "
                             "trace summarises one)")
    args = parser.parse_args(argv)
    models.transformer_decode_cuda.TENSOR_PARALLEL = args.tensor_parallel_kernel
    args.xla_options = dict(args.xla_options)
    try:
        option_sets = [tuple(_xla_option_set(text).items()) for text in args.xla_option_sets]
    except argparse.ArgumentTypeError as e:
        parser.error(f"--xla-option-sets: {e}")
    impls = [(name, *_impl_and_algorithm(name)) for name in args.impls]
    if not 0 < args.steps[0] < args.steps[1]:
        parser.error(f"--steps: need 0 < K1 < K2, got {args.steps}")
    # The check generates from the context's first context - CHECK_TOKENS
    # tokens and runs the forward pass over `context`, which the tensor axis splits.
    for context in args.contexts:
        if context <= CHECK_TOKENS or context % args.mesh[1]:
            parser.error(f"--contexts: each must exceed {CHECK_TOKENS} and divide by the "
                         f"tensor axis ({args.mesh[1]}), got {context}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib: pip install 'jax-flashoverlap[bench]'")
    if distributed.is_launched():
        distributed.initialize()
        from jax_flashoverlap import nvshmem

        if nvshmem.is_built() and jax.default_backend() == "gpu":
            nvshmem.initialize(heap_mb=args.heap_mb)
    else:
        ensure_cpu_devices(train.CPU_DEVICES)  # CPU smoke runs; GPUs are unaffected.
    lead = jax.process_index() == 0
    args.hbm_tb_s, bandwidth_source = floor_bandwidth(args.hbm_tb_s, parser)
    mesh = train.make_mesh(args.mesh, models.ShardingConfig())
    settings = {k: v for k, v in vars(args).items() if k not in ("json", "plot", "profile")}
    meta = benchmarking.provenance(settings)
    meta["hbm_floor"] = (f"(weight + cache bytes per GPU) / {args.hbm_tb_s} TB/s "
                         f"({bandwidth_source})")
    rows = []
    # Cases as they ran: "auto" and an explicit choice can resolve to the same step.
    measured = set()
    rng = np.random.default_rng(0)
    shape = None
    if args.config is not None:
        model_kind, shape = models.shapes.config_of(args.config)
        args.models, args.size = [model_kind], args.config
    for model_name in args.models:
        exact = None  # one float32 reference per model: every impl has the same parameters
        transformer = model_name == "transformer"
        attentions = args.decode_attentions if transformer else ["model"]
        mixers = ["xla"] if transformer else args.decode_mixers
        blocks = args.decode_blocks
        variants = [(attention, mixer, block) for block in dict.fromkeys(blocks)
                    for attention in (dict.fromkeys(attentions) if block != "cuda"
                                      else attentions[:1])
                    for mixer in dict.fromkeys(mixers)]
        for (label, impl, algorithm), decode_matmul, (decode_attention, decode_mixer,
                                                      decode_blocks) in (
                itertools.product(impls, args.decode_matmuls, variants)):
            model = build_model(model_name, shape or args.size, impl, mesh, args.dtype,
                                args.attention,
                                decode_matmul, decode_attention, decode_mixer, decode_blocks,
                                args.param_dtype)
            mixer_ran = None if transformer else decode_mixer
            if exact is None:
                with jax.set_mesh(mesh):
                    exact = float32_copy(model)
            for batch in args.batches:
                # What "auto" resolved to for this batch on this platform, as the rows
                # record it.
                blocks_ran = (model.decode_blocks_implementation(
                    batch=batch // args.mesh[0], tensor_size=args.mesh[1]) if transformer
                    else model.config.decode_blocks)
                attention_ran = (model.blocks[0].attn.decode_implementation(
                    batch // args.mesh[0]) if transformer and blocks_ran == "layers"
                    else "model")
                kernel_settings = (itertools.product(
                    args.split_positions,
                    [None if v is None else v == "packed" for v in args.attention_inputs])
                    if attention_ran == "pallas" else [(None, None)])
                for split_positions, packed in kernel_settings:
                    for context, pad_below, option_set in itertools.product(
                            args.contexts, args.one_row_pad_below, option_sets):
                        case = Case(model_name, label, decode_matmul, attention_ran,
                                    blocks_ran, mixer_ran, split_positions, packed, pad_below,
                                    option_set, batch, context)
                        if case in measured:
                            if lead:
                                print(f"--- {case}: the step of a row above (decode_blocks "
                                      f"{decode_blocks!r} ran {blocks_ran!r}), not measured "
                                      "again", flush=True)
                            continue
                        measured.add(case)
                        if lead:
                            print(f"--- {case}", flush=True)
                        with (jax.set_mesh(mesh), forced_algorithm(algorithm),
                              split_positions_set(split_positions),
                              packed_inputs_set(packed),
                              one_row_pad_set(pad_below)):
                            row = measure(model, exact, case, args, rng)
                        rows.append(row)
                        gc.collect()
                        if lead:
                            print(json.dumps(row), flush=True)
                            if args.json:
                                with open(args.json, "w") as f:
                                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
            del model
            gc.collect()
        del exact
    if lead:
        print(f"\nDecoding, mesh {args.mesh[0]}x{args.mesh[1]} (data x tensor) in "
              f"{jax.process_count()} process(es), {rows[0]['dtype'] if rows else ''}; "
              f"decode step by (T({args.steps[1]}) - T({args.steps[0]})) / "
              f"{args.steps[1] - args.steps[0]}\n")
        print(table(rows))
        if args.plot and rows:
            plot(rows, args.plot)
    return 0 if all(math.isfinite(r["per_token_ms"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
