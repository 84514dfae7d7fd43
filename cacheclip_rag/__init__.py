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

# the rest import torch and transformers: loaded on first use, so `import cacheclip_rag` (and the CLI's
# argument checks) take milliseconds, not the ten seconds those imports cost
_LAZY = {"Answer": "engine", "Engine": "engine", "Stream": "engine", "LoadedModel": "models", "PromptFormat": "models",
         "load_model": "models", "LMDBStore": "store", "StoreError": "store"}

__all__ = [
    "METHODS", "Answer", "Engine", "EngineConfig", "LMDBStore", "LoadedModel", "PromptFormat",
    "RequestOptions", "StoreError", "Stream", "load_model",
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
