"""Importing the package from a checkout's root finds the installed extension.

With the checkout's root first on ``sys.path`` (``python -c``, a script
there), Python finds the source folder ``jax_flashoverlap/``, which has
neither the compiled extension nor the models (they live at the checkout's
top level). This adds the installed package's folder to the package's search
path, after the source one, so that both come from the install.
"""

import pathlib
import sys

_package = sys.modules[__package__]
_here = pathlib.Path(_package.__file__).resolve().parent

if not (any(_here.glob("_ffi*.so")) or (_here / "models").is_dir()):  # a source folder
    for _entry in sys.path:
        _candidate = pathlib.Path(_entry or ".").resolve() / __package__
        if _candidate != _here and (_candidate / "__init__.py").is_file():
            _package.__path__.append(str(_candidate))
            break
