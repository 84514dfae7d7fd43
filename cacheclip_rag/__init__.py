"""cacheclip-rag: precomputed chunk KV caches, a shared prefix, and aux-guided selective recompute."""

import importlib.util as _importlib_util
import sys as _sys
from pathlib import Path as _Path

# `kernels/` (Triton kernels, each with a pure-torch reference) and `integrations/` (the LlamaIndex and
# LangChain adapters) sit beside this package in the source tree and are mapped to `cacheclip_rag.kernels`
# / `cacheclip_rag.integrations` by pyproject on install. They have no `__init__.py`, so they are never
# importable as top-level `kernels` / `integrations` (Hugging Face's `kernels` package, which
# transformers >= 5.25 imports, would otherwise be shadowed by a checkout on `sys.path`). From a source
# checkout (editable install, or plain PYTHONPATH on the GPU machine, which has no package index) the two
# names, and only these two, are mapped to the checkout's folders here.
_root = _Path(__file__).resolve().parent.parent
if (_root / "pyproject.toml").is_file():
    for _name in ("kernels", "integrations"):
        if (_root / _name).is_dir() and f"{__name__}.{_name}" not in _sys.modules:
            _spec = _importlib_util.spec_from_loader(f"{__name__}.{_name}", None, is_package=True)
            _spec.submodule_search_locations = [str(_root / _name)]
            _sys.modules[_spec.name] = globals()[_name] = _importlib_util.module_from_spec(_spec)

from .config import METHODS, EngineConfig, RequestOptions

# the rest import torch and transformers: loaded on first use, so `import cacheclip_rag` (and the CLI's
# argument checks) take milliseconds, not the ten seconds those imports cost
_LAZY = {"Answer": "engine.core", "Engine": "engine.core", "Stream": "engine.core", "LoadedModel": "models.loading",
         "PromptFormat": "models.loading", "load_model": "models.loading", "LMDBStore": "store", "StoreError": "store"}

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
