"""Command line: `cacheclip demo | ingest | query | inspect | verify | evict | compact | eval | bench`.

Arguments are parsed and checked first with nothing heavy imported (`args`); torch, transformers and
LlamaIndex load only when a command's work starts, so `--help` and every refusal of bad input answer
at once. One module per family of commands: `demo`, `documents` (ingest, query), `maintain` (inspect,
verify, evict, compact), `evaluate` (eval, bench). Environment variables are read here only
(CACHECLIP_CACHE moves the model cache and the default store).
"""

from __future__ import annotations

import importlib
import logging

from .args import COMMANDS, parser

# names importable from `cacheclip_rag.cli` as before the split, each loaded on first use
_MOVED = {"demo_chunks": "demo", "DEMO_QUESTIONS": "demo", "_read_nodes": "documents", "_load_documents": "documents"}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    check, target = COMMANDS[args.command]
    check(args)  # bad input is refused here, before anything heavy loads
    module_name, function = target.split(":")
    work = getattr(importlib.import_module(f"{__name__}.{module_name}"), function)
    from ..models.sources import ModelSourceError
    from ..store import StoreError

    try:
        return work(args)
    except StoreError as err:  # a damaged, foreign, busy or full store: one line, not a traceback
        raise SystemExit(f"cacheclip {args.command}: {err}") from None
    except ModelSourceError as err:  # a model that cannot serve, found as it loads
        raise SystemExit(f"cacheclip {args.command}: {err}") from None


def __getattr__(name: str):
    if name in _MOVED:
        return getattr(importlib.import_module(f"{__name__}.{_MOVED[name]}"), name)
    if name == "Engine":
        from ..engine.core import Engine

        return Engine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
