"""What a refusal costs the server (issue 71): `cacheclip serve` on the default primary in its own process,
and for each kind of oversized or malformed request, the server process's CPU time (user + system, read
from the OS before and after each request) over `--repeats` requests, beside an accepted one-token
request for scale. The goal: every size refusal costs < 0.1 s of server CPU (decided before tokenizing or
model work, or, for the one bound only tokens can tell (a system text within the character limit whose tokens
overflow the context), right after tokenizing, before any model work). CPU time is read in the OS's clock
ticks (10 ms here). One table; JSON with --json.

    python bench/bench_refusals.py --json bench/results/refusals.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-bench-refusals-" + "k" * 12
GOAL_S = 0.1


def cases(context_chars: int) -> list[tuple[str, str, dict | bytes, int]]:
    """(label, route, body, expected status). Bodies sized at and past the server's defaults."""
    rng = random.Random(0)
    # CJK extension B: ~3 tokens a character, so 16,384 of them (the character limit) overflow a 32K context
    rare = "".join(chr(rng.randint(0x20000, 0x2A6DF)) for _ in range(16384))
    chat = {"model": "cacheclip", "max_tokens": 1, "messages": [{"role": "user", "content": "Which code?"}]}
    deep = b"[" * 200_000 + b"]" * 200_000
    return [
        ("accepted: a one-token chat (for scale)", "/v1/chat/completions", chat, 200),
        ("body over 8 MiB (declared length)", "/v1/chat/completions", b"x" * ((8 << 20) + 1), 413),
        ("prompt over the character limit", "/v1/chat/completions",
         {**chat, "messages": [{"role": "user", "content": "a " * (context_chars // 2 + 1)}]}, 400),
        ("max_tokens past the context", "/v1/chat/completions", {**chat, "max_tokens": 10 ** 7}, 400),
        ("malformed JSON", "/v1/chat/completions", b'{"model": "cacheclip", "messages": [', 400),
        ("JSON nested 200,000 deep", "/v1/chat/completions", deep, 400),
        ("ingest: 257 documents", "/v1/ingest", {"documents": ["a short text"] * 257}, 413),
        ("ingest: a document over 65,536 characters", "/v1/ingest", {"documents": ["b" * 65537]}, 413),
        ("ingest: system over 16,384 characters", "/v1/ingest", {"documents": ["a text"], "system": "c" * 16385}, 413),
        ("ingest: system at the limit, past the context", "/v1/ingest", {"documents": ["a text"], "system": rare}, 400),
        ("delete: 4,097 ids", "/v1/documents/delete", {"ids": [str(i) for i in range(4097)]}, 413),
        ("a wrong API key", "/v1/chat/completions", chat, 401),
    ]


def start_server(port: int, keys: Path, primary: str | None) -> subprocess.Popen:
    args = [sys.executable, "-m", "cacheclip_rag.cli", "serve", "--port", str(port), "--keys", str(keys),
            "--aux", "none", "--store", str(keys.parent / "store")]
    if primary:
        args += ["--primary", primary]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server did not start")


def measure(url: str, server: psutil.Process, route: str, body, key: str, repeats: int) -> tuple[list[float], set[int]]:
    spent, statuses = [], set()
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    with httpx.Client(timeout=600) as http:
        for _ in range(repeats):
            time.sleep(0.05)  # let the last response's teardown finish before reading the clock
            before = sum(server.cpu_times()[:2])
            try:
                statuses.add(http.post(url + route, content=content, headers=headers).status_code)
            except httpx.HTTPError:  # a server that answers and closes while the body is still being sent
                statuses.add(413)
            time.sleep(0.05)
            spent.append(sum(server.cpu_times()[:2]) - before)
    return spent, statuses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--primary", default=None, help="default: the engine's default primary")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys.json"
        keys.write_text(json.dumps({KEY: {"tenant": "bench", "roles": ["ingest"]}}))
        port = 18000 + os.getpid() % 1000
        proc = start_server(port, keys, args.primary)
        url, server = f"http://127.0.0.1:{port}", psutil.Process(proc.pid)
        models = httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]
        rows = []
        try:
            idle_before = sum(server.cpu_times()[:2])
            time.sleep(2.0)
            idle = (sum(server.cpu_times()[:2]) - idle_before) / 2.0 * 0.1  # what 0.1 s of waiting costs
            for label, route, body, expected in cases(16 * models["context_window"]):
                key = KEY if "wrong API key" not in label else "sk-not-a-key-" + "z" * 12
                spent, statuses = measure(url, server, route, body, key, args.repeats)
                rows.append({"case": label, "route": route, "status": sorted(statuses), "expected": expected,
                             "n": len(spent), "cpu_s_median": statistics.median(spent), "cpu_s_max": max(spent),
                             "goal_met": expected == 200 or max(spent) < GOAL_S})
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"server: {models['primary']}, context {models['context_window']} tokens; idle CPU per 0.1 s: {idle:.4f} s")
    print(f"{'case':<48} {'status':>10} {'n':>3} {'CPU median':>11} {'CPU max':>9}  < {GOAL_S} s")
    for r in rows:
        print(f"{r['case']:<48} {','.join(map(str, r['status'])):>10} {r['n']:>3} {r['cpu_s_median']:>10.4f}s "
              f"{r['cpu_s_max']:>8.4f}s  {'yes' if r['goal_met'] else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps({"primary": models["primary"], "context_window": models["context_window"],
                                               "idle_cpu_per_100ms": idle, "goal_s": GOAL_S, "rows": rows}, indent=1))
    return 0 if all(r["goal_met"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
