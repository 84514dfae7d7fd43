"""The server's costs under hostile input: recognition CPU for ordinary and crafted prompts, and /health
latency while 7 MiB prompts arrive (refused by size, and, with the size limit lifted, tokenized off the
event loop). One table; JSON with --json.

    python bench/bench_hostile.py --json bench/results/hostile.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import string
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cacheclip_rag.engine.recognize import ChunkIndex  # noqa: E402


def cpu(fn, repeats: int = 1) -> float:
    """Median CPU seconds of `fn` (process time: what the server's cores spend)."""
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return statistics.median(times)


def recognition_rows() -> list[dict]:
    rng = random.Random(0)
    rows = []
    chunks = [" ".join("".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9)))
                       for _ in range(rng.randint(40, 200))) for _ in range(100_000)]
    index = ChunkIndex(chunks)
    for count in (4, 16):
        prompt = "Answer from the context.\n\n" + "\n\n".join(chunks[i] for i in rng.sample(range(len(chunks)), count))
        prompt += "\n\nQuestion: which one?"
        seconds = cpu(lambda: index.find(prompt), 20)
        rows.append({"case": f"ordinary prompt, {count} of 10^5 stored chunks", "prompt_chars": len(prompt),
                     "cpu_s": seconds, "work_per_char": index.last_work / len(prompt), "found": len(index.find(prompt))})
    crafted = ChunkIndex(["=" * 60 + f" chunk {i} " + "=" * (40 + i) for i in range(21)])
    for size in (128 << 10, 1 << 20, 8 << 20):
        prompt = "=" * size
        seconds = cpu(lambda: crafted.find(prompt))
        rows.append({"case": f"'=' x {size >> 10} KiB, 21 stored chunks sharing its start", "prompt_chars": size,
                     "cpu_s": seconds, "work_per_char": crafted.last_work / size, "found": 0})
    return rows


def health_rows() -> list[dict]:
    import uvicorn

    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.serve import ServerSettings, create_app, uvicorn_config
    from cacheclip_rag.store import LMDBStore
    from cacheclip_rag.testing import tiny_model

    rows = []
    for label, limit, count in (("refused by size before tokenizing (default limit)", None, 30),
                                ("size limit lifted: tokenized off the event loop", 64 << 20, 3)):
        path = Path(tempfile.mkdtemp())
        engine = Engine(primary=tiny_model("llama"), store=LMDBStore(path), config=EngineConfig(store_path=path))
        settings = ServerSettings(max_prompt_chars=limit)
        app = create_app(engine, settings)
        server = uvicorn.Server(uvicorn_config(app, settings, "127.0.0.1", 8399, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        huge = {"model": "cacheclip", "messages": [{"role": "user", "content": "word " * ((7 << 20) // 5)}]}
        busy = threading.Event()

        def flood():
            with httpx.Client(timeout=600) as client:
                for _ in range(count):
                    client.post("http://127.0.0.1:8399/v1/chat/completions", json=huge)
            busy.set()

        sender = threading.Thread(target=flood)
        sender.start()
        latencies = []
        with httpx.Client(timeout=60) as client:
            while not busy.is_set():
                start = time.perf_counter()
                client.get("http://127.0.0.1:8399/health")
                latencies.append(time.perf_counter() - start)
                time.sleep(0.01)
        sender.join()
        server.should_exit = True
        thread.join(timeout=30)
        latencies.sort()
        rows.append({"case": f"/health during {count} prompts of 7 MiB: {label}", "n": len(latencies),
                     "p50_ms": 1000 * latencies[len(latencies) // 2],
                     "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
                     "max_ms": 1000 * latencies[-1]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    recognition, health = recognition_rows(), health_rows()
    print(f"{'recognition case':<58} {'chars':>9} {'CPU s':>8} {'work/char':>9}")
    for row in recognition:
        print(f"{row['case']:<58} {row['prompt_chars']:>9} {row['cpu_s']:>8.4f} {row['work_per_char']:>9.1f}")
    print(f"\n{'health case':<80} {'n':>5} {'p50 ms':>7} {'p99 ms':>7} {'max ms':>7}")
    for row in health:
        print(f"{row['case']:<80} {row['n']:>5} {row['p50_ms']:>7.1f} {row['p99_ms']:>7.1f} {row['max_ms']:>7.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"recognition": recognition, "health": health}, indent=2) + "\n")


if __name__ == "__main__":
    main()
