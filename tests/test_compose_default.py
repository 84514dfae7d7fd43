"""bench/compose_default.py: the default's rows over a run are the spread run's on the flagged samples and the
question selection's (renamed) on the others; a flagged sample the spread run lacks is refused."""

import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_evaluation import record

spec = importlib.util.spec_from_file_location("compose_default", Path(__file__).parents[1] / "bench" / "compose_default.py")
compose_default = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compose_default)


def test_flagged_samples_come_from_the_spread_run_and_the_rest_from_the_question_selection():
    base = [record(s, v, r, k) for s in range(4) for v, r, k in (("full", None, 0.0), ("shared_prefix", None, 0.4),
                                                                  ("cacheclip_requery", 0.2, 0.1))]
    spread = [record(s, "full", None, 0.0) for s in (1, 3)] + [record(s, "cacheclip_spread", 0.2, 0.05, score=0.5)
                                                               for s in (1, 3)]
    records, counts = compose_default.compose(base, spread, lambda task, length, seed: seed in (1, 3))
    mine = {r.seed: r for r in records if r.variant == "cacheclip_spread"}
    assert counts == {"spread run": 2, "base run": 2} and sorted(mine) == [0, 1, 2, 3]
    assert mine[1].tf_kl == mine[3].tf_kl == 0.05 and mine[1].score == 0.5
    assert mine[0] == replace(next(r for r in base if r.seed == 0 and r.variant == "cacheclip_requery"),
                              variant="cacheclip_spread")
    assert sum(r.variant == "full" for r in records) == 4  # the spread run's full rows agree and are kept once
    with pytest.raises(ValueError, match="seed 2 .* flagged"):
        compose_default.compose(base, spread, lambda task, length, seed: seed in (1, 2))
    sweep = [record(s, "full", None, 0.0) for s in (1, 3)] + [record(s, "cacheclip_requery", r, 0.07) for s in (1, 3)
                                                              for r in (0.3, 0.5)]
    records, _ = compose_default.compose(base, sweep, lambda task, length, seed: seed in (1, 3), from_ratio=0.5)
    mine = {r.seed: r for r in records if r.variant == "cacheclip_spread"}
    assert mine[1].ratio == 0.2 and mine[1].recomputed_share == 0.5 and mine[0].recomputed_share == 0.2
    with pytest.raises(ValueError, match="disagree"):  # a spread run of other samples or models
        compose_default.compose(base, [replace(spread[0], score=0.0)] + spread[1:], lambda *a: False)
