"""Imported first by the commands that build models (train, generate): a
plain ``pip install`` has the ops, not the models' dependencies, and a
bare ``No module named 'flax'`` would not say which extra brings them."""

try:
    import flax  # noqa: F401
    import optax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
        f"{e.name} is not installed: the models and the train and generate commands need "
        f"the 'models' extra: pip install 'jax-flashoverlap[models]'", name=e.name) from e
