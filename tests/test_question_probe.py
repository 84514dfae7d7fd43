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


def test_the_probe_vetoes_a_flagged_request_to_its_unescalated_row_and_confirms_the_rest(tmp_path):
    def row(seed, question, escalated, words_right, base_right, words_s, base_s):
        return {"case": {"family": "topical", "question": question, "seed": seed}, "length": 2048,
                "rows": {"full": {"right": True, "ttft_s": 9.0},
                         "default": {"right": words_right, "ttft_s": words_s, "ratio": 0.5 if escalated else 0.2},
                         "no_spread": {"right": base_right, "ttft_s": base_s}}}
    rows = [row(0, "which trains ran?", True, True, False, 3.0, 1.0),  # flagged, confirmed: the words' row
            row(1, "where is the shed?", True, False, True, 3.0, 1.0),  # flagged, vetoed: the row without the budget
            row(2, "when did it open?", False, True, True, 1.0, 1.0)]  # not flagged: the probe never runs
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    scores = {"which trains ran?": 0.7, "where is the shed?": -0.4, "when did it open?": 0.9}
    (cell,) = question_probe.confirmed([], scores, [path], "qwen2.5-coder-0.5b", probe_s=0.5)
    assert (cell["words_kept"], cell["confirmed_kept"]) == (2, 3)
    assert (cell["words_escalated"], cell["confirmed_escalated"]) == (2, 1)
    assert (cell["median_ttft_words_s"], cell["median_ttft_confirmed_s"]) == (3.0, 1.5)  # 3.5, 1.5, 1.0
    # rows that name no primary are the 0.5B's: another primary's probe is not composed with them
    assert question_probe.confirmed([], scores, [path], "qwen2.5-coder-1.5b", probe_s=0.5) == []


def test_flags_count_what_the_words_flag_and_the_probe_then_confirms_and_no_other_models_runs_are_composed():
    from cacheclip_rag.evaluation.deployed import cases

    scores = {c.question: 1.0 if family == "values" else -1.0 for family, words in question_probe.deployed_cells()
              for c in cases(family, words, 12)}
    table = {(r["family"], r["words"]): r for r in question_probe.flags([], scores, n=12)}
    assert table[("values", 1500)]["confirmed"] == table[("values", 1500)]["words_flagged"] > 0
    assert table[("topical", 1500)]["words_flagged"] > 0 == table[("topical", 1500)]["confirmed"]
    assert all(r["confirmed"] == 0 for (family, _), r in table.items() if family != "values")
    # the deployed-format RULER runs answered with the 0.5B: a 1.5B probe's scores are not composed with them
    items = [("run/eval-deployed-2k/single1", "What is the number?", False)]
    assert question_probe.confirmed(items, {"What is the number?": 1.0}, [], "qwen2.5-coder-1.5b", 0.1) == []
