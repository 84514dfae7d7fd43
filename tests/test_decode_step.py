"""`decode_step` is `forward_at` for a plain decode step, and `decode_steps` is `forward_rows`' packed forward for a
batch of them, bit for bit; they are used only where they are."""

import pytest
import torch

from cacheclip_rag.stages.decode import batching
from cacheclip_rag.stages.decode import step as lean
from cacheclip_rag.stages.recompute.attention import ChunkScaling
from cacheclip_rag.stages.decode.batching import RowsRequest
from cacheclip_rag.stages.cache import BlendedCache
from cacheclip_rag.config import RequestOptions
from cacheclip_rag.stages.decode.decoder import TokenDecoder
from cacheclip_rag.stages.recompute.forward import forward_at
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION

PROMPT = 40


def prefilled(lm, dtype: torch.dtype) -> BlendedCache:
    model = lm.model.to(dtype)
    config = model.config
    cache = BlendedCache.empty(config.num_hidden_layers, 1, config.num_key_value_heads, PROMPT + 16,
                               config.hidden_size // config.num_attention_heads, dtype=dtype, device="cpu")
    forward_at(model, cache, (torch.arange(PROMPT) % 97 + 3)[None], torch.arange(PROMPT)[None])
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "llama3_scaled"])
def test_steps_equal_forward_at_bit_for_bit(arch, dtype):
    lm = tiny_model(arch)
    reference = prefilled(lm, dtype)
    cache = reference.copy()
    assert lean.supports(lm.model, cache)
    token = 7
    for row in range(PROMPT, PROMPT + 6):
        expected = forward_at(lm.model, reference, torch.tensor([[token]]), torch.tensor([[row]]))[0, -1]
        got = lean.decode_step(lm.model, cache, token, row)
        assert torch.equal(got, expected)
        assert torch.equal(cache.key_buffer, reference.key_buffer)
        assert torch.equal(cache.value_buffer, reference.value_buffer)
        assert cache.visible_length == reference.visible_length == row + 1
        token = int(expected.argmax())


def test_only_plain_steps_take_it():
    gemma = tiny_model("gemma3")
    assert not lean.supports(gemma.model, prefilled(gemma, torch.float32))  # windows, its own norms
    lm = tiny_model("qwen2")
    cache = prefilled(lm, torch.float32)
    logits = torch.zeros(lm.model.config.vocab_size)
    assert TokenDecoder(lm, cache, logits, PROMPT, max_new_tokens=4).lean
    assert not TokenDecoder(lm, cache, logits, PROMPT, max_new_tokens=4, rope_shift=3).lean  # APE's positions
    scaling = ChunkScaling(start=2, stop=20, temperature=0.5, scale=0.9, row_positions=torch.arange(PROMPT + 16))
    assert not TokenDecoder(lm, cache, logits, PROMPT, max_new_tokens=4, chunk_scaling=scaling).lean
    cache.stale_layers = frozenset({1})  # the diagnostic that keeps loaded rows in some layers
    assert not lean.supports(lm.model, cache)


@pytest.mark.parametrize("method", ["full", "cacheclip"])
def test_answers_equal_with_the_lean_step_off(make_engine, monkeypatch, method):
    engine = make_engine(tiny_model("qwen2"))
    options = RequestOptions(method=method, max_new_tokens=10)
    stream = engine.stream(QUESTION, CHUNKS, options)
    lean_answer = list(stream)
    assert stream.decoder.lean
    monkeypatch.setattr("cacheclip_rag.stages.decode.decoder.supports", lambda model, cache: False)
    stream = engine.stream(QUESTION, CHUNKS, options)
    assert list(stream) == lean_answer and not stream.decoder.lean


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_batched_steps_equal_the_packed_forward_bit_for_bit(arch):
    lm = tiny_model(arch)
    model, config = lm.model, lm.model.config
    references, caches, tokens, rows = [], [], [5, 9, 13], []
    for b, length in enumerate((12, 31, 40)):  # ragged: each request's cache of its own length
        cache = BlendedCache.empty(config.num_hidden_layers, 1, config.num_key_value_heads, 48,
                                   config.hidden_size // config.num_attention_heads, dtype=torch.float32, device="cpu")
        forward_at(model, cache, (torch.arange(length) * (b + 2) % 97 + 3)[None], torch.arange(length)[None])
        references.append(cache)
        caches.append(cache.copy())
        rows.append(length)
    for _ in range(3):
        requests = [RowsRequest(c, torch.tensor([t]), torch.tensor([r])) for c, t, r in zip(references, tokens, rows)]
        expected = batching._forward_packed(model, requests)
        assert all(batching._plain_step(model, r) for r in requests)
        got = lean.decode_steps(model, caches, tokens, rows)
        for b in range(3):
            assert torch.equal(got[b], expected[b])
            assert torch.equal(caches[b].key_buffer, references[b].key_buffer)
            assert torch.equal(caches[b].value_buffer, references[b].value_buffer)
        tokens, rows = [int(x.argmax()) for x in expected], [r + 1 for r in rows]
    # a request of two rows is not a plain step: the whole batch takes the packed forward
    two_rows = RowsRequest(references[0], torch.tensor([3, 4]), torch.tensor([rows[0], rows[0] + 1]))
    assert not batching._plain_step(model, two_rows)
