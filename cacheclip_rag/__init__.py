"""cacheclip-rag: precomputed chunk KV caches, a shared prefix, and aux-guided selective recompute."""

from pathlib import Path as _Path

# `kernels/` and `integrations/` sit beside this package in the source tree and are mapped to
# `cacheclip_rag.kernels` / `cacheclip_rag.integrations` by pyproject on install. From a plain source
# checkout on PYTHONPATH (the GPU machine has no package index to install from), the same names
# resolve through the checkout's root; an installed copy carries them inside the package instead.
_root = _Path(__file__).resolve().parent.parent
if (_root / "kernels" / "selected_attention.py").is_file() and (_root / "pyproject.toml").is_file():
    __path__.append(str(_root))  # noqa: F821 - a package's __path__

from .config import METHODS, EngineConfig, RequestOptions
from .engine import Answer, Engine, Stream
from .models import LoadedModel, PromptFormat, load_model
from .store import LMDBStore, StoreError

__all__ = [
    "METHODS", "Answer", "Engine", "EngineConfig", "LMDBStore", "LoadedModel", "PromptFormat",
    "RequestOptions", "StoreError", "Stream", "load_model",
]
