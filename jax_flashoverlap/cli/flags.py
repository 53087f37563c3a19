"""Flags the commands share: ``--mesh`` and the layout of ``--help``."""

import argparse


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, except switches (a
    ``--no-progress`` that stores False by default would read "(default: True)")
    and options whose help already names their default."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.nargs == 0:  # a switch (store_true, store_false, store_const): no value
            return action.help
        if action.help and "default" in action.help:  # the help says it already
            return action.help
        return super()._get_help_string(action)


def parse_mesh_shape(text: str) -> tuple[int, int]:
    """``--mesh DATAxTENSOR`` (e.g. "4x2") as (data, tensor); argparse's error otherwise."""
    try:
        data, tensor = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--mesh {text!r}: expected DATAxTENSOR, e.g. 4x2") from None
    if data < 1 or tensor < 1:
        raise argparse.ArgumentTypeError(f"--mesh {text!r}: sizes must be positive")
    return data, tensor
