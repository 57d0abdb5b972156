"""Errors shared across specwire. Each carries a one-line message naming the bad value."""


class ModelLoadError(ValueError):
    """A model, tokenizer or checkpoint could not be loaded."""
