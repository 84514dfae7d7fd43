"""The evaluation harness: RULER generator and scorer, fidelity metrics, alignment metrics, runner."""

import importlib.util
import json
import math
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.evaluation import report, ruler, runner
from cacheclip_rag.evaluation.alignment import _spread, char_attention, compare
from cacheclip_rag.evaluation.fidelity import (first_token_kl, greedy_agreement, sequence_log_likelihood,
                                               teacher_forced_fidelity)
from cacheclip_rag.testing import tiny_model
from tests.conftest import has_embedded_models


def words(text: str) -> int:
    """A stand-in tokenizer for the generator tests: whitespace words."""
    return len(text.split())


@pytest.mark.parametrize("task", ruler.TASKS)
def test_sample_holds_its_needles_and_right_references(task):
    sample = ruler.generate(task, 600, seed=3, count_tokens=words)
    context = sample.context
    for needle in sample.needles:
        assert context.count(needle.sentence) == 1
        assert needle.sentence == ruler.needle_sentence(needle.key, needle.value, ruler.SPECS[task].value_kind)
    values = [n.value for n in sample.needles]
    assert len(values) == len(set(values))
    asked = [n.key for n in sample.needles if n.key in sample.question]
    assert sorted(sample.references) == sorted(n.value for n in sample.needles if n.key in asked)
    spec = ruler.SPECS[task]
    assert len(sample.references) == spec.queries * spec.values_per_key
    assert len({n.key for n in sample.needles if n.value in sample.references}) == spec.queries
    # the value each reference belongs to follows its key in the text, as RULER states it
    for ref in sample.references:
        assert re.search(rf"for \S+ is: {re.escape(ref)}\.", context)
    assert 0.9 * 600 <= words(context) <= 600 + 40


@pytest.mark.parametrize("task", ruler.TASKS)
def test_same_seed_same_sample_other_seed_other_sample(task):
    a = ruler.generate(task, 400, seed=7, count_tokens=words)
    assert a == ruler.generate(task, 400, seed=7, count_tokens=words)
    assert a.references != ruler.generate(task, 400, seed=8, count_tokens=words).references


def test_distractor_tasks_have_distractors():
    multikey1 = ruler.generate("multikey1", 500, 0, words)
    assert len(multikey1.needles) == 4 and len(multikey1.references) == 1
    multikey2 = ruler.generate("multikey2", 500, 0, words)
    assert len(multikey2.needles) > 20  # the haystack is needles
    assert all(s.startswith("One of the special magic") for s in multikey2.sentences)
    multikey3 = ruler.generate("multikey3", 500, 0, words)
    uuid_pattern = r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$"
    assert all(re.match(uuid_pattern, n.key) and re.match(uuid_pattern, n.value) for n in multikey3.needles)


def test_unknown_task_and_tiny_length_are_refused():
    with pytest.raises(ValueError, match="unknown RULER task"):
        ruler.generate("single9", 500, 0, words)
    with pytest.raises(ValueError, match="target_tokens"):
        ruler.generate("single1", 10, 0, words)


@pytest.mark.parametrize("task", ["single2", "multikey3", "multiquery"])
def test_chunks_keep_needles_whole(task):
    sample = ruler.generate(task, 1500, seed=1, count_tokens=words)
    chunks = ruler.chunk_sentences(sample.sentences, words, 120, 12)
    for needle in sample.needles:
        assert any(needle.sentence in c for c in chunks)


def test_chunks_are_runs_of_whole_sentences_that_overlap_a_little():
    rng = __import__("random").Random(0)
    sentences = [" ".join([f"s{i}"] * rng.randint(2, 30)) for i in range(80)]
    chunks = ruler.chunk_sentences(sentences, words, 60, 10)
    runs = []
    for chunk in chunks:
        ids = sorted({int(w[1:]) for w in chunk.split()})
        assert chunk == " ".join(sentences[ids[0] : ids[-1] + 1])  # contiguous, whole sentences
        assert len(ids) == 1 or words(chunk) + len(ids) <= 60  # only a lone sentence may exceed the size
        runs.append((ids[0], ids[-1]))
    assert runs[0][0] == 0 and runs[-1][1] == 79
    for (a0, a1), (b0, b1) in zip(runs, runs[1:]):
        assert a0 < b0 <= a1 + 1  # moves forward, nothing skipped
        assert sum(words(sentences[i]) + 1 for i in range(b0, a1 + 1)) <= 10  # overlap within budget
    assert ruler.chunk_sizes(16384) == (1000, 50)
    assert ruler.chunk_sizes(2048) == (256, 12)


def test_score_counts_references_found():
    assert ruler.score(" 1234567.", ["1234567"]) == 1.0
    assert ruler.score("The number is 7654321", ["1234567"]) == 0.0
    assert ruler.score("1111111, 2222222 and then 3333333", ["1111111", "2222222", "3333333", "4444444"]) == 0.75
    assert ruler.score("ABCD-ef", ["abcd-EF"]) == 1.0  # case-insensitive, as RULER
    with pytest.raises(ValueError, match="reference"):
        ruler.score("x", [])


def test_first_token_kl():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert first_token_kl(logits, logits) == pytest.approx(0.0, abs=1e-12)
    assert first_token_kl(logits, logits + 3.0) == pytest.approx(0.0, abs=1e-9)  # shift-invariant
    other = torch.randn(50, generator=torch.Generator().manual_seed(1))
    p, q = torch.softmax(logits.double(), 0), torch.softmax(other.double(), 0)
    assert first_token_kl(logits, other) == pytest.approx(float((p * (p / q).log()).sum()), rel=1e-9)
    with pytest.raises(ValueError, match="shapes"):
        first_token_kl(logits, logits[:10])


def test_greedy_agreement():
    assert greedy_agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert greedy_agreement([1, 2, 3, 4], [1, 9, 3, 4]) == 0.75
    assert greedy_agreement([1, 2, 3, 4], [1, 2]) == 0.5  # stopping early is a mismatch
    assert greedy_agreement(list(range(40)), list(range(32)) + [0] * 8) == 1.0  # only the first 32 count
    assert greedy_agreement([], []) == 1.0


def test_teacher_forced_fidelity_and_gold_likelihood():
    torch.manual_seed(0)
    full = torch.randn(5, 11)
    tokens = [int(t) for t in full.argmax(-1)]
    assert teacher_forced_fidelity(full, full.clone(), tokens) == (0.0, 1.0)
    other = full.clone()
    other[2] = torch.randn(11)
    other[2, tokens[2]] = -10.0  # the method no longer picks full's token at step 2
    kl, top1 = teacher_forced_fidelity(full, other, tokens)
    assert top1 == 0.8
    assert math.isclose(kl, first_token_kl(full[2], other[2]) / 5, rel_tol=1e-9)
    probs = torch.softmax(full.double(), -1)
    expected = sum(math.log(probs[i, t]) for i, t in enumerate(tokens))
    assert math.isclose(sequence_log_likelihood(full, tokens), expected, rel_tol=1e-9)
    with pytest.raises(ValueError):
        teacher_forced_fidelity(full, other[:4], tokens)


def test_alignment_metrics():
    x = torch.rand(200, generator=torch.Generator().manual_seed(0))
    same = compare(x, x.clone())
    assert same["jaccard"] == 1.0 and same["kl"] == pytest.approx(0.0, abs=1e-9)
    assert same["pearson"] == pytest.approx(1.0) and same["spearman"] == pytest.approx(1.0)
    reverse = compare(x, -x + 2)
    assert reverse["spearman"] == pytest.approx(-1.0) and reverse["jaccard"] == 0.0
    with pytest.raises(ValueError, match="different texts"):
        compare(x, x[:10])


def test_spread_keeps_each_token_mass_on_its_characters():
    offsets = [(0, 3), (4, 9), (9, 10)]  # "abc defgh!": the space belongs to the second token
    chars = _spread(torch.tensor([0.3, 0.5, 0.2]), offsets, 10)
    assert chars.sum().item() == pytest.approx(1.0)
    assert chars[:4].sum().item() == pytest.approx(0.3)
    assert chars[9].item() == pytest.approx(0.2)


def test_char_attention_is_the_same_map_for_the_same_model():
    lm = tiny_model("llama")
    texts = ["alpha beta gamma delta. " * 3, "epsilon zeta eta. " * 2]
    maps = char_attention(lm, "Be brief.", texts, "what is zeta?", layers=(0, 1))
    assert set(maps) == {0, 1}
    for chars in maps.values():
        assert chars.numel() == sum(len(t) for t in texts)
        assert (chars >= 0).all() and 0 < chars.sum() < 1  # the prefix and question hold the rest
    again = char_attention(lm, "Be brief.", texts, "what is zeta?", layers=(0, 1))
    assert compare(maps[1], again[1])["jaccard"] == 1.0


def test_runner_ratio_one_reproduces_full_and_report_is_written(make_engine, tmp_path):
    lm = tiny_model("qwen2")
    engine = make_engine(lm)
    profile = replace(
        runner.PROFILES["quick"], lengths=(160,), tasks=("single1", "multiquery"), ratios=(1.0,),
        variants=("full", "shared_prefix", "ape", "cacheclip", "cacheblend", "cacheclip_nogroup"), max_new_tokens=6,
    )
    records = runner.run(engine, profile, progress=False)
    by = {(r.task, r.variant): r for r in records}
    assert len(records) == 2 * 6
    for task in profile.tasks:
        full = by[(task, "full")]
        assert full.kl == 0.0 and full.tf_kl == 0.0 and full.tf_top1 == 1.0 and full.gold_ll_delta == 0.0
        assert full.gold_ll < 0
        for variant in ("cacheclip", "cacheblend", "cacheclip_nogroup"):  # ratio 1: everything recomputed
            r = by[(task, variant)]
            assert r.kl < 1e-6 and r.tf_kl < 1e-6 and r.tf_top1 == 1.0 and abs(r.gold_ll_delta) < 1e-3
            assert 0.5 < r.recomputed_share <= 1.0  # cacheclip never recomputes chunk 0: it is exact already
            assert r.output == full.output
        for variant in ("shared_prefix", "ape"):  # a tiny random model still notices cross-chunk attention
            assert by[(task, variant)].tf_kl > 1e-6 and by[(task, variant)].recomputed_share == 0.0
        assert full.chunks >= 2
    rows, maps = runner.alignment_study(engine, (160,), samples=2)
    assert len(rows) == 2 * 2 and {r.pair for r in rows} == {"aux_last vs pri_last", "pri_first vs pri_last"}
    again, _ = runner.alignment_study(engine, (160,), samples=2, other_auxes={"same": engine.aux})
    by_pair = {(r.seed, r.pair): r for r in again}  # the same aux under another name: the same numbers
    for r in rows:
        assert by_pair[(r.seed, r.pair)] == r
        if r.pair == "aux_last vs pri_last":
            assert replace(by_pair[(r.seed, "same_last vs pri_last")], pair=r.pair) == r
    with pytest.raises(ValueError, match="'aux' names the engine's own aux"):
        runner.alignment_study(engine, (160,), other_auxes={"aux": engine.aux})
    paths = report.write(tmp_path / "eval", records, alignment=rows, maps=maps, meta={"profile": "test"}, headline_ratio=1.0)
    text = paths["markdown"].read_text()
    assert "| cacheclip @ 1 | 2 |" in text and "Efficiency breakdown" in text and "Jaccard" in text
    assert "Paired differences" in text and "| 160 | 1 | cacheblend | tf_kl | 2 |" in text
    for name in ("score_vs_ratio", "fidelity_vs_ratio", "paired", "tasks", "alignment"):
        assert paths[name].read_bytes()[:4] == b"\x89PNG"
    summary = runner.summary(records)
    full_row = next(r for r in summary["rows"] if r["variant"] == "full")
    assert math.isclose(full_row["speedup"], 1.0) and full_row["n"] == 2


def test_runner_resumes_and_drops_a_line_cut_short(make_engine, tmp_path):
    engine = make_engine(tiny_model("llama"))
    profile = replace(runner.PROFILES["quick"], lengths=(160,), tasks=("single1", "single2"), samples=2,
                      ratios=(0.5,), variants=("full", "cacheclip"), max_new_tokens=4)
    out = tmp_path / "run"
    first = runner.run(engine, profile, progress=False, out_dir=out, limit_s=0.0)  # stops after one sample
    assert {(r.task, r.seed) for r in first} == {("single1", 0)}
    lines = (out / runner.RECORDS_FILE).read_text().splitlines(keepends=True)
    assert len(lines) == 1
    # a run killed while appending its second sample leaves a cut line behind
    (out / runner.RECORDS_FILE).write_text(lines[0] + lines[0][: len(lines[0]) // 2])
    # a reader (a report of a folder a run may be appending to) leaves the partial line alone
    assert list(runner.load_records(out)) == [("single1", 160, 0)]
    assert (out / runner.RECORDS_FILE).read_text() == lines[0] + lines[0][: len(lines[0]) // 2]
    records = runner.run(engine, profile, progress=False, out_dir=out)
    assert sorted({(r.task, r.seed) for r in records}) == [("single1", 0), ("single1", 1), ("single2", 0), ("single2", 1)]
    stored = (out / runner.RECORDS_FILE).read_text().splitlines()
    assert len(stored) == 4 and all(json.loads(line) for line in stored)
    assert [r for r in records if (r.task, r.seed) == ("single1", 0)] == [r for r in first]
    # a third run computes nothing and returns the same records
    again = runner.run(engine, replace(profile), progress=False, out_dir=out)
    assert again == records
    with pytest.raises(ValueError, match="other profile"):
        runner.run(engine, replace(profile, ratios=(0.3,)), progress=False, out_dir=out)


def test_prepare_puts_entries_the_sample_then_reads_as_they_are(tmp_path):
    """`prepare` runs once per sample on its RULER view, before the ingest: entries it stores under the
    primary's keys (here another model's caches, as a transferred store holds) are read, not recomputed.
    `full` reads no entry, so it is unchanged; shared-prefix reuse answers from the other model's caches. The
    run's identity names the preparation: a folder refuses another."""
    import copy

    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.stages.load.ingest import SHARED, chunk_key, precompute, prefix_cache
    from cacheclip_rag.models.loading import PromptFormat
    from cacheclip_rag.store import LMDBStore

    primary, other = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    calls = []

    def prepare(view, sample, chunks):
        calls.append((sample.task, sample.seed, view.primary.prompt, list(chunks)))
        src = copy.copy(other)
        src.prompt = view.primary.prompt
        system = view.config.system_prompt
        precompute(src, view.store, chunks, system, progress=False)
        ours, theirs = prefix_cache(view.primary, view.store, system), prefix_cache(src, view.store, system)
        for text in chunks:
            entry = view.store.get(chunk_key(src, theirs.token_ids, text, SHARED), src.fingerprint.digest)
            view.store.put(chunk_key(view.primary, ours.token_ids, text, SHARED), view.primary.fingerprint.digest,
                           entry)

    def engine(name):
        config = EngineConfig(store_path=tmp_path / name, system_prompt="Be brief.", store_dtype="float32", aux=None)
        return Engine(primary=primary, store=LMDBStore(tmp_path / name), config=config, aux=None)

    profile = replace(runner.PROFILES["quick"], lengths=(160,), tasks=("single1", "single2"), samples=1,
                      variants=("full", "shared_prefix"), max_new_tokens=4)
    plain = runner.run(engine("plain"), profile, progress=False)
    out = tmp_path / "run"
    moved = runner.run(engine("moved"), profile, progress=False, out_dir=out, prepare=prepare,
                       identity={"transfer_from": other.name})
    count = runner.token_counter(engine("plain"))
    assert [(t, s) for t, s, _, _ in calls] == [("single1", 0), ("single2", 0)]
    assert all(prompt == PromptFormat.ruler() for _, _, prompt, _ in calls)
    assert calls[0][3] == ruler.sample_chunks(ruler.generate("single1", 160, 0, count), count)
    by = {(r.task, r.variant): r for r in moved}
    for r in plain:
        if r.variant == "full":
            assert (by[(r.task, "full")].output, by[(r.task, "full")].gold_ll) == (r.output, r.gold_ll)
        else:
            assert by[(r.task, "shared_prefix")].kl != pytest.approx(r.kl, abs=1e-6)
    assert json.loads((out / runner.RUN_FILE).read_text())["transfer_from"] == other.name
    with pytest.raises(ValueError, match="transfer_from"):
        runner.run(engine("moved"), profile, progress=False, out_dir=out, prepare=prepare,
                   identity={"transfer_from": "another"})


def test_a_sweep_report_merges_another_run_over_the_same_samples_and_refuses_a_different_one(
        make_engine, tmp_path):
    from cacheclip_rag.cli import main

    engine = make_engine(tiny_model("llama"))
    base = replace(runner.PROFILES["quick"], lengths=(160,), tasks=("single1",), samples=2,
                   variants=("full", "cacheclip"), max_new_tokens=4)
    runner.run(engine, replace(base, ratios=(0.5,)), progress=False, out_dir=tmp_path / "power")
    runner.run(engine, replace(base, ratios=(0.3,)), progress=False, out_dir=tmp_path / "sweep")
    args = ["eval", "--profile", "quick", "--lengths", "160", "--tasks", "single1", "--samples", "2", "--ratios", "0.3",
            "--variants", "full,cacheclip", "--out", str(tmp_path / "sweep"), "--report-only",
            "--merge", str(tmp_path / "power"), "--primary", str(tmp_path / "no-such-model")]
    assert main(args) == 0
    quality = json.loads((tmp_path / "sweep" / "quality_160.json").read_text())
    rows = {(m["method"], m["ratio"]): m["n"] for m in quality["methods"]}
    assert rows == {("full", None): 2, ("cacheclip", 0.3): 2, ("cacheclip", 0.5): 2}  # full once, both ratios
    assert "merged" in (tmp_path / "sweep" / "report.md").read_text()
    # a run over other samples (here: full's answer changed) cannot be paired with this one
    path = tmp_path / "power" / runner.RECORDS_FILE
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    lines[1][0]["output"] += " and more"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ValueError, match=r"disagree on full of single1 at 160 tokens \(seed 1\) in output"):
        main(args)
    with pytest.raises(SystemExit, match="no finished samples there"):
        main([str(tmp_path / "nothing") if a == str(tmp_path / "power") else a for a in args])


def record(seed: int, variant: str, ratio: float | None, tf_kl: float, score: float = 1.0) -> runner.Record:
    """A made-up record of single1 at 160 tokens: only what the summaries read varies."""
    return runner.Record(task="single1", length=160, seed=seed, variant=variant, ratio=ratio, prompt_tokens=10,
                         chunk_tokens=8, chunks=2, score=score, kl=0.0, tf_kl=tf_kl, tf_top1=1.0, gold_ll=-1.0,
                         gold_ll_delta=0.0, recomputed_share=ratio or 1.0, load_s=0.0, select_s=0.0,
                         recompute_s=1.0, ttft_s=1.0, output="x", references=("x",))


def test_quality_judges_each_method_against_the_must_hold_by_paired_ratios_of_means():
    """Retention = mean score / full's, KL share = mean KL / shared-prefix reuse's, both over the samples each
    pair holds. Constructed: 20 samples, full right on all; method a right on 19 (0.95) with KL a fifth of
    shared-prefix reuse's on every sample (interval collapses to 0.2): met. Method b right on every sample but
    KL 0.3x: the KL part fails. Method c KL 0.1x, right on 15 of 20 (0.75): the retention part fails."""
    seeds = range(20)
    records = [record(s, "full", None, 0.0) for s in seeds]
    records += [record(s, "shared_prefix", None, 0.1 + 0.01 * s, score=0.0) for s in seeds]
    records += [record(s, "cacheclip", 0.2, 0.2 * (0.1 + 0.01 * s), score=float(s != 3)) for s in seeds]
    records += [record(s, "cacheblend", 0.2, 0.3 * (0.1 + 0.01 * s)) for s in seeds]
    records += [record(s, "oracle", 0.2, 0.1 * (0.1 + 0.01 * s), score=float(s % 4 != 0)) for s in seeds]
    methods = {m["method"]: m for m in report.quality(records, 160)["methods"]}
    assert "must_hold" not in methods["full"] and "must_hold" not in methods["shared_prefix"]
    a, b, c = methods["cacheclip"], methods["cacheblend"], methods["oracle"]
    assert a["retention"]["mean"] == pytest.approx(0.95) and a["retention"]["low"] >= 0.85
    assert [a["kl_share_of_shared_prefix"][k] for k in ("mean", "low", "high")] == pytest.approx([0.2] * 3)
    assert a["must_hold"] == {"retention": True, "kl": True, "met": True}
    assert b["must_hold"] == {"retention": True, "kl": False, "met": False}
    assert c["retention"]["mean"] == pytest.approx(0.75)
    assert c["must_hold"] == {"retention": False, "kl": True, "met": False}
    text = report.markdown(records, [], 0.2)
    assert "| cacheclip @ 0.2 | 20 | 0.95 [" in text and "| 0.20 [0.20, 0.20] | met | met | met |" in text
    assert "| oracle @ 0.2 | 20 | 0.75 [" in text and "| not met | met | not met |" in text


def test_quality_marks_the_shipped_default_the_row_a_request_without_options_gets():
    """Exactly one row is the default: the variant whose request equals RequestOptions() at its ratio (the
    question's selection at 0.2 with the spread budget); the paper's aux selection at 0.2, the question's
    selection without the spread budget, and the default at 0.3 are not."""
    seeds = range(3)
    records = [record(s, "full", None, 0.0) for s in seeds]
    records += [record(s, v, r, 0.01) for s in seeds
                for v, r in (("shared_prefix", None), ("cacheclip", 0.2), ("cacheclip_requery", 0.2),
                             ("cacheclip_spread", 0.2), ("cacheclip_spread", 0.3))]
    rows = report.quality(records, 160)["methods"]
    assert [(m["method"], m["ratio"]) for m in rows if m["default"]] == [("cacheclip_spread", 0.2)]
    assert runner.VARIANTS["cacheclip_spread"].options(0.2) == RequestOptions()
    assert runner.VARIANTS["cacheclip_requery"].options(0.2).spread_ratio is None
    assert runner.VARIANTS["cacheclip"].options(0.2).selection == "aux"


def test_cross_budget_pairs_cacheclip_with_cacheblend_only_at_larger_ratios_on_shared_samples(tmp_path):
    """cacheclip at ratio r − cacheblend at every ratio above r, paired by sample; the report and
    quality JSON carry it. Constructed so the answer is known: cacheclip@0.3's KL is 0.02 below
    cacheblend@0.5's on every sample (the interval collapses to −0.02, all losses); cacheblend@0.1 is
    a smaller budget, so it is not compared, unless the roles are swapped."""

    seeds = range(6)
    records = [record(s, "full", None, 0.0) for s in seeds]
    records += [record(s, "cacheclip", 0.3, 0.05 + 0.01 * s) for s in seeds]
    records += [record(s, "cacheblend", 0.5, 0.07 + 0.01 * s) for s in seeds]
    records += [record(s, "cacheblend", 0.1, 0.04) for s in seeds]
    records += [record(s, "cacheblend", 0.3, 0.0) for s in seeds[:1]]  # one shared sample: too few to pair
    records += [record(7, "cacheclip", 0.3, 0.0)]  # a sample cacheblend lacks: left out of the pairing
    rows = runner.cross_budget_differences(records)
    assert {(d["ratio"], d["other_ratio"], d["metric"]) for d in rows} == {(0.3, 0.5, "tf_kl"), (0.3, 0.5, "score")}
    kl = next(d for d in rows if d["metric"] == "tf_kl")
    assert (kl["n"], kl["wins"], kl["losses"]) == (6, 0, 6) and kl["excludes_zero"]
    assert [kl["mean"], kl["low"], kl["high"]] == pytest.approx([-0.02] * 3)
    score = next(d for d in rows if d["metric"] == "score")
    assert (score["mean"], score["wins"], score["losses"], score["excludes_zero"]) == (0.0, 0, 0, False)
    smaller = runner.cross_budget_differences(records, method="cacheblend", other="cacheclip")
    assert {(d["ratio"], d["other_ratio"]) for d in smaller} == {(0.1, 0.3)}
    assert next(d for d in smaller if d["metric"] == "tf_kl")["wins"] == 0  # 0.04 < 0.05 + 0.01 i everywhere
    assert report.quality(records, 160)["cross_budget"] == rows
    assert "| 160 | 0.3 | 0.5 | tf_kl | 6 | -0.020 [-0.020, -0.020] | 0/6 |" in report.markdown(records, [], 0.3)


def test_the_power_and_sweep_runs_together_cover_the_full_profiles_main_methods_on_the_same_samples():
    profiles = runner.PROFILES

    def cells(profile):
        return {(v, r) for v in profile.variants for r in (profile.ratios if runner.VARIANTS[v].uses_ratio else (None,))}

    parts = ("power", "sweep", "ablations")
    wanted = {(v, r) for v, r in cells(profiles["full"]) if v in runner.MAIN_VARIANTS}
    assert wanted <= cells(profiles["power"]) | cells(profiles["sweep"])
    assert {v for p in parts for v in profiles[p].variants} == set(profiles["full"].variants)
    assert all(runner.jobs_of(profiles[p]) == runner.jobs_of(profiles["full"]) for p in parts)  # same samples


def test_jobs_interleave_tasks_so_a_partial_run_is_balanced():
    profile = replace(runner.PROFILES["power"], tasks=("single1", "single2"), lengths=(1024, 2048), samples=(25, 13))
    jobs = runner.jobs_of(profile)
    assert len(jobs) == 2 * 25 + 2 * 13
    assert jobs[:4] == [("single1", 1024, 0), ("single2", 1024, 0), ("single1", 1024, 1), ("single2", 1024, 1)]
    assert jobs[49] == ("single2", 1024, 24) and jobs[50] == ("single1", 2048, 0)


def test_a_perfect_reader_scores_one_on_every_task(make_engine, monkeypatch):
    """No cap in the pipeline: a model that writes the gold answer (values across lines, as a model may)
    scores 1 on every task type, under every method: the budget fits, no newline ends the answer."""
    import cacheclip_rag.engine.core as engine_module

    engine = make_engine(tiny_model("gemma3"))
    count = runner.token_counter(engine)
    answers: list[int] = []

    def perfect(lm, cache, first_logits, position, max_new_tokens, *args, **kwargs):
        assert len(answers) <= max_new_tokens
        return iter(list(answers))

    monkeypatch.setattr(engine_module, "TokenDecoder", perfect)
    profile = replace(runner.PROFILES["quick"], ratios=(0.2,), variants=("full", "ape", "cacheclip"))
    for task in ruler.TASKS:
        sample = ruler.generate(task, 200, 0, count)
        answers[:] = engine.primary.encode(runner.gold_answer(sample).replace(", ", ",\n"))
        records = runner.evaluate_sample(engine, sample, profile, count)
        assert [r.score for r in records] == [1.0] * 3, (task, [r.output for r in records])


def test_ruler_wording_is_rulers_own():
    count = lambda text: len(text.split())  # noqa: E731
    single = ruler.generate("single1", 200, 0, count)
    key = single.needles[0].key
    assert single.preamble == ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
                               "I will quiz you about the numbers afterwards.")
    assert single.question == f"What are all the special magic numbers for {key} mentioned in the provided text?"
    assert single.answer_prefix == f" The special magic numbers for {key} mentioned in the provided text are"
    multi = ruler.generate("multiquery", 200, 0, count)
    keys = [n.key for n in multi.needles[:4]]
    assert f"for {keys[0]}, {keys[1]}, {keys[2]}, and {keys[3]} mentioned" in multi.question
    assert "uuids" in ruler.generate("single3", 200, 0, count).preamble
    assert runner.gold_answer(multi) == " " + ", ".join(multi.references[:3]) + ", and " + multi.references[3] + "."


def test_runner_refuses_unknown_variants(make_engine):
    profile = replace(runner.PROFILES["quick"], variants=("full", "magic"))
    with pytest.raises(ValueError, match="unknown variants"):
        runner.run(make_engine(tiny_model("llama")), profile, progress=False)


@pytest.mark.slow
@pytest.mark.skipif(not has_embedded_models(), reason="embedded models not installed")
def test_full_attention_on_gemma_passes_a_short_single1_floor(tmp_path):
    """The evaluation can fail: real Gemma 3 270M under `full` must find the needle in 2 of 3 samples."""
    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.models.loading import load_model
    from cacheclip_rag.store import LMDBStore

    engine = Engine(primary=load_model("gemma3-270m"), store=LMDBStore(tmp_path), config=EngineConfig(store_path=tmp_path))
    profile = replace(runner.PROFILES["quick"], lengths=(384,), tasks=("single1",), samples=3, variants=("full",))
    records = runner.run(engine, profile, progress=False)
    assert len(records) == 3
    assert sum(r.score for r in records) / 3 >= 2 / 3, [r.output for r in records]


def test_decode_budget_fits_every_tasks_longest_answer():
    """No task is capped by the decode budget: the budget holds all references in the answer model's
    tokens, for UUIDs and four values too (24 tokens cut Gemma's UUIDs and multi-value answers)."""
    from types import SimpleNamespace

    from cacheclip_rag.evaluation import ruler
    from cacheclip_rag.evaluation.runner import decode_budget
    from cacheclip_rag.testing import tiny_model

    lm = tiny_model("gemma3")
    engine = SimpleNamespace(primary=lm)
    count = lambda text: len(lm.encode(text))  # noqa: E731
    for task in ruler.TASKS:
        sample = ruler.generate(task, 600, 0, count)
        answer = " " + ", ".join(sample.references)
        assert decode_budget(engine, sample) >= len(lm.encode(answer)), task
        assert ruler.score(lm.tokenizer.decode(lm.encode(answer)), sample.references) == 1.0, task


def test_cli_report_only_writes_the_report_of_a_run_folder_without_models(make_engine, tmp_path, capsys):
    from cacheclip_rag.cli import main

    engine = make_engine(tiny_model("llama"))
    profile = replace(runner.PROFILES["quick"], lengths=(160,), tasks=("single1",), samples=2, ratios=(0.5,),
                      variants=("full", "cacheclip"), max_new_tokens=4)
    runner.run(engine, profile, progress=False, out_dir=tmp_path / "run")
    args = ["eval", "--profile", "quick", "--lengths", "160", "--tasks", "single1", "--samples", "2", "--ratios", "0.5",
            "--variants", "full,cacheclip", "--out", str(tmp_path / "run"), "--report-only",
            "--primary", str(tmp_path / "no-such-model")]  # no model is loaded
    assert main(args) == 0
    assert "| cacheclip @ 0.5 | 2 |" in (tmp_path / "run" / "report.md").read_text()
    assert json.loads((tmp_path / "run" / "quality_160.json").read_text())["methods"][0]["n"] == 2
    with pytest.raises(SystemExit, match="no finished samples"):
        main([str(tmp_path / "empty") if a == str(tmp_path / "run") else a for a in args])


def test_cli_limit_of_zero_minutes_runs_one_sample_and_a_negative_one_is_refused(make_engine, tmp_path, monkeypatch):
    """`--limit-minutes 0` used to read as no limit (0 is falsy) and ran the whole profile."""
    from cacheclip_rag.cli import Engine, main

    args = ["eval", "--profile", "quick", "--lengths", "160", "--tasks", "single1", "--samples", "3", "--ratios", "0.5",
            "--variants", "full,cacheclip", "--alignment-samples", "0", "--out", str(tmp_path / "run"),
            "--store", str(tmp_path / "kv"), "--primary", str(tmp_path / "no-such-model")]
    with pytest.raises(SystemExit, match="--limit-minutes must be >= 0"):
        main([*args, "--limit-minutes", "-1"])  # before any model loads (that one does not exist)
    engine = make_engine(tiny_model("llama"))
    monkeypatch.setattr(Engine, "from_config", classmethod(lambda cls, config: engine))
    assert main([*args, "--limit-minutes", "0"]) == 0
    assert len(runner.load_records(tmp_path / "run")) == 1
    assert main([*args, "--limit-minutes", "0"]) == 0
    assert len(runner.load_records(tmp_path / "run")) == 2  # the rerun resumes, one more


def test_the_ruler_view_reads_in_rulers_layout_and_leaves_the_callers_engine_as_it_was(make_engine):
    from cacheclip_rag.models.loading import PromptFormat

    engine = make_engine(tiny_model("llama"), aux=tiny_model("qwen2", seed=1))
    prompt, config = engine.primary.prompt, engine.config
    sample = ruler.generate("single1", 160, 0, runner.token_counter(engine))
    view = runner.ruler_engine(engine, sample)
    assert view.primary.prompt == PromptFormat.ruler() != prompt
    assert view.config.system_prompt == sample.preamble != config.system_prompt
    assert view.primary.model is engine.primary.model and view.store is engine.store and view.aux is engine.aux
    lone = replace(engine, aux=engine.primary)  # the primary as its own aux reads in the same layout
    assert runner.ruler_engine(lone, sample).aux.prompt == PromptFormat.ruler() != lone.aux.prompt
    profile = replace(runner.PROFILES["quick"], variants=("full",), max_new_tokens=4)
    runner.evaluate_sample(engine, sample, profile, runner.token_counter(engine))
    assert engine.primary.prompt is prompt and engine.config is config  # the evaluation used a view too


def test_gap_variants_run_in_the_harness_and_keep_the_exact_end(make_engine):
    """The quality-gap variants: boundary tokens at ratio 1 are full attention; the one-kind-of-layer
    recomputes run at their fixed ratio 1 (recorded without a ratio) and are neither full nor reuse."""
    engine = make_engine(tiny_model("gemma3"))
    profile = replace(
        runner.PROFILES["gap"], lengths=(160,), tasks=("single1",), samples=1, ratios=(1.0,), max_new_tokens=4,
        variants=("full", "shared_prefix", "cacheclip_seams", "cacheclip_boundary4", "recompute_sliding_only",
                  "recompute_global_only", "cacheclip_requery", "cacheclip_requery_half"),
    )
    by = {r.variant: r for r in runner.run(engine, profile, progress=False)}
    for name in ("cacheclip_seams", "cacheclip_boundary4", "cacheclip_requery", "cacheclip_requery_half"):
        assert by[name].ratio == 1.0 and by[name].tf_kl < 1e-6 and by[name].output == by["full"].output
    # the rows stage 1 ran before the final pass count in the budget spent
    assert by["cacheclip_requery_half"].recomputed_share > by["cacheclip_requery"].recomputed_share
    for name in ("recompute_sliding_only", "recompute_global_only"):
        assert by[name].ratio is None and by[name].recomputed_share > 0.5
    assert by["recompute_global_only"].tf_kl > 1e-6
    with pytest.raises(ValueError, match="no sliding-window layers"):
        runner.run(make_engine(tiny_model("llama")), profile, progress=False)


def _run_folder(folder: Path, rows: list[runner.Record]) -> Path:
    folder.mkdir()
    by_sample: dict[int, list[runner.Record]] = {}
    for r in rows:
        by_sample.setdefault(r.seed, []).append(r)
    (folder / runner.RECORDS_FILE).write_text("".join(json.dumps([asdict(r) for r in rs]) + "\n"
                                                      for rs in by_sample.values()))
    return folder


def test_compare_runs_pairs_a_variant_across_two_folders_and_refuses_different_full_references(tmp_path, capsys, monkeypatch):
    """bench/compare_runs.py: B's KL is A's + 0.01 on every shared sample (a constant difference, so the
    interval collapses onto it); a sample only one folder holds is left out; a folder whose `full`
    answered differently is another primary or sample set, and pairing with it is refused."""
    spec = importlib.util.spec_from_file_location("compare_runs", Path(__file__).parents[1] / "bench" / "compare_runs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    def record(seed: int, variant: str, tf_kl: float, output: str = "x") -> runner.Record:
        return runner.Record(task="single1", length=160, seed=seed, variant=variant,
                             ratio=None if variant == "full" else 0.2, prompt_tokens=10, chunk_tokens=8, chunks=2,
                             score=1.0, kl=0.0, tf_kl=tf_kl, tf_top1=1.0, gold_ll=-1.0, gold_ll_delta=0.0,
                             recomputed_share=0.2, load_s=0.0, select_s=0.0, recompute_s=1.0, ttft_s=1.0,
                             output=output, references=("x",))

    a = _run_folder(tmp_path / "a", [r for s in range(5) for r in (record(s, "full", 0.0),
                                                                   record(s, "cacheclip", 0.05 + 0.01 * s))])
    b = _run_folder(tmp_path / "b", [r for s in range(6) for r in (record(s, "full", 0.0),
                                                                   record(s, "cacheclip", 0.06 + 0.01 * s))])
    monkeypatch.setattr("sys.argv", ["compare_runs", f"{a}:cacheclip", f"{b}:cacheclip"])
    assert tool.main() == 0
    out = capsys.readouterr().out
    assert "n = 5 paired samples" in out
    assert "| tf_kl |" in out and "0.010 [0.010, 0.010] (n=5) | 5 / 0" in out
    other = _run_folder(tmp_path / "other", [r for s in range(5) for r in (record(s, "full", 0.0, output="y"),
                                                                           record(s, "cacheclip", 0.1))])
    monkeypatch.setattr("sys.argv", ["compare_runs", f"{a}:cacheclip", f"{other}:cacheclip"])
    with pytest.raises(ValueError, match="disagree on full"):
        tool.main()
    monkeypatch.setattr("sys.argv", ["compare_runs", f"{a}:cacheblend", f"{b}:cacheclip"])
    with pytest.raises(SystemExit, match="no rows of variant 'cacheblend'"):
        tool.main()


def test_the_multichunk_family_puts_each_value_in_its_own_chunk_and_scores_strictly():
    """Issue 54's family: the values of one key land in distinct chunks (the answer needs them all), the
    comparison needs both keys' values, and strict scoring (solved: every value) is kept beside RULER's
    partial credit; naming the wrong key first is wrong."""
    from cacheclip_rag.evaluation import ruler

    count = lambda text: len(text.split())  # noqa: E731
    for task in ("spread2", "spread3", "spread4"):
        k = int(task[-1])
        for seed in range(6):
            sample = ruler.generate(task, 2048, seed, count)
            chunks = ruler.sample_chunks(sample, count)
            assert len(sample.references) == k and len(set(sample.references)) == k
            holders = [[i for i, c in enumerate(chunks) if value in c] for value in sample.references]
            firsts = [h[0] for h in holders]
            assert all(h for h in holders) and len(set(firsts)) == k, (task, seed, holders)
            assert ruler.score(" ".join(sample.references), sample.references) == 1.0
            assert ruler.score(sample.references[0], sample.references) == 1 / k  # partial credit ...
    sample = ruler.generate("compare", 2048, 3, count)
    (right,), (wrong,) = sample.references, sample.wrong
    values = {n.key: int(n.value) for n in sample.needles[:2]}
    assert values[right] > values[wrong] and right in sample.question and wrong in sample.question
    assert ruler.score(f"{right}, not {wrong}", sample.references, sample.wrong) == 1.0
    assert ruler.score(f"{wrong}, not {right}", sample.references, sample.wrong) == 0.0
    firsts = []  # "older": ages in two halves of the context; the older captain first for even seeds only
    for seed in range(8):
        sample = ruler.generate("older", 2048, seed, count)
        (right,), (wrong,) = sample.references, sample.wrong
        ages = {n.key: int(n.value) for n in sample.needles[:2]}
        assert ages[right] > ages[wrong] and 21 <= min(ages.values()) and right in sample.question
        holders = [next(i for i, c in enumerate(ruler.sample_chunks(sample, count)) if f"the {key} is" in c)
                   for key in (right, wrong)]
        assert holders[0] != holders[1]
        firsts.append(holders[0] < holders[1])
    assert firsts == [seed % 2 == 0 for seed in range(8)]
    from cacheclip_rag.evaluation.profiles import PROFILES

    profile = PROFILES["multichunk"]
    assert profile.tasks == ruler.MULTICHUNK_TASKS and profile.samples_at(2048) * len(profile.tasks) >= 52


def test_the_deployed_format_asks_as_the_engine_does_and_a_folder_keeps_its_format(make_engine, tmp_path, monkeypatch):
    """format="deployed": chunks ingested behind the engine's own system prompt and asked in its own layout, no
    RULER preamble and no answer priming (what Engine.generate sends); the records say so; a run folder holds one
    format, and a folder from before formats resumes as the RULER run it is."""
    engine = make_engine(tiny_model("llama"))
    profile = replace(runner.PROFILES["quick"], lengths=(160,), tasks=("single1",), samples=1, ratios=(0.5,),
                      variants=("full", "cacheclip"), max_new_tokens=4)
    sample = ruler.generate("single1", 160, 0, runner.token_counter(engine))
    planned = []
    plan = Engine.plan
    monkeypatch.setattr(Engine, "plan", lambda self, q, texts, options: planned.append((self, options)) or plan(self, q, texts, options))
    records = runner.evaluate_sample(engine, sample, profile, runner.token_counter(engine), format="deployed")
    assert {r.format for r in records} == {"deployed"}
    assert all(view is engine and options.answer_prefix == "" and options.prompt_stops for view, options in planned)
    expected = engine.plan(sample.question, ruler.sample_chunks(sample, runner.token_counter(engine)), RequestOptions())
    assert engine.primary.tokenizer.decode(list(expected.prefix_ids)).count(engine.config.system_prompt) == 1
    planned.clear()
    ruler_records = runner.evaluate_sample(engine, sample, profile, runner.token_counter(engine))
    assert {r.format for r in ruler_records} == {"ruler"}
    assert all(view is not engine and options.answer_prefix == sample.answer_prefix for view, options in planned)
    with pytest.raises(ValueError, match="format"):
        runner.evaluate_sample(engine, sample, profile, runner.token_counter(engine), format="raw")
    out = tmp_path / "run"
    runner.run(engine, profile, progress=False, out_dir=out, format="deployed")
    with pytest.raises(ValueError, match="format"):
        runner.run(engine, profile, progress=False, out_dir=out)  # a RULER run into a deployed folder
    identity = json.loads((out / runner.RUN_FILE).read_text())
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / runner.RUN_FILE).write_text(json.dumps({k: v for k, v in identity.items() if k != "format"}))
    runner.run(engine, profile, progress=False, out_dir=legacy)  # before formats: a RULER run, resumed
    with pytest.raises(ValueError, match="format"):
        runner.run(engine, profile, progress=False, out_dir=legacy, format="deployed")
