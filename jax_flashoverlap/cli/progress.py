"""The training command's progress: per-step loss and timing, the tqdm bar,
and the numbers of its final summary."""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
import sys
import time
from typing import Any, Protocol

import jax

__all__ = ["TrainingProgress"]


class TrainingRun(Protocol):
    """What the progress reads of a run (:class:`~jax_flashoverlap.cli.train.Trainer`)."""

    args: argparse.Namespace  # the training command's flags
    num_params: int
    flops_per_step: float
    peak_flops: float | None


class TrainingProgress:
    """Per-step loss and timing, the tqdm bar, and the final numbers."""

    def __init__(self, trainer: TrainingRun, start: int, untimed=()):
        self.trainer = trainer
        self.start = start
        self.untimed = set(untimed)  # steps left out of the summary's step time
        self.losses: list[float] = []
        self.times: list[float] = []
        self.t_last = time.perf_counter()
        args = trainer.args
        self.bar = None
        self._redirect = contextlib.ExitStack()
        if args.progress:
            from tqdm import tqdm
            from tqdm.contrib.logging import logging_redirect_tqdm

            self.bar = tqdm(total=args.steps, initial=start, desc="train", unit="step",
                            file=sys.stderr)
            # The library's one-line notes (e.g. "auto" finding no tuning
            # table at the first compilation) print above the bar, not into
            # it. They propagate to the root logger, which orbax's absl gives
            # a console handler: that one is redirected, and no other added.
            self._redirect.enter_context(logging_redirect_tqdm([logging.getLogger()]))

    def finished(self, loss: jax.Array, grad_norm: jax.Array) -> None:
        """Waits for a step's results; the time since the last one is its step time."""
        loss, grad_norm = float(loss), float(grad_norm)
        now = time.perf_counter()
        self.losses.append(loss)
        self.times.append(now - self.t_last)
        self.t_last = now
        if self.bar is not None:
            step_s = self.times[-1]
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", gnorm=f"{grad_norm:.2f}",
                                 tok_s=f"{self._tokens_per_s(step_s):,.0f}",
                                 step_ms=f"{step_s * 1e3:.0f}", mfu=self._mfu(step_s),
                                 refresh=False)

    def _tokens_per_s(self, step_s: float) -> float:
        return self.trainer.args.batch * self.trainer.args.seq_len / step_s

    def _mfu(self, step_s: float) -> str:
        peak = self.trainer.peak_flops
        return f"{self.trainer.flops_per_step / step_s / peak:.1%}" if peak else "n/a"

    def close(self) -> None:
        self._redirect.close()
        if self.bar is not None:
            self.bar.close()

    def summary(self) -> dict[str, Any]:
        args, trainer = self.trainer.args, self.trainer
        # The first step compiles.
        untraced = [t for i, t in enumerate(self.times[1:], self.start + 1)
                    if i not in self.untimed]
        steady = untraced or self.times[1:] or self.times
        step_s = statistics.median(steady) if steady else float("nan")
        return {
            "model": args.model, "size": args.size, "params": trainer.num_params,
            "impl": args.impl, "steps": len(self.losses),
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "step_time_s": step_s, "timed_steps": len(steady),
            "traced_steps_untimed": bool(self.untimed and untraced),
            "tokens_per_s": self._tokens_per_s(step_s),
            "mfu": trainer.flops_per_step / step_s / trainer.peak_flops
            if trainer.peak_flops else None,
        }
