"""bench/bench_deployed.py's signal report: the chunk-mass shape the escalation signals read, and `separation`
scoring only the signals a run recorded (an older run without the first-token signals still reports the mass)."""

import importlib.util
import json
import math
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # bench_deployed imports its sibling `common`
spec = importlib.util.spec_from_file_location("bench_deployed", BENCH / "bench_deployed.py")
bench_deployed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_deployed)


def test_mass_shape_leaves_the_exact_first_chunk_out_and_sorts_the_shares():
    assert bench_deployed.mass_shape([0.5, 0.1, 0.3, 0.1]) == [0.6, 0.2, 0.2]
    assert math.isclose(bench_deployed.entropy([1 / 3] * 3), 1.0)
    assert bench_deployed.entropy([1.0, 0.0, 0.0]) == 0.0 and bench_deployed.entropy([1.0]) == 0.0


def row(seed: int, shares: list[float], full: bool, base: bool, half: bool) -> dict:
    return {"case": {"family": "link", "seed": seed}, "length": 2048,
            "rows": {"full": {"right": full}, "base_0.2": {"right": base}, "ratio_0.5": {"right": half}},
            "signals": {"shares": shares}}


def test_separation_scores_the_mass_signals_of_a_run_without_first_token_signals(tmp_path):
    # ratio 0.5 helps seeds 0 and 1 (mass spread over chunks); seeds 2-3 are right either way (one chunk holds it)
    rows = [row(0, [0.1, 0.45, 0.45], True, False, True), row(1, [0.1, 0.5, 0.4], True, False, True),
            row(2, [0.1, 0.9, 0.0], True, True, True), row(3, [0.0, 0.05, 0.95], True, True, True)]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = {r["signal"]: r for r in bench_deployed.separation(path)}
    assert set(table) == {name for name in bench_deployed.SCORES if name.startswith("chunk mass")}
    top = table["chunk mass: 1 - top chunk's share"]
    assert (top["helped"], top["rest"], top["auc"], top["rest_flagged_catching_all"]) == (2, 2, 1.0, 0)
