"""bench/question_probe.py's composition of routing: a flagged request takes full's answer and time, the rest
the default's; only the asked primary's rows count."""

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).parents[1] / "bench"
sys.path.insert(0, str(BENCH))
spec = importlib.util.spec_from_file_location("question_probe", BENCH / "question_probe.py")
question_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(question_probe)


def request(question: str, full: bool, default: bool, full_s: float, default_s: float, primary: str = "qwen2.5-coder-0.5b") -> dict:
    return {"case": {"family": "compare", "question": question}, "length": 2048, "primary": primary,
            "rows": {"full": {"right": full, "ttft_s": full_s}, "default": {"right": default, "ttft_s": default_s, "ratio": 0.2}}}


def test_a_flagged_request_takes_fulls_answer_and_time_the_rest_the_defaults(tmp_path):
    rows = [request("which is longest?", True, False, 4.0, 1.0), request("when did it open?", True, False, 4.0, 1.0),
            request("which is oldest?", False, False, 5.0, 2.0), request("which is longest?", True, True, 9.0, 9.0, "other")]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scores = {"which is longest?": 1.5, "when did it open?": -2.0, "which is oldest?": 0.3}
    (row,) = question_probe.routed(path, scores, "qwen2.5-coder-0.5b")
    assert (row["cases"], row["full_right"], row["default_kept"], row["routed_kept"], row["routed_to_full"]) == (3, 2, 0, 1, 2)
    assert (row["median_ttft_default_s"], row["median_ttft_routed_s"]) == (1.0, 4.0)
