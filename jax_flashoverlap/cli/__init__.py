"""The command-line applications built on the library: ``train``,
``generate``, ``demo``, ``tune`` and ``launch`` (each runs as ``python -m
jax_flashoverlap.cli.<name>``; the first four are also installed as
``jax-flashoverlap-<name>``, and the launcher as ``jax-flashoverlap-launch``),
with the training command's data and progress modules.

The library never imports this package.
"""
