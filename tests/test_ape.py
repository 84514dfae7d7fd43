"""APE (parallel encoding with attention temperature and scale) and teacher-forced scoring.

APE's attention is checked against the two-block formula of its reference kernel on random tensors;
its positions against one independent forward over the whole prompt with a block mask (each chunk
sees the prefix and itself, at positions that restart after the prefix; the question sees all).
"""

import pytest
import torch

from cacheclip_rag.stages.recompute.attention import ChunkScaling, chunk_scaled_attention, position_masks
from cacheclip_rag.stages.cache import BlendedCache
from cacheclip_rag.config import RequestOptions
from cacheclip_rag.stages.load.ingest import new_cache
from cacheclip_rag.stages.recompute.forward import forward_at
from tests.conftest import CHUNKS, QUESTION, max_diff

TOL = 1e-4


def _two_block_reference(q, k, v, mask, scaling, chunks: ChunkScaling):
    """APE's reference combination: attention inside the chunks (logits / T) and over the other keys,
    each normalised on its own, mixed by softmax([S*T*LSE_chunks, LSE_others])."""
    scores = (q @ k.transpose(-1, -2)) * scaling + mask
    inside = scores[..., chunks.start:chunks.stop] / chunks.temperature
    outside = torch.cat([scores[..., :chunks.start], scores[..., chunks.stop:]], dim=-1)
    v_in = v[..., chunks.start:chunks.stop, :]
    v_out = torch.cat([v[..., :chunks.start, :], v[..., chunks.stop:, :]], dim=-2)
    o_in = torch.softmax(inside, -1) @ v_in
    o_out = torch.softmax(outside, -1) @ v_out
    lse = torch.stack([chunks.scale * chunks.temperature * torch.logsumexp(inside, -1), torch.logsumexp(outside, -1)], -1)
    w = torch.softmax(lse, -1)
    return (w[..., :1] * o_in + w[..., 1:] * o_out).transpose(1, 2)


@pytest.mark.parametrize("temperature,scale", [(1.0, 1.0), (0.9, 0.9), (0.5, 0.7), (1.3, 1.1)])
def test_chunk_scaled_attention_matches_the_two_block_formula(temperature, scale):
    torch.manual_seed(0)
    b, h, tq, n, d = 2, 4, 3, 20, 8
    q, k, v = torch.randn(b, h, tq, d), torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    mask = torch.zeros(b, 1, tq, n)
    mask[..., -2:] = torch.finfo(torch.float32).min  # rows the queries may not see
    chunks = ChunkScaling(start=4, stop=15, temperature=temperature, scale=scale)
    out = chunk_scaled_attention(q, k, v, mask, scaling=d**-0.5, softcap=None, chunks=chunks)
    ref = _two_block_reference(q, k, v, mask, d**-0.5, chunks)
    assert max_diff(out, ref) < 1e-5
    plain = torch.softmax((q @ k.transpose(-1, -2)) * d**-0.5 + mask, -1) @ v
    if (temperature, scale) == (1.0, 1.0):
        assert max_diff(out, plain.transpose(1, 2)) < 1e-5
    else:
        assert max_diff(out, plain.transpose(1, 2)) > 1e-3


def _ape(engine, chunks, temperature=1.0, scale=1.0, max_new_tokens=1):
    options = RequestOptions(method="ape", ape_temperature=temperature, ape_scale=scale, max_new_tokens=max_new_tokens,
                             prompt_stops=False)
    return engine.generate(QUESTION, chunks, options)


def _parallel_reference(engine, chunks, answer_tokens=()):
    """Logits at the question's last token and after each answer token, from one forward over the whole
    prompt: chunk i's rows see the prefix and chunk i only, at positions prefix_len + 0, 1, ...; the
    question and answer see everything before them, at positions after the longest chunk."""
    options = RequestOptions(method="ape", max_new_tokens=len(answer_tokens) + 1)
    plan = engine.plan(QUESTION, chunks, options)
    ids = plan.all_ids() + list(answer_tokens)
    p, longest = plan.prefix_len, max(len(c) for c in plan.chunk_ids)
    positions = list(range(p))
    for c in plan.chunk_ids:
        positions += range(p, p + len(c))
    positions += range(p + longest, p + longest + len(ids) - plan.question_start)
    slots = torch.arange(len(ids))
    model = engine.primary.model
    # causal by row, sliding windows by position (chunks are computed as if alone behind the prefix)
    masks = position_masks(model, torch.tensor([positions]), len(ids), torch.float32, query_slots=slots[None],
                           key_positions=torch.tensor(positions))
    neg = torch.finfo(torch.float32).min
    for layer_mask in (masks.values() if isinstance(masks, dict) else [masks]):
        for start, c in zip(plan.chunk_offsets, plan.chunk_ids):
            layer_mask[..., start:start + len(c), p:start] = neg  # no earlier chunk
    cache = new_cache(engine.primary, len(ids))
    out = forward_at(model, cache, torch.tensor([ids]), torch.tensor([positions]), slots=slots, mask=masks,
                     logits_to_keep=len(answer_tokens) + 1)
    return out[0]


def test_ape_without_temperature_or_scale_on_one_chunk_is_full_attention(tiny, make_engine):
    engine = make_engine(tiny)
    one = CHUNKS[:1]
    full = engine.generate(QUESTION, one, RequestOptions(method="full", max_new_tokens=1))
    assert max_diff(_ape(engine, one).first_logits, full.first_logits) < TOL


def test_ape_positions_are_parallel_and_decoding_keeps_them(tiny, make_engine):
    engine = make_engine(tiny)
    answer = _ape(engine, CHUNKS, max_new_tokens=4)
    reference = _parallel_reference(engine, CHUNKS, answer.token_ids[:-1])
    assert max_diff(answer.first_logits, reference[0]) < TOL
    # each decoded token is the argmax of the reference's logits at its step (greedy, parallel positions)
    assert [int(t) for t in reference.argmax(-1)] == answer.token_ids


def test_ape_temperature_and_scale_change_the_answer_distribution(tiny, make_engine):
    engine = make_engine(tiny)
    plain = _ape(engine, CHUNKS).first_logits
    assert max_diff(_ape(engine, CHUNKS, 0.9, 0.9).first_logits, plain) > 1e-4
    # and APE is not the contiguous shared-prefix reuse
    shared = engine.generate(QUESTION, CHUNKS, RequestOptions(method="shared_prefix", max_new_tokens=1)).first_logits
    assert max_diff(plain, shared) > 1e-3


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), 10.0])
def test_ape_parameters_are_checked(bad):
    with pytest.raises(ValueError, match="ape_temperature"):
        RequestOptions(method="ape", ape_temperature=bad)
    with pytest.raises(ValueError, match="ape_scale"):
        RequestOptions(method="ape", ape_scale=bad)


@pytest.mark.parametrize("method", ["full", "cacheclip", "ape"])
def test_teacher_forced_logits_follow_the_decode(tiny, make_engine, method):
    """Forcing a method's own greedy answer gives back, row by row, the logits its decode chose from."""
    engine = make_engine(tiny)
    options = RequestOptions(method=method, max_new_tokens=5, prompt_stops=False)
    answer = engine.generate(QUESTION, CHUNKS, options)
    plan = engine.plan(QUESTION, CHUNKS, options)
    prefill = engine.prefill(plan, options)
    forced = engine.teacher_forced_logits(plan, prefill, answer.token_ids)
    assert forced.shape[0] == len(answer.token_ids)
    assert [int(t) for t in forced.argmax(-1)] == answer.token_ids
    assert max_diff(forced[0], answer.first_logits) < TOL
    # the prefill's prompt rows are untouched: decoding after forcing gives the same answer
    again = engine.decode(plan, prefill, options)
    assert "".join(again) == answer.text
    with pytest.raises(ValueError, match="do not fit"):
        engine.teacher_forced_logits(plan, prefill, answer.token_ids * 3)


def test_teacher_forced_logits_at_ratio_one_equal_full(tiny, make_engine):
    engine = make_engine(tiny)
    full_options = RequestOptions(method="full", max_new_tokens=4, prompt_stops=False)
    full = engine.generate(QUESTION, CHUNKS, full_options)
    tokens = full.token_ids
    plan = engine.plan(QUESTION, CHUNKS, full_options)
    prefill = engine.prefill(plan, full_options)
    reference = engine.teacher_forced_logits(plan, prefill, tokens)
    clip = RequestOptions(method="cacheclip", ratio=1.0, max_new_tokens=4)
    plan = engine.plan(QUESTION, CHUNKS, clip)
    prefill = engine.prefill(plan, clip)
    assert max_diff(engine.teacher_forced_logits(plan, prefill, tokens), reference) < TOL
    assert isinstance(prefill.cache, BlendedCache)
