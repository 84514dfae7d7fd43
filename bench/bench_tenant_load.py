"""The load path a server tenant's request takes (issue 68): a request's chunk entries read into the
blended cache's slots through a tenant's `NamespacedStore` (its own namespace, then the operator's) over
LMDB and over a host tier, beside the same read on the store itself. Written against APIs every tree
since the tenants landed has (`LMDBStore`, `HostTier`, `NamespacedStore`, `read_into`), so the same script
times a checkout before and after a refactor (`--root`). Gemma-2k shape (the load bench's: 18 layers x 1 kv
head x 256, 8 chunks of 256 tokens, float16 stored, float32 slots); median of `--repeats`, each after a
warm-up read.

    python bench/bench_tenant_load.py --root /path/to/checkout --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYERS, HEADS, DIM, CHUNKS, TOKENS = 18, 1, 256, 8, 256


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the checkout to time")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sys.path.insert(0, args.root)
    from cacheclip_rag.store import ChunkEntry, LMDBStore
    from cacheclip_rag.store.namespaced import NamespacedStore, namespace_key
    from cacheclip_rag.store.tiers import HostTier

    fingerprint = "f" * 32
    generator = torch.Generator().manual_seed(0)
    entries = [ChunkEntry(torch.randn(LAYERS, HEADS, TOKENS, DIM, generator=generator, dtype=torch.float32).half(),
                          torch.randn(LAYERS, HEADS, TOKENS, DIM, generator=generator, dtype=torch.float32).half(),
                          tuple(range(TOKENS)), tuple((i, i + 1) for i in range(TOKENS))) for _ in range(CHUNKS)]
    keys = [bytes([i]) * 32 for i in range(CHUNKS)]
    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        lmdb = LMDBStore(Path(folder) / "store")
        lmdb.put_many([(namespace_key("tenant", k), fingerprint, e) for k, e in zip(keys, entries)])
        lmdb.put_many([(k, fingerprint, e) for k, e in zip(keys, entries)])
        host = HostTier(lmdb, 1 << 30, pin=False)
        stores = {"lmdb": lmdb, "lmdb, tenant view": NamespacedStore(lmdb, "tenant", ("",)),
                  "host tier": host, "host tier, tenant view": NamespacedStore(host, "tenant", ("",))}
        for name, store in stores.items():
            slots = [(torch.empty(LAYERS, HEADS, TOKENS, DIM), torch.empty(LAYERS, HEADS, TOKENS, DIM))
                     for _ in range(CHUNKS)]
            assert all(e is not None for e in store.read_into(keys, fingerprint, slots))  # warm
            times = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                store.read_into(keys, fingerprint, slots)
                times.append(time.perf_counter() - started)
            rows[name] = statistics.median(times)
    import cacheclip_rag

    print(f"package: {Path(cacheclip_rag.__file__).parent}")
    for name, seconds in rows.items():
        print(f"{name:<24} {1000 * seconds:8.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"root": args.root, "median_s": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
