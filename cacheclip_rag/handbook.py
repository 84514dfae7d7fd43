"""The bundled example document (an observatory's handbook, the demo's and the README's data), reachable from
an installed package wherever it runs: `HANDBOOK` is its path, `cacheclip ingest --handbook` ingests it."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

HANDBOOK = Path(str(files("cacheclip_rag").joinpath("data/observatory_handbook.md")))


def handbook_text() -> str:
    return HANDBOOK.read_text(encoding="utf-8")
