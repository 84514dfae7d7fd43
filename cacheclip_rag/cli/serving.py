"""`cacheclip serve`: the OpenAI-compatible server over one engine (`cacheclip_rag.serve`)."""

from __future__ import annotations

import argparse

from .args import engine_config


def run(args: argparse.Namespace) -> int:
    from ..engine.core import Engine
    from ..serve import ServerSettings, serve
    from ..serve.keys import load_keys

    settings = ServerSettings(model=args.model_name, api_keys=tuple(args.api_key),
                              tenant_keys=load_keys(args.keys) if args.keys else {}, method=args.method,
                              ratio=args.ratio, selection=args.selection,
                              min_recompute_tokens=args.min_recompute_tokens, max_queue=args.max_queue, max_batch=args.max_batch,
                              max_body_bytes=int(args.max_body_mb * (1 << 20)), max_prompt_chars=args.max_prompt_chars,
                              header_timeout_s=args.header_timeout_s, max_connections=args.max_connections,
                              max_connections_per_client=args.max_connections_per_client,
                              max_queued_per_client=args.max_queued_per_client,
                              timeout_s=args.timeout_s)
    engine = Engine.from_config(engine_config(args))
    serve(engine, settings, host=args.host, port=args.port)
    return 0
