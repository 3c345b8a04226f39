"""Model loading, architecture checks and the adapter the engine uses."""

from kvboost.models.adapter import ModelAdapter
from kvboost.models.compat import UnsupportedArchitectureError, check_architecture
from kvboost.models.loading import load_model_and_tokenizer

__all__ = ["ModelAdapter", "UnsupportedArchitectureError", "check_architecture", "load_model_and_tokenizer"]
