import math
import copy

import torch

from cacheclip_rag.stages.load.blend import chunk_entries
from cacheclip_rag.config import RequestOptions
from cacheclip_rag.stages.load.ingest import SHARED, chunk_unit
from cacheclip_rag.stages.group import top_k_candidates
from cacheclip_rag.stages.select.scores import aux_scores
from cacheclip_rag.stages.select.selection import aux_attention
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION, max_diff


def eager_last_layer(model, ids: list[int]) -> torch.Tensor:
    """Last-layer attention [H, T, T] of a plain eager forward (the reference the selection must match)."""
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("eager")
    with torch.no_grad():
        return reference(input_ids=torch.tensor([ids]), output_attentions=True, use_cache=False).attentions[-1][0]


def test_batched_stored_kv_scores_equal_plain_full_attention_forward(tiny, make_engine):
    """Selection over stored aux KV (all chunks batched) equals, chunk by chunk, the last-layer
    attention of a plain eager forward of prefix + chunk_i + question with output_attentions."""
    engine = make_engine(tiny)
    aux = engine.aux
    prefix, entries = chunk_entries(engine.parts, aux, CHUNKS, variant=SHARED)
    question_ids = aux.encode(aux.prompt.question(QUESTION))
    scores = aux_scores(aux, prefix, entries, question_ids)

    for text, got in zip(CHUNKS, scores):
        chunk_ids = aux.encode(chunk_unit(aux, text))
        last = eager_last_layer(aux.model, list(prefix.token_ids) + chunk_ids + question_ids)  # [H, T, T]
        p, n, q = len(prefix.token_ids), len(chunk_ids), len(question_ids)
        expected = last[:, -q:, p : p + n].mean(dim=(0, 1))
        assert got.shape == expected.shape
        # float32, same math in another order: 1e-6 absolute on probabilities of order 1e-2
        assert max_diff(got, expected) < 1e-6


def test_top_k_is_global_over_chunks_with_ceil():
    scores = [torch.tensor([0.1, 0.9, 0.2]), torch.tensor([0.8, 0.05]), torch.tensor([0.7])]
    chosen = top_k_candidates(scores, 0.4)  # ceil(0.4 * 6) = 3
    assert [c.tolist() for c in chosen] == [[False, True, False], [True, False], [True]]
    assert sum(int(c.sum()) for c in top_k_candidates(scores, 0.0)) == 0
    assert all(c.all() for c in top_k_candidates(scores, 1.0))
    assert sum(int(c.sum()) for c in top_k_candidates(scores, 0.5)) == 3


def test_question_rows_are_the_question_text_not_the_template():
    from cacheclip_rag.stages.select.scores import question_tokens

    lm = tiny_model("llama")
    ids, own = question_tokens(lm, "what colour is the ferry?", "The answer is")
    text = lm.prompt.question("what colour is the ferry?", "The answer is")
    _, spans = lm.encode_with_offsets(text)
    words = "".join(text[a:b] for (a, b), keep in zip(spans, own.tolist()) if keep)
    assert "ferry" in words and "answer" not in words.lower() and 0 < int(own.sum()) < len(ids)


def test_cacheclip_never_recomputes_chunk_zero_and_meets_the_budget(make_engine):
    from cacheclip_rag.config import RequestOptions
    from tests.conftest import CHUNKS, QUESTION

    engine = make_engine(tiny_model("llama"))
    plan = engine.plan(QUESTION, CHUNKS, RequestOptions())
    chunk_tokens = plan.question_start - plan.prefix_len
    eligible = chunk_tokens - len(plan.chunk_ids[0])
    for ratio in (0.1, 0.3, 0.6, 1.0):
        options = RequestOptions(method="cacheclip", ratio=ratio, max_new_tokens=1)
        selected = aux_attention(engine.parts, plan, options).rows
        assert not selected[0].any()  # exact behind the shared prefix
        chosen = sum(int(m.sum()) for m in selected)
        assert chosen >= min(math.ceil(ratio * chunk_tokens), eligible)  # the budget is met, not nominal
    assert all(m.all() for m in selected[1:])  # ratio 1: every token but chunk 0's, separators included


def test_scores_over_the_question_rows_skip_the_template_after_them_exactly(make_engine, monkeypatch):
    """Rows after the question's own tokens (template, answer prefix) are not run: by causality the
    scores equal those of a plain eager forward over the whole question, averaged on its own rows."""
    import cacheclip_rag.stages.select.scores as select
    from cacheclip_rag.stages.select.scores import question_tokens

    engine = make_engine(tiny_model("qwen2"))
    aux = engine.aux
    prefix, entries = chunk_entries(engine.parts, aux, CHUNKS, variant=SHARED)
    ids, own = question_tokens(aux, QUESTION, " The special magic number is")
    run_rows, real = [], select.forward_at

    def counting(model, cache, ids_, *args, **kwargs):
        run_rows.append(ids_.shape[1])
        return real(model, cache, ids_, *args, **kwargs)

    monkeypatch.setattr(select, "forward_at", counting)
    scores = aux_scores(aux, prefix, entries, ids, question_rows=own)
    keep = int(torch.nonzero(own).max()) + 1
    assert run_rows == [keep] and keep < len(ids)
    for text, got in zip(CHUNKS, scores):
        chunk_ids = aux.encode(chunk_unit(aux, text))
        last = eager_last_layer(aux.model, list(prefix.token_ids) + chunk_ids + ids)  # the whole question runs here
        p, n = len(prefix.token_ids), len(chunk_ids)
        rows = torch.nonzero(own).flatten() + p + n
        assert max_diff(got, last[:, rows, p : p + n].mean(dim=(0, 1))) < 1e-6


def test_int8_aux_selects_nearly_what_the_float_aux_selects(make_engine):
    from cacheclip_rag.config import EngineConfig, RequestOptions
    from cacheclip_rag.engine.core import Engine

    lm = tiny_model("llama")
    engine = make_engine(lm)
    quantized = Engine(primary=lm, store=engine.store, aux=lm,
                       config=EngineConfig(store_path=engine.config.store_path, system_prompt="Be brief.",
                                           aux_quantization="int8", store_dtype="float32"))
    assert engine.aux_scorer is None
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

    linears = [m for m in quantized.aux_scorer.modules() if isinstance(m, DynamicInt8Linear)]
    assert len(linears) == 7 * lm.config.num_hidden_layers  # q, k, v, o, gate, up, down per layer
    assert not any(isinstance(m, DynamicInt8Linear) for m in lm.model.modules())  # the aux itself stays float
    options = RequestOptions(method="cacheclip", ratio=0.3)
    plan = engine.plan(QUESTION, CHUNKS, options)
    fp32 = set(aux_attention(engine.parts, plan, options).positions(plan).tolist())
    int8 = set(aux_attention(quantized.parts, plan, options).positions(plan).tolist())
    assert len(fp32 & int8) / len(fp32 | int8) > 0.6
    # selection is all it changes: at ratio 1 the int8-selected answer is full attention's
    full = engine.generate(QUESTION, CHUNKS, RequestOptions(method="full", max_new_tokens=1)).first_logits
    one = quantized.generate(QUESTION, CHUNKS, RequestOptions(method="cacheclip", ratio=1.0, max_new_tokens=1,
                                                              selection="aux")).first_logits
    assert max_diff(one, full) < 1e-4


def test_int8_aux_is_refused_off_the_cpu():
    import pytest

    from cacheclip_rag.config import EngineConfig

    with pytest.raises(ValueError, match="aux_device='cpu'"):
        EngineConfig(aux_quantization="int8", aux_device="cuda")
    with pytest.raises(ValueError, match="aux_quantization"):
        EngineConfig(aux_quantization="int4")


def test_an_aux_that_is_the_primary_selects_after_the_load_and_misses_are_computed_once(make_engine, monkeypatch):
    """The aux and the primary as one model share their stored caches (the same keys). On a cold store the
    selection must not race the load: the load computes each missing chunk once, the aux then reads it, and
    the request reports no reused tokens (nothing was stored before it)."""
    lm = tiny_model("llama")
    engine = make_engine(lm)  # aux = primary
    events, writes = [], []
    from cacheclip_rag.stages.load import blend
    from cacheclip_rag.methods import prefills as methods

    load, select, put_many = blend.blended_cache, methods.aux_attention, engine.store.put_many

    def loading(*args, **kwargs):
        cache = load(*args, **kwargs)
        events.append("loaded")
        return cache

    def selecting(*args, **kwargs):
        events.append("selecting")
        return select(*args, **kwargs)

    def storing(items, *args, **kwargs):
        items = list(items)
        writes.extend(key for key, *_ in items)
        return put_many(items, *args, **kwargs)

    monkeypatch.setattr(blend, "blended_cache", loading)  # the blocks every method calls
    monkeypatch.setattr(methods, "aux_attention", selecting)
    engine.store.put_many = storing
    answer = engine.generate(QUESTION, CHUNKS, RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=1,
                                                                selection="aux", min_recompute_tokens=0))
    assert events == ["loaded", "selecting"]
    assert len(writes) == len(set(writes)) > 0  # every missing entry (and the prefix) written once
    assert answer.reused_tokens == 0
    again = engine.generate(QUESTION, CHUNKS, RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=1,
                                                                selection="aux", min_recompute_tokens=0))
    assert again.reused_tokens > 0 and len(writes) == len(set(writes))


def test_int8_aux_runs_on_a_bfloat16_aux():
    """The CPU default is bf16 where the CPU has it: the int8 copy is quantized from float32 linears and
    runs over a float32 copy of the stored bf16 cache; it selects nearly what the bf16 aux selects."""
    import tempfile

    from cacheclip_rag.config import EngineConfig, RequestOptions
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.store import LMDBStore

    from cacheclip_rag.models.packed_linear import pack_linears

    lm = tiny_model("llama")
    lm.model.to(torch.bfloat16)
    pack_linears(lm.model)  # as load_model leaves a bf16 model on the CPU
    path = tempfile.mkdtemp()
    plain = Engine(primary=lm, store=LMDBStore(path), aux=lm, config=EngineConfig(store_path=path))
    quantized = Engine(primary=lm, store=plain.store, aux=lm, config=EngineConfig(store_path=path,
                                                                                 aux_quantization="int8"))
    plain.ingest(CHUNKS, progress=False)
    options = RequestOptions(method="cacheclip", ratio=0.3, selection="aux")
    plan = plain.plan(QUESTION, CHUNKS, options)
    bf16 = set(aux_attention(plain.parts, plan, options).positions(plan).tolist())
    int8 = set(aux_attention(quantized.parts, plan, options).positions(plan).tolist())
    assert len(bf16 & int8) / len(bf16 | int8) > 0.6
