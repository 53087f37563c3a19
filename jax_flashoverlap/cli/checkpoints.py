"""The training command's checkpoints (orbax-checkpoint): where a run saves,
and the parameters a checkpoint restores into a model built like the one
trained (``jax-flashoverlap-generate --restore``)."""

from __future__ import annotations

from . import _requires_models  # noqa: F401  (first: names the extra if flax is missing)

# isort: split

from pathlib import Path

import jax
import orbax.checkpoint as ocp
from flax import nnx

__all__ = ["restore_model_state", "checkpoint_manager", "does_not_fit", "first_line"]


def restore_model_state(directory: Path, model: nnx.Module, step: int | None = None) -> int:
    """Loads a training checkpoint's parameters into ``model``, in place.

    The trainer saves ``(model state, optimizer state)``; this reads the
    first, placed as ``model``'s variables are. Call it under the model's mesh.

    Args:
      directory: the trainer's ``--checkpoint-dir``.
      model: built from the same config as the trained model.
      step: which checkpoint (default the latest).

    Returns:
      The step restored.

    Raises:
      FileNotFoundError: no checkpoint there.
      ValueError: the checkpoint's parameters are not ``model``'s (another
        model or size), naming what does not fit.
    """
    with ocp.CheckpointManager(Path(directory).absolute(),
                               item_handlers=ocp.PyTreeCheckpointHandler()) as manager:
        step = manager.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {directory} (written by "
                                    f"jax-flashoverlap-train --checkpoint-dir)")
        state = nnx.state(model)
        target = {"0": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                                   sharding=x.sharding), state)}
        mismatch = does_not_fit(directory, step, type(model).__name__)
        # Before any read: a restore that fails on one array leaves the reads of
        # the others running into orbax's closed event loop, which prints a
        # traceback for each at exit.
        if other := shape_difference(manager.item_metadata(step), target):
            raise ValueError(f"{mismatch} ({other})")
        try:
            # Partial: the optimizer's state, saved beside the model's, is not read.
            restored = manager.restore(step, args=ocp.args.PyTreeRestore(
                item=target, partial_restore=True,
                restore_args=jax.tree.map(lambda t: ocp.ArrayRestoreArgs(sharding=t.sharding),
                                          target)))
        except ValueError as e:
            raise ValueError(f"{mismatch} (orbax: {first_line(e)})") from e
    # A partial restore leaves what the checkpoint lacks as it was: placeholders.
    missing = [jax.tree_util.keystr(path) for path, leaf
               in jax.tree_util.tree_leaves_with_path(restored["0"])
               if isinstance(leaf, jax.ShapeDtypeStruct)]
    if missing:
        raise ValueError(f"{mismatch} It lacks {len(missing)} of its parameters, e.g. "
                         f"{', '.join(missing[:3])}.")
    nnx.update(model, restored["0"])
    return step


def shape_difference(metadata, target: dict) -> str:
    """The first parameter of ``target`` whose shape the checkpoint's
    ``metadata`` (orbax's tree of array metadata) holds otherwise, as
    "path: checkpoint (a, b), model (c, d)", or "" (missing parameters are
    the partial restore's to report)."""
    saved = {_path_name(path): getattr(leaf, "shape", None)
             for path, leaf in jax.tree_util.tree_leaves_with_path(getattr(metadata, "tree",
                                                                           metadata))}
    for path, leaf in jax.tree_util.tree_leaves_with_path(target):
        key = _path_name(path)
        if saved.get(key) is not None and tuple(saved[key]) != leaf.shape:
            return f"{key}: checkpoint {tuple(saved[key])}, model {leaf.shape}"
    return ""


def _path_name(path) -> str:
    """"0/blocks/0/attn/out/kernel/value" whether the keys are dict keys,
    sequence indices or attributes (nnx's state and orbax's metadata differ)."""
    parts = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return "/".join(str(p) for p in parts)


def does_not_fit(directory: Path, step: int, model: str) -> str:
    """Why a checkpoint does not restore into a model, and the likely cause."""
    return (f"the checkpoint of step {step} in {directory} does not fit this {model}: was it "
            f"written for another model or size (--model, --size)?")


def first_line(error: Exception) -> str:
    """Orbax's first line: its tree differences run to a hundred more."""
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def checkpoint_manager(directory: Path | None, *,
                       resuming: bool) -> ocp.CheckpointManager | None:
    """A training run's checkpoints in ``directory`` (None: no directory).

    A fresh run (not ``resuming``) refuses a directory that holds
    checkpoints: it would mix two runs' steps, and the latest one, read by
    ``--restore`` and by jax-flashoverlap-generate, could be the other run's.
    """
    if not directory:
        return None
    manager = ocp.CheckpointManager(
        Path(directory).absolute(), item_handlers=ocp.StandardCheckpointHandler(),
        options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    latest = manager.latest_step()
    if latest is not None and not resuming:
        manager.close()
        raise ValueError(f"--checkpoint-dir {directory} already holds a checkpoint "
                         f"(step {latest}): pass --restore to continue that run, or give an "
                         f"empty directory")
    return manager
