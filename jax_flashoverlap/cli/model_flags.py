"""--model and --size: which model a command builds, the same for every
command that builds one (a checkpoint restores into the model the same flags
build), and the model a Hugging Face checkpoint holds."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..models import MODELS, SIZES

__all__ = ["CHECKPOINT_MODELS", "add_model_flags", "resolve_model"]

# A Hugging Face checkpoint's model_type -> the --model that holds it.
CHECKPOINT_MODELS = {"llama": "transformer", "mamba2": "mamba"}


def add_model_flags(parser: argparse.ArgumentParser) -> None:
    """--model and --size."""
    parser.add_argument("--model", choices=tuple(MODELS), default=None,
                        help="default: transformer, or the model of a Hugging Face "
                             "checkpoint the command reads")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny",
                        help="a preset (default: %(default)s; not with a Hugging Face "
                             "checkpoint, whose config.json sets the shape)")


def resolve_model(parser: argparse.ArgumentParser, args: argparse.Namespace,
                  checkpoint: Path | None, flag: str) -> None:
    """Sets ``args.model``: the model of the Hugging Face ``checkpoint``
    directory that ``flag`` names, where there is one (an error through
    ``parser`` for another --model, or a checkpoint no model holds); else
    --model, or "transformer"."""
    if checkpoint is None:
        args.model = args.model or "transformer"
        return
    if not (checkpoint / "config.json").is_file():
        parser.error(f"{flag} {checkpoint}: no config.json there")
    model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type")
    if model_type not in CHECKPOINT_MODELS:
        parser.error(f"{flag} {checkpoint}: model_type {model_type!r}; the models read "
                     f"{sorted(CHECKPOINT_MODELS)} checkpoints")
    model = CHECKPOINT_MODELS[model_type]
    if args.model not in (None, model):
        parser.error(f"{flag} {checkpoint} holds a {model_type} checkpoint, which --model "
                     f"{model} reads, not --model {args.model}")
    args.model = model
