"""Beyond one machine (issue 69). This part: the cold tier on S3-compatible object storage, against a real S3
server process on loopback (moto's standalone server, `cacheclip_rag.object_server`).

`--part read`: a request's stored chunks read from each tier into the request's cache slots, entries shaped as
the default primary's (Qwen2.5-Coder-0.5B: 24 layers x 2 KV heads x 64, bfloat16, 256-token chunks), 8 and 16
chunks (2K and 4K tokens): the hot tier (`LMDBStore.read_into`, page cache warm) and the cold tier
(`S3Store.read_into`: concurrent GETs, each entry's checksum and values verified on arrival). MB/s, median of
`--repeats`, both timed in the same repeat.

`--part ttft`: time to first token on the default primary and request defaults, topical single-fact requests
(`evaluation.deployed`, ~2K and ~4K tokens, known answers), per request in one run:
- `full`: no store (everything recomputed: the baseline a cache must beat);
- `miss`: cacheclip with nothing stored (the chunks computed on the miss, then the recompute);
- `cold`: cacheclip with the chunks only in the bucket (a fresh replica: an empty local tier);
- `hot`: the same replica's next request (promoted into its local tier on the cold read).
Each row's answers stand beside its times: right (strict) and equal to `full`'s.

    python bench/bench_scaleout.py --part read --json bench/results/scaleout.json
    python bench/bench_scaleout.py --part ttft --cases 8 --json bench/results/scaleout.json

moto keeps objects in Python memory and answers from one Python process: it is a slow S3 (a real object store
on a LAN or in-region serves several times faster per connection). The rows say what this machine measured.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm.auto import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.evaluation.deployed import WORDS_FOR, case, strict_score  # noqa: E402
from cacheclip_rag.evaluation.stats import wilson_interval  # noqa: E402
from cacheclip_rag.object_server import S3Server  # noqa: E402
from cacheclip_rag.store import ChunkEntry, LMDBStore, entry_key  # noqa: E402
from cacheclip_rag.store.factory import open_store  # noqa: E402
from cacheclip_rag.store.s3_store import S3Store  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, CHUNK = 24, 2, 64, 256


def qwen_entry(i: int) -> ChunkEntry:
    g = torch.Generator().manual_seed(i)
    shape = (LAYERS, KV_HEADS, CHUNK, HEAD_DIM)
    return ChunkEntry(keys=torch.randn(*shape, generator=g).bfloat16(), values=torch.randn(*shape, generator=g).bfloat16(),
                      token_ids=tuple(range(CHUNK)), offsets=tuple((j, j + 1) for j in range(CHUNK)))


def read_rows(server: S3Server, repeats: int) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="scaleout-read-"))
    rows = []
    try:
        lmdb = LMDBStore(work / "hot")
        s3 = S3Store(server.bucket("read") + "/bench")
        for chunks in (8, 16):
            keys = [entry_key("bench", (), f"chunk {chunks}/{i}", "shared") for i in range(chunks)]
            items = [(k, "bench", qwen_entry(i)) for i, k in enumerate(keys)]
            lmdb.put_many(items)
            s3.put_many(items)
            nbytes = sum(e.keys.numel() * 2 * 2 for _, _, e in items)
            slots = [(torch.empty(LAYERS, KV_HEADS, CHUNK, HEAD_DIM, dtype=torch.bfloat16),
                      torch.empty(LAYERS, KV_HEADS, CHUNK, HEAD_DIM, dtype=torch.bfloat16)) for _ in keys]
            times: dict[str, list[float]] = {"hot (LMDB)": [], "cold (S3)": []}
            lmdb.read_into(keys, "bench", slots)  # warm the page cache and the once-per-process verification
            for _ in tqdm(range(repeats), desc=f"read {chunks} chunks"):
                for name, store in (("hot (LMDB)", lmdb), ("cold (S3)", s3)):
                    started = time.perf_counter()
                    found = store.read_into(keys, "bench", slots)
                    times[name].append(time.perf_counter() - started)
                    assert all(f is not None for f in found)
            for name, seconds in times.items():
                median = statistics.median(seconds)
                rows.append({"part": "read", "tier": name, "chunks": chunks, "tokens": chunks * CHUNK, "bytes": nbytes,
                             "median_s": median, "mb_per_s": nbytes / median / 1e6, "repeats": repeats})
        s3.close()
        lmdb.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows


def ttft_rows(server: S3Server, cases_per_length: int) -> list[dict]:
    work = Path(tempfile.mkdtemp(prefix="scaleout-ttft-"))
    bucket = server.bucket("ttft") + "/corpus"
    options = RequestOptions(max_new_tokens=24)
    records = []
    try:
        config = EngineConfig(store_path=work / "writer", shared_store=bucket, aux=None)
        writer = Engine.from_config(config)
        lm = writer.primary
        for length in (2048, 4096):
            for seed in tqdm(range(cases_per_length), desc=f"ttft {length}"):
                c = case("topical", WORDS_FOR[length], 1000 + seed)  # not the families' reported seeds
                row: dict = {"length": length, "seed": seed, "conditions": {}}

                def ask(engine: Engine, name: str, method: str = "cacheclip") -> None:
                    answer = engine.generate(c.question, c.chunks, replace(options, method=method))
                    row["conditions"][name] = {"ttft_s": answer.timings.ttft_s, "output": answer.text,
                                               "right": strict_score(answer.text, c)}

                nothing = Engine(primary=lm, store=open_store(work / f"none-{length}-{seed}"), config=config)
                ask(nothing, "full", "full")
                ask(nothing, "miss")
                writer.ingest(list(c.chunks), progress=False)  # into the bucket (and the writer's local tier)
                replica = Engine(primary=lm, store=open_store(work / f"replica-{length}-{seed}", bucket), config=config)
                ask(replica, "cold")
                ask(replica, "hot")
                row["cold_tier_hits"] = replica.store.remote_hits
                full = row["conditions"]["full"]["output"]
                for cond in row["conditions"].values():
                    cond["equal_full"] = cond["output"] == full
                records.append(row)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for length in (2048, 4096):
        mine = [r for r in records if r["length"] == length]
        for name in ("full", "miss", "cold", "hot"):
            got = [r["conditions"][name] for r in mine]
            right = sum(g["right"] for g in got)
            rows.append({"part": "ttft", "length": length, "condition": name, "n": len(got),
                         "median_ttft_s": statistics.median(g["ttft_s"] for g in got),
                         "right": right, "right_ci": asdict(wilson_interval(right, len(got))),
                         "equal_full": sum(g["equal_full"] for g in got)})
    return rows + [{"part": "ttft_requests", "records": records}]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("read", "ttft"), required=True)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--json", default="bench/results/scaleout.json")
    args = parser.parse_args()
    server = S3Server()
    try:
        with server.environment():
            rows = read_rows(server, args.repeats) if args.part == "read" else ttft_rows(server, args.cases)
    finally:
        server.stop()
    for row in rows:
        if row["part"] == "read":
            print(f"{row['tier']:>11} {row['chunks']:>2} chunks ({row['bytes'] / 1e6:.0f} MB): "
                  f"{row['median_s'] * 1e3:8.1f} ms  {row['mb_per_s']:8.0f} MB/s")
        elif row["part"] == "ttft":
            print(f"{row['length']} {row['condition']:>5}: n={row['n']} median TTFT {row['median_ttft_s']:.2f} s, "
                  f"right {row['right']}/{row['n']}, equal to full {row['equal_full']}/{row['n']}")
    out = Path(args.json)
    results = json.loads(out.read_text()) if out.exists() else {}
    results[f"cold_{args.part}"] = {"date": datetime.date.today().isoformat(), "machine": _machine(), "rows": rows}
    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def _machine() -> str:
    import os
    import platform

    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"


if __name__ == "__main__":
    raise SystemExit(main())
