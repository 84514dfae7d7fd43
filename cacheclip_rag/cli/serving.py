"""`cacheclip serve`: the OpenAI-compatible server over one engine (`cacheclip_rag.serve`)."""

from __future__ import annotations

import argparse
import os

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
    config = engine_config(args)
    if args.replicas:
        return run_replicas(args, config, settings)
    engine = Engine.from_config(config)
    serve(engine, settings, host=args.host, port=args.port)
    return 0


def run_replicas(args: argparse.Namespace, config, settings) -> int:
    """`args.replicas` replicas on Ray Serve, on RAY_ADDRESS's cluster or a local one; blocks until stopped."""
    import ray
    from ray import serve as ray_serve

    from ..serve.replicas import ConfiguredReplica, application

    ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True)
    ray_serve.start(http_options={"host": args.host, "port": args.port})
    app = application(ConfiguredReplica(config, settings), config.shared_store, args.replicas, settings.keys,
                      router=args.router)
    ray_serve.run(app, name="cacheclip", route_prefix="/", blocking=True)
    return 0
