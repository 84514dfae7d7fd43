"""bench/ratio_sweep.py: each ratio's retention and KL share over the samples every ratio finished, and its paired
difference from the reference ratio; a sweep without the reference ratio, or with no sample in common, is refused."""

import importlib.util
from pathlib import Path

import pytest

from tests.test_evaluation import record

spec = importlib.util.spec_from_file_location("ratio_sweep", Path(__file__).parents[1] / "bench" / "ratio_sweep.py")
ratio_sweep = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ratio_sweep)


def test_each_ratio_is_judged_on_the_samples_every_ratio_finished():
    rows = [record(s, "full", None, 0.0) for s in range(6)] + [record(s, "shared_prefix", None, 0.4) for s in range(6)]
    rows += [record(s, "cacheclip_requery", 0.2, 0.1) for s in range(6)]
    rows += [record(s, "cacheclip_requery", 0.1, 0.1, score=float(s % 2)) for s in range(6)]  # wrong on 3 of 6
    rows += [record(s, "cacheclip_requery", 0.3, 0.05) for s in range(5)]  # sample 5 unfinished at 0.3
    out = {row["ratio"]: row for row in ratio_sweep.sweep(rows, "cacheclip_requery", 0.2)}
    assert sorted(out) == [0.1, 0.2, 0.3] and all(row["n"] == 5 for row in out.values())
    assert out[0.2]["retention"]["mean"] == 1.0 and out[0.2]["tf_kl_share"]["mean"] == pytest.approx(0.25)
    assert out[0.1]["retention"]["mean"] == pytest.approx(2 / 5)  # samples 1 and 3 right of 0..4
    assert (out[0.1]["up"], out[0.1]["down"]) == (0, 3)
    assert out[0.1]["score_minus_reference"]["mean"] == pytest.approx(-3 / 5)
    assert out[0.3]["tf_kl_minus_reference"]["mean"] == pytest.approx(-0.05)
    assert out[0.3]["tf_kl_share"]["mean"] == pytest.approx(0.125)
    with pytest.raises(ValueError, match="reference ratio 0.5"):
        ratio_sweep.sweep(rows, "cacheclip_requery", 0.5)
    with pytest.raises(ValueError, match="no sample"):
        ratio_sweep.sweep([r for r in rows if r.variant != "shared_prefix"], "cacheclip_requery", 0.2)
