"""scalestudy: measure and model how large-model training scales."""

__version__ = "0.1.0"
