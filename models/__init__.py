"""Flax NNX models built on the overlap ops (shipped as jax_flashoverlap.models)."""
