"""Trains the Transformer or Mamba-2 on a (data x tensor) mesh with optax.

    python -P -m jax_flashoverlap.cli.train --model transformer --size tiny --steps 200
    jax-flashoverlap-train --model mamba --size 1b --mesh 1x2 --seq-len 8192 --batch 1

Byte-level tokens from ``--data FILE``, or from a text corpus that ships with
Python (so it runs offline). AdamW with linear warm-up, cosine decay and
gradient clipping; ``--checkpoint-dir``/``--restore`` save and resume with
orbax-checkpoint; ``--profile DIR`` writes a ``jax.profiler`` trace of a few
steps, where the overlap ops appear as ``jax_flashoverlap.<op>``. Without a
GPU it runs on 8 CPU devices, and says so.
"""

from __future__ import annotations

from . import _requires_models  # noqa: F401  (first: names the extra if flax is missing)

# isort: split

import argparse
import contextlib
import dataclasses
import functools
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from .. import dispatch
from ..models import (
    IMPLS,
    MODELS,
    MambaConfig,
    ShardingConfig,
    SSDTiling,
    TransformerConfig,
    attention_implementation,
    from_pretrained,
    pretrained_config,
    resolve_scan_layers,
    save_pretrained,
)
from ..models.mamba import resolve_scan_layers as resolve_mamba_scan_layers
from . import tokens
from .checkpoints import (
    checkpoint_manager,
    does_not_fit,
    first_line,
    restore_model_state,
    shape_difference,
)
from .data import batch_at, load_corpus
from .devices import ensure_cpu_devices
from .flags import HelpFormatter, parse_mesh_shape
from .kernel_flags import add_kernel_flags, check_kernel_flags
from .model_flags import add_model_flags, resolve_model
from .progress import TrainingProgress

__all__ = ["main", "train", "parse_args", "make_mesh", "model_config",
           "restore_model_state", "build", "Trainer", "TrainResult", "loss_fn"]

CPU_DEVICES = 8
# Dense bf16 datasheet peak of one H200, the GPU the targets are set on.
PEAK_FLOPS_PER_GPU = 989e12
PROFILE_STEPS = 3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jax-flashoverlap-train",
                                     description=__doc__.splitlines()[0],
                                     formatter_class=HelpFormatter)
    add_model_flags(parser)
    parser.add_argument("--mesh", type=parse_mesh_shape, default=None, metavar="DATAxTENSOR",
                        help="mesh shape, e.g. 4x2; None: tensor 2, data the rest")
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    parser.add_argument("--steps", type=int, default=100,
                        help="total steps (the schedule's length; --restore continues)")
    parser.add_argument("--impl", choices=IMPLS, default="auto",
                        help="implementation of the overlap ops")
    add_kernel_flags(parser)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                        help="compute dtype (None: bfloat16 on GPU, float32 on CPU); "
                             "parameters and optimizer state stay float32")
    parser.add_argument("--no-sequence-parallel", dest="sequence_parallel",
                        action="store_false",
                        help="replicate the residual stream over the tensor axis "
                             "(row-parallel layers all-reduce instead of reduce-scatter)")
    parser.add_argument("--remat", action="store_true", help="recompute blocks in backward")
    layers = parser.add_mutually_exclusive_group()
    layers.add_argument("--unroll-layers", dest="scan_layers", action="store_false",
                        default=None,
                        help="unroll the blocks (unset: unrolled for Mamba-2 on GPUs and for "
                             "the Transformer with cuDNN attention; scanned otherwise)")
    layers.add_argument("--scan-layers", dest="scan_layers", action="store_true",
                        help="run the blocks as one lax.scan: one block to compile, "
                             "slower steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    parser.add_argument("--warmup", type=int, default=None,
                        help="warm-up steps (None: 5%% of --steps)")
    parser.add_argument("--weight-decay", type=float, default=0.1,
                        help="AdamW's decoupled weight decay")
    parser.add_argument("--clip", type=float, default=1.0, help="global gradient-norm clip")
    parser.add_argument("--seed", type=int, default=0,
                        help="the parameters' initialisation and the batches' order")
    parser.add_argument("--data", type=Path, default=None,
                        help="a file of training text (None: Python's pydoc topics)")
    parser.add_argument("--checkpoint-dir", type=Path, default=None,
                        help="save the final state here (orbax-checkpoint)")
    parser.add_argument("--checkpoint-every", type=int, default=0,
                        help="also save every N steps (0: only at the end)")
    # DIR optional: `--restore ckpt` reads as jax-flashoverlap-generate's flag does.
    parser.add_argument("--restore", nargs="?", const=True, default=None, type=Path,
                        metavar="DIR",
                        help="resume from the latest checkpoint in DIR (alone: in "
                             "--checkpoint-dir), and keep checkpointing there")
    parser.add_argument("--init-from", type=Path, default=None, metavar="DIR",
                        help="start from a Llama or Mamba-2 checkpoint in the Hugging Face "
                             "layout (config.json, safetensors, tokenizer.json; --size is "
                             "ignored), its tokenizer reading --data")
    parser.add_argument("--save-pretrained", type=Path, default=None, metavar="DIR",
                        help="also write the final model here in the Hugging Face layout "
                             "(with --init-from's tokenizer.json)")
    parser.add_argument("--profile", type=Path, default=None, metavar="DIR",
                        help=f"write a jax.profiler trace of {PROFILE_STEPS} steps here")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar (the summary still prints)")
    args = parser.parse_args(argv)
    if isinstance(args.restore, Path):
        if args.checkpoint_dir not in (None, args.restore):
            parser.error(f"--restore {args.restore} and --checkpoint-dir {args.checkpoint_dir}: "
                         f"a run resumes from and saves to one directory; give one of them")
        args.checkpoint_dir, args.restore = args.restore, True
    if args.restore and args.checkpoint_dir is None:
        parser.error("--restore needs a directory: --restore DIR, or --checkpoint-dir DIR")
    resolve_model(parser, args, args.init_from, "--init-from")
    check_kernel_flags(parser, args)
    if args.residuals != "named" and args.remat:
        parser.error(f"--residuals {args.residuals} and --remat exclude each other (keep "
                     f"residuals, or recompute every block)")
    if args.init_from is not None and args.restore:
        parser.error("--init-from starts a run, --restore resumes one: give one of them")
    if args.data is not None and not args.data.is_file():
        parser.error(f"--data {args.data}: no such file")
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    return args


def loss_fn(model: nnx.Module, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; tokens: [b, s + 1] int."""
    log_probs = jax.nn.log_softmax(model(tokens[:, :-1]).astype(jnp.float32))
    return -jnp.mean(jnp.take_along_axis(log_probs, tokens[:, 1:, None], axis=-1))


def _optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    warmup = args.warmup if args.warmup is not None else max(1, args.steps // 20)
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, args.lr, warmup_steps=min(warmup, args.steps),
        decay_steps=max(args.steps, warmup + 1), end_value=args.lr / 10)
    # No weight decay on vectors (norm weights, per-head SSM parameters).
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(args.clip),
                       optax.adamw(schedule, b1=0.9, b2=0.95,
                                   weight_decay=args.weight_decay, mask=decay_mask))


@dataclasses.dataclass
class Trainer:
    """A model and its optimizer on a mesh, and the jitted training step.

    Attributes:
      args: the parsed flags.
      mesh: the (data, tensor) mesh.
      config: the model config.
      num_params: parameters of the model.
      state: the current ``(model, optimizer)`` state, sharded as the
        parameters' metadata says.
      step: ``step(state, tokens [b, s+1]) -> (state, loss, grad_norm)``; donates state.
        Lowered (at its first call) inside ``dispatch.prefer_xla`` of the
        config's ``auto_xla_ops``.
      flops_per_step: model FLOPs of one step (for MFU).
      peak_flops: the mesh's peak FLOP/s on GPUs (H200 bf16 datasheet), else None.
      platform: where it runs, in words.
      attention: the Transformer's attention implementation ("cudnn" or
        "xla"); None for a model without attention.
      graphdef: what ``nnx.merge(graphdef, state)`` makes the modules of.
    """

    args: argparse.Namespace
    mesh: jax.sharding.Mesh
    config: Any
    num_params: int
    state: Any
    step: Any
    flops_per_step: float
    peak_flops: float | None
    platform: str
    attention: str | None = None
    graphdef: Any = None

    def tokens(self, corpus: np.ndarray, step: int) -> jax.Array:
        """Step ``step``'s batch on the mesh, split over the data axis."""
        batch = batch_at(corpus, step, batch=self.args.batch, seq_len=self.args.seq_len,
                         seed=self.args.seed)
        return jax.device_put(batch, NamedSharding(self.mesh,
                                                   P(self.config.sharding.data, None)))


def with_preferred_xla(fn: Callable, ops: Sequence[str]) -> Callable:
    """``fn`` called inside :func:`jax_flashoverlap.dispatch.prefer_xla` of
    ``ops``, so that its lowering (at its first call) leaves them to XLA."""
    if not ops:
        return fn

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with dispatch.prefer_xla(ops):
            return fn(*args, **kwargs)
    return call


def make_mesh(shape: tuple[int, int] | None, sharding: ShardingConfig) -> jax.sharding.Mesh:
    """The (data, tensor) mesh of ``--mesh DATAxTENSOR`` (default: tensor 2, data the rest)."""
    devices = jax.devices()
    data, tensor = shape or (max(1, len(devices) // 2), min(2, len(devices)))
    if data * tensor > len(devices):
        raise ValueError(f"--mesh {data}x{tensor} needs {data * tensor} devices; "
                         f"there are {len(devices)}")
    return jax.sharding.Mesh(np.asarray(devices[:data * tensor]).reshape(data, tensor),
                             (sharding.data, sharding.tensor))


def model_config(model: str, size: str | TransformerConfig | MambaConfig, *,
                 impl: str = "auto",
                 dtype: str | None = None, param_dtype: str = "float32",
                 sharding: ShardingConfig | None = None, remat: bool = False,
                 scan_layers: bool | None = None, attention: str = "auto", ssd: str = "auto",
                 conv: str = "xla", norm_backward: str = "auto",
                 residuals: str = "named", fuse_skip: bool = True,
                 decode_matmul: str = "xla", chunk_size: int | None = None,
                 ssd_keeps_chunk_states: bool = False, decode_attention: str = "auto",
                 decode_mixer: str = "xla", ssd_tiling: SSDTiling | None = None,
                 decode_blocks: str = "auto"):
    """The config ``--model``/``--size`` and the other flags make, as training uses it.

    ``dtype`` None: bfloat16 on GPUs, float32 elsewhere; ``param_dtype``:
    how the weights are kept (the configs' field); ``sharding`` None:
    the default ``ShardingConfig()``. ``scan_layers`` None is resolved for
    this platform and, for the Transformer, the attention that runs here.
    ``chunk_size`` None: the size's (Mamba-2 only); ``decode_attention``:
    the Transformer's (``TransformerConfig.decode_attention``);
    ``decode_blocks``: either model's ("auto" is Mamba-2's "layers");
    ``decode_mixer``: Mamba-2's (``MambaConfig.decode_mixer``); ``ssd_tiling``
    None: the SSD kernels' defaults (``MambaConfig.ssd_tiling``). ``size``
    may be a config (a checkpoint's, or a published shape's) in place of a
    preset's name.
    """
    config_cls, _ = MODELS[model]
    has_attention = config_cls is TransformerConfig
    on_gpu = jax.default_backend() == "gpu"
    make = (functools.partial(dataclasses.replace, size) if isinstance(size, config_cls)
            else functools.partial(config_cls.preset, size))
    config = make(
        dtype=dtype or ("bfloat16" if on_gpu else "float32"), param_dtype=param_dtype,
        impl=impl, remat=remat,
        sharding=sharding or ShardingConfig(), decode_matmul=decode_matmul,
        **({} if scan_layers is None else {"scan_layers": scan_layers}),
        **({"attention_impl": attention, "decode_attention": decode_attention,
            "decode_blocks": decode_blocks} if has_attention
           else {"ssd_impl": ssd, "conv_impl": conv, "norm_backward": norm_backward,
                 "residuals": residuals, "fuse_skip": fuse_skip,
                 "ssd_keeps_chunk_states": ssd_keeps_chunk_states, "decode_mixer": decode_mixer,
                 # Mamba-2's kernel is opt-in: its "auto" is its layers.
                 "decode_blocks": "layers" if decode_blocks == "auto" else decode_blocks,
                 "ssd_tiling": ssd_tiling or SSDTiling(),
                 **({} if chunk_size is None else {"chunk_size": chunk_size})}))
    if has_attention:
        return resolve_scan_layers(config, attention_implementation(config))
    return resolve_mamba_scan_layers(config)


def build(args: argparse.Namespace) -> Trainer:
    """Mesh, model, optimizer and training step for ``args`` (see :func:`parse_args`)."""
    on_gpu = jax.default_backend() == "gpu"
    devices = jax.devices()
    sharding = ShardingConfig(sequence_parallel=args.sequence_parallel)
    mesh = make_mesh(args.mesh, sharding)
    data, tensor = mesh.devices.shape
    _, model_cls = MODELS[args.model]
    base = args.size
    if args.init_from is not None:
        base = pretrained_config(args.init_from)
    config = model_config(args.model, base, impl=args.impl, dtype=args.dtype,
                          sharding=sharding, remat=args.remat, scan_layers=args.scan_layers,
                          attention=args.attention, ssd=args.ssd, conv=args.conv,
                          norm_backward=args.norm_backward, residuals=args.residuals,
                          fuse_skip=args.fuse_skip, chunk_size=args.chunk_size,
                          ssd_keeps_chunk_states=args.ssd_keeps_chunk_states,
                          ssd_tiling=args.ssd_tiling)
    # Before compiling anything: a clear error for a shape the mesh cannot split
    # (model_config has already refused cuDNN attention where it cannot run).
    config.check(dict(mesh.shape), batch=args.batch, seq_len=args.seq_len)
    attention = (attention_implementation(config, devices[0])
                 if isinstance(config, TransformerConfig) else None)

    tx = _optimizer(args)
    with jax.set_mesh(mesh):
        # Created inside jit so that every variable is placed by its sharding
        # metadata as it is made (no full copy on one device first).
        @nnx.jit
        def create():
            model = model_cls(config, rngs=nnx.Rngs(args.seed))
            return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

        if args.init_from is None:
            graphdef, state = nnx.split(create())
        else:  # each device reads its shards from the files: no jit around it
            model = from_pretrained(args.init_from, config=config)
            graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))
    shardings = nnx.get_named_sharding(state, mesh)

    @functools.partial(jax.jit, donate_argnums=0, out_shardings=(shardings, None, None))
    def jitted_step(state, tokens):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss, optax.tree.norm(grads)

    step = with_preferred_xla(jitted_step, config.auto_xla_ops)

    platform = (f"{len(devices)} GPU(s)" if on_gpu
                else f"{len(devices)} CPU devices (no GPU found)")
    num_params = sum(x.size for x in jax.tree.leaves(state[0]))
    return Trainer(args, mesh, config, num_params, state, step,
                   flops_per_step=config.flops_per_token(args.seq_len) * args.batch
                   * args.seq_len,
                   peak_flops=PEAK_FLOPS_PER_GPU * data * tensor if on_gpu else None,
                   platform=platform, attention=attention, graphdef=graphdef)


@dataclasses.dataclass
class TrainResult:
    """What a run did.

    Attributes:
      losses: the loss of each step this run took.
      step_times: seconds per step (the first includes compilation).
      start_step: the step it started at (> 0 after ``--restore``).
      state: the final ``(model, optimizer)`` state.
      summary: the numbers of the final summary.
    """

    losses: list[float]
    step_times: list[float]
    start_step: int
    state: Any
    summary: dict[str, Any]


def train(args: argparse.Namespace) -> TrainResult:
    """Runs the training that ``args`` (from :func:`parse_args`) describes."""
    manager = checkpoint_manager(args.checkpoint_dir, resuming=bool(args.restore))
    try:
        return _train(args, manager)
    finally:
        if manager is not None:
            manager.close()


def _train(args: argparse.Namespace, manager: ocp.CheckpointManager | None) -> TrainResult:
    trainer = build(args)
    # A checkpoint's own tokens; else bytes.
    codes = (tokens.for_checkpoint(args.init_from, trainer.config.vocab_size)
             if args.init_from is not None else None)
    corpus = load_corpus(args.data, args.seq_len, codes)
    data, tensor = trainer.mesh.devices.shape
    name = args.init_from or f"{args.model}/{args.size}"
    print(f"{name} ({trainer.num_params / 1e6:,.1f}M parameters) on mesh "
          f"{data}x{tensor} (data x tensor) of {trainer.platform}; impl {args.impl}, dtype "
          f"{trainer.config.dtype}, {'with' if args.sequence_parallel else 'without'} "
          f"sequence parallelism"
          + (f", attention {trainer.attention}" if trainer.attention else ""), flush=True)
    start = 0
    if args.restore:
        start = manager.latest_step()
        if start is None:
            raise FileNotFoundError(f"--restore: no checkpoint in {args.checkpoint_dir}")
        # The freshly built state gives the restored one its shapes and shardings.
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
            trainer.state)
        # Before any read (see checkpoints.restore_model_state).
        if other := shape_difference(manager.item_metadata(start), abstract):
            raise ValueError(f"--restore: {does_not_fit(args.checkpoint_dir, start, args.model)}"
                             f" ({other})")
        trainer.state = None  # Frees it before the restored copy arrives.
        try:
            trainer.state = manager.restore(start, args=ocp.args.StandardRestore(abstract))
        except ValueError as e:
            raise ValueError(f"--restore: {does_not_fit(args.checkpoint_dir, start, args.model)}"
                             f" (orbax: {first_line(e)})") from e
        print(f"restored step {start} from {args.checkpoint_dir}", flush=True)

    # Trace steady-state steps: from this run's second step, if it has one.
    first = start + 1 if args.steps - start > 1 else start
    profiling = range(first, min(first + PROFILE_STEPS, args.steps)) if args.profile else range(0)
    # Left out of the step time: the traced steps (the last one's interval
    # also holds stop_trace) and the first after them, which starts on an
    # idle device.
    progress = TrainingProgress(trainer, start,
                         untimed=range(profiling.start, profiling.stop + 1) if profiling else ())
    saved = None  # the last step this run checkpointed
    with jax.set_mesh(trainer.mesh), contextlib.closing(progress):
        pending = None
        for i in range(start, args.steps):
            if profiling and i == profiling.start:
                # Earlier steps (the first runs long) must not leak into the trace.
                jax.block_until_ready(trainer.state)
                jax.profiler.start_trace(str(args.profile))
            trainer.state, loss, grad_norm = trainer.step(trainer.state,
                                                          trainer.tokens(corpus, i))
            # Read the previous step's loss only now, with this one queued
            # behind it: the device never waits for the host.
            if pending is not None:
                progress.finished(*pending)
            pending = (loss, grad_norm)
            if i + 1 == profiling.stop:
                jax.block_until_ready(trainer.state)
                jax.profiler.stop_trace()
                print(f"profile: steps {profiling.start}-{profiling.stop - 1} traced to "
                      f"{args.profile}; open it with `tensorboard --logdir {args.profile}` "
                      f"(XProf), or load its plugins/profile/*/*.trace.json.gz in "
                      f"https://ui.perfetto.dev", file=sys.stderr, flush=True)
            if manager and args.checkpoint_every and (i + 1) % args.checkpoint_every == 0:
                manager.save(i + 1, args=ocp.args.StandardSave(trainer.state))
                saved = i + 1
        if pending is not None:
            progress.finished(*pending)
    if manager is not None:
        if start < args.steps and saved != args.steps:  # this run's final state
            manager.save(args.steps, args=ocp.args.StandardSave(trainer.state), force=True)
        manager.wait_until_finished()
    if args.save_pretrained is not None:
        _save_pretrained(trainer, args)
    summary = progress.summary()
    print(_format_summary(trainer, summary), flush=True)
    return TrainResult(progress.losses, progress.times, start, trainer.state, summary)


def _save_pretrained(trainer: Trainer, args: argparse.Namespace) -> None:
    """The final model in the Hugging Face layout, with --init-from's tokenizer."""
    model, _ = nnx.merge(trainer.graphdef, trainer.state)
    save_pretrained(model, args.save_pretrained)
    if args.init_from is not None and (args.init_from / "tokenizer.json").is_file():
        shutil.copyfile(args.init_from / "tokenizer.json",
                        args.save_pretrained / "tokenizer.json")
    print(f"saved the model to {args.save_pretrained} (Hugging Face layout)", flush=True)


def _format_summary(trainer: Trainer, s: dict[str, Any]) -> str:
    if not s["steps"]:
        return f"nothing to do: already at step {trainer.args.steps}"
    mfu = (f"{s['mfu']:.1%} of {PEAK_FLOPS_PER_GPU / 1e12:.0f} TFLOP/s per GPU"
           if s["mfu"] is not None else "n/a (no GPU)")
    return (f"done: {s['steps']} steps of {s['model']}/{s['size']}, impl {s['impl']}: "
            f"loss {s['first_loss']:.3f} -> {s['final_loss']:.3f}\n"
            f"  step time {s['step_time_s'] * 1e3:.1f} ms (median of {s['timed_steps']} "
            f"step{'s' if s['timed_steps'] != 1 else ''} "
            f"after the first{', untraced' if s['traced_steps_untimed'] else ''}), "
            f"{s['tokens_per_s']:,.0f} tokens/s, MFU {mfu}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ensure_cpu_devices(CPU_DEVICES)  # Before JAX starts its backends.
    try:
        train(args)
    except (ValueError, FileNotFoundError) as e:  # a flag or file the run cannot take
        print(f"jax-flashoverlap-train: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
