"""bench/quality_multichunk.py: retention counts only the samples where full lists every value, strictly (an
answer missing one value is a loss whatever its partial credit), and pairs each method with the default."""

import importlib.util
import json
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("quality_multichunk",
                                              Path(__file__).parents[1] / "bench" / "quality_multichunk.py")
quality_multichunk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(quality_multichunk)


def record(variant: str, seed: int, score: float, *, ratio: float | None = 0.2, tf_kl: float = 0.0,
           ttft: float = 1.0) -> dict:
    return {"task": "spread3", "length": 2048, "seed": seed, "variant": variant, "ratio": ratio, "score": score,
            "tf_kl": tf_kl, "ttft_s": ttft}


def samples() -> list[list[dict]]:
    # full complete on seeds 0-2, incomplete on 3 (not counted); the default keeps 0 and 1 and loses 2 with
    # partial credit 2/3; "other" keeps 2 only
    full = [1.0, 1.0, 1.0, 2 / 3]
    default = [1.0, 1.0, 2 / 3, 1.0]
    other = [1 / 3, 2 / 3, 1.0, 1.0]
    return [[record("full", s, full[s], ratio=None, ttft=4.0),
             record("cacheclip_spread", s, default[s], tf_kl=0.1 * s, ttft=1.0),
             record("other", s, other[s], ttft=2.0)] for s in range(4)]


def test_strict_retention_counts_full_complete_samples_and_pairs_against_the_default(tmp_path):
    rows = {r["method"]: r for r in quality_multichunk.table(samples())}
    default, other = rows["cacheclip_spread"], rows["other"]
    assert default["n"] == 3 and default["samples"] == 4
    assert default["strict_retention"]["kept"] == 2 and abs(default["strict_retention"]["mean"] - 2 / 3) < 1e-12
    assert abs(default["partial_retention"]["mean"] - (1 + 1 + 2 / 3) / 3) < 1e-12
    assert abs(default["tf_kl"]["mean"] - 0.15) < 1e-12 and default["ttft_speedup"] == 4.0
    assert "paired_vs_default" not in default and "paired_vs_before" not in default  # no before-run here
    assert default["default"] and not other["default"]
    assert other["strict_retention"]["kept"] == 1
    assert other["paired_vs_default"] == {"n": 3, "wins": 1, "losses": 2, "sign_p": 1.0}
    run = tmp_path / "run"
    run.mkdir()
    (run / "records.jsonl").write_text("".join(json.dumps(s) + "\n" for s in samples()))
    assert quality_multichunk.table(quality_multichunk.load([run])) == quality_multichunk.table(samples())
    assert "| 2048 | other | 0.2 | 3 | 1 = 0.33" in quality_multichunk.markdown(list(rows.values()))
    # with the default before the spread budget in the same samples, the default's row is paired against it
    before = [records + [dict(records[1], variant="cacheclip_requery", score=float(s == 0))]
              for s, records in enumerate(samples())]
    rows = {r["method"]: r for r in quality_multichunk.table(before)}
    assert rows["cacheclip_spread"]["paired_vs_before"] == {"n": 3, "wins": 1, "losses": 0, "sign_p": 1.0}
    assert rows["cacheclip_requery"]["paired_vs_default"] == {"n": 3, "wins": 0, "losses": 1, "sign_p": 1.0}


def test_backfill_ranks_a_peaks_preceding_rows_with_it_and_around_marks_each_side():
    import torch

    spec = importlib.util.spec_from_file_location("multichunk_candidates",
                                                  Path(__file__).parents[1] / "bench" / "multichunk_candidates.py")
    candidates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(candidates)
    score = torch.tensor([0.1, 0.0, 0.0, 0.0, 0.9, 0.0, 0.0, 0.0])
    key = candidates.backfilled(score, reach=2, before=1)
    # rows 2-3 (up to 2 before the peak) and row 5 (1 after it) take the peak's rank; the peak stays first
    assert key.argmax() == 4 and set(torch.nonzero(key > 0.5).flatten().tolist()) == {2, 3, 4, 5}
    assert key[0] > key[1] > 0.0 and key[6] == 0.0
    values = [torch.tensor([False, False, True, True, False])]
    assert candidates.around(values, "preceding")[0].tolist() == [True, True, True, True, False]
    assert candidates.around(values, "following")[0].tolist() == [False, False, True, True, True]
    assert not candidates.around([torch.zeros(3, dtype=torch.bool)], "preceding")[0].any()


def test_a_remedy_condition_is_parsed_or_refused_by_name():
    spec = importlib.util.spec_from_file_location("multichunk_candidates",
                                                  Path(__file__).parents[1] / "bench" / "multichunk_candidates.py")
    candidates = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(candidates)
    assert candidates.parse_condition("ratio_0.5@lower") == ("ratio", 0.5, "lower")
    assert candidates.parse_condition("backfill_32") == ("backfill", 32.0, "")
    assert candidates.parse_condition("preceding") == ("preceding", None, "")
    for bad in ("ratio", "ratio_x", "backfill_32@lower", "ratio_0.5@middle", "preceding_3", "chunks_0.5"):
        with pytest.raises(ValueError, match="unknown condition"):
            candidates.parse_condition(bad)
