"""cacheclip-rag: precomputed chunk KV caches, a shared prefix, and aux-guided selective recompute."""

from .config import METHODS, EngineConfig, RequestOptions
from .engine import Answer, Engine, Stream
from .models import LoadedModel, PromptFormat, load_model
from .store import LMDBStore, StoreError

__all__ = [
    "METHODS", "Answer", "Engine", "EngineConfig", "LMDBStore", "LoadedModel", "PromptFormat",
    "RequestOptions", "StoreError", "Stream", "load_model",
]
