"""Resolve a local model path, build the model with its weights, and load its tokenizer."""

from runtime.model_loader.loader import LOAD_FORMATS, load_model
from runtime.model_loader.resolve import ResolvedModel, resolve_model
from runtime.model_loader.tokenizer import get_tokenizer

__all__ = ["LOAD_FORMATS", "ResolvedModel", "get_tokenizer", "load_model", "resolve_model"]
