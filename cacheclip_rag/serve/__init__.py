"""`cacheclip serve`: an OpenAI-compatible server over one engine that finds stored chunks inside ordinary
prompts (`app`, `layouts`, `requests`, `tenants`, `keys`, `protocol`, `worker`, `metrics`). Needs
`pip install 'cacheclip-rag[serve]'`. The names below load on first use, so the CLI can check a keys file
(`keys`) without importing the server."""

from __future__ import annotations

__all__ = ["ServerSettings", "create_app", "serve", "uvicorn_config"]


def __getattr__(name: str):
    if name in __all__:
        from . import app

        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
