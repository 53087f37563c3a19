"""The trainer's flags that choose a model's kernels and what its blocks
keep (attention, the SSD and its tiling, the convolution, the norm's
backward, residuals), and their checks."""

from __future__ import annotations

import argparse

from ..models import ATTENTION_IMPLS, CONV_IMPLS, NORM_BACKWARDS, RESIDUALS, SSD_IMPLS, SSDTiling

__all__ = ["add_kernel_flags", "check_kernel_flags"]

# The flags (by argparse dest) that only one model takes.
MODEL_OF_FLAG = {"attention": "transformer", "ssd": "mamba", "conv": "mamba",
                 "norm_backward": "mamba", "fuse_skip": "mamba", "residuals": "mamba",
                 "chunk_size": "mamba", "ssd_keeps_chunk_states": "mamba",
                 "ssd_tiles": "mamba", "ssd_warps": "mamba", "ssd_stages": "mamba"}


def add_kernel_flags(parser: argparse.ArgumentParser) -> None:
    """Adds the flags; :func:`check_kernel_flags` checks them once parsed."""
    parser.add_argument("--attention", choices=ATTENTION_IMPLS, default="auto",
                        help="Transformer attention: cuDNN flash attention, XLA's, or "
                             "auto (cuDNN on GPUs that support it)")
    parser.add_argument("--ssd", choices=SSD_IMPLS, default="auto",
                        help="Mamba-2's SSD within chunks: fused Pallas GPU kernels, XLA "
                             "einsums, or auto (Pallas on GPUs)")
    parser.add_argument("--conv", choices=CONV_IMPLS, default="auto",
                        help="the backward of Mamba-2's convolution + SiLU: one Pallas GPU "
                             "kernel, XLA's ops, or auto (the kernel on GPUs)")
    parser.add_argument("--norm-backward", choices=NORM_BACKWARDS, default="auto",
                        help="Mamba-2's gated norm in the backward: autodiff, a "
                             "custom_vjp that keeps only its inputs (recompute), that "
                             "with fused GPU kernels (pallas), or those kernels on GPUs "
                             "(auto, the default)")
    parser.add_argument("--chunk-size", type=int, default=None, metavar="L",
                        help="Mamba-2's SSD chunk length (default: the size's; the result "
                             "does not depend on it, only the speed and rounding do)")
    parser.add_argument("--residuals", choices=RESIDUALS, default="named",
                        help="Mamba-2: what a block keeps for the backward (all: every "
                             "residual, 6%% less time a 1b step at seq 8192, about 0.6 GB "
                             "more per layer)")
    parser.add_argument("--fuse-skip", action=argparse.BooleanOptionalAction, default=True,
                        help="Mamba-2: the SSD's output kernel adds the D skip and writes "
                             "the compute dtype (3%% less time a 1b step at seq 8192)")
    parser.add_argument("--ssd-keeps-chunk-states", action=argparse.BooleanOptionalAction,
                        default=False,
                        help="Mamba-2: the SSD's backward keeps the forward's chunk states "
                             "instead of computing them again (experimental, unmeasured)")
    parser.add_argument("--ssd-tiles", default=None, metavar="ROWS[xCOLS]",
                        help="Mamba-2: the Pallas SSD kernels' tiles, e.g. 128x64 (default: "
                             "the kernels' own, square tiles of min(chunk, 64))")
    parser.add_argument("--ssd-warps", type=int, default=None,
                        help="Mamba-2: warps per Pallas SSD kernel program (default 4)")
    parser.add_argument("--ssd-stages", type=int, default=None,
                        help="Mamba-2: software-pipeline stages of the Pallas SSD kernels' "
                             "loops (default 3)")


def refuse_other_models_flags(parser: argparse.ArgumentParser, args: argparse.Namespace,
                              model_of_flag: dict[str, str]) -> None:
    """An error (through ``parser``) for a flag of ``model_of_flag`` (argparse
    dest -> the one model it applies to) set away from its default for
    another ``args.model``."""
    for dest, model in model_of_flag.items():
        if getattr(args, dest) != parser.get_default(dest) and args.model != model:
            parser.error(f"--{dest.replace('_', '-')} applies to --model {model}, "
                         f"not {args.model}")


def check_kernel_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Errors (through ``parser``) for a flag set for the other model or a
    tiling that does not parse; sets ``args.ssd_tiling`` (a
    ``models.SSDTiling``)."""
    refuse_other_models_flags(parser, args, MODEL_OF_FLAG)
    try:
        args.ssd_tiling = SSDTiling.parse(args.ssd_tiles, args.ssd_warps, args.ssd_stages)
    except ValueError as e:
        parser.error(f"--ssd-tiles: {e}")
