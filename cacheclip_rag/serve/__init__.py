"""`cacheclip serve`: an OpenAI-compatible server over one engine that finds stored chunks inside ordinary
prompts (`app`, `layouts`, `requests`, `worker`, `metrics`). Needs `pip install 'cacheclip-rag[serve]'`."""

from .app import ServerSettings, create_app, serve

__all__ = ["ServerSettings", "create_app", "serve"]
