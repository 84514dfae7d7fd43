"""One forward for several requests over their own caches (`batching.forward_rows`): it writes and answers
exactly as `forward_at` run request by request, for ragged row counts, scattered rows (a recompute),
decode steps and every tiny architecture (sliding windows included); greedy decoding batched step by step
gives the same tokens as decoding each request alone."""

import pytest
import torch

from cacheclip_rag.stages.decode.batching import RowsRequest, forward_rows
from cacheclip_rag.stages.decode.decoder import TokenDecoder
from cacheclip_rag.stages.load.ingest import new_cache
from cacheclip_rag.stages.recompute.forward import forward_at
from cacheclip_rag.testing import tiny_model

ARCHS = ("llama", "qwen2", "gemma3")


def prefilled(lm, length: int, capacity: int, seed: int):
    """A cache holding a random `length`-token prompt, and the prompt's next-token logits."""
    ids = torch.randint(5, lm.model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
    cache = new_cache(lm, capacity)
    logits = forward_at(lm.model, cache, ids, torch.arange(length)[None])[0, -1]
    return cache, logits


def reference(lm, requests):
    """forward_at on a copy of each request's cache, one request after another."""
    out = []
    for r in requests:
        cache = r.cache.copy()
        logits = forward_at(lm.model, cache, r.input_ids[None], r.positions[None], slots=r.slots)[0, -1]
        out.append((logits, cache))
    return out


def requests_of(lm, spec, seed=0):
    """spec: (prompt length, rows written, whether the rows are scattered inside the prompt) per request."""
    g = torch.Generator().manual_seed(seed)
    requests = []
    for i, (length, rows, scattered) in enumerate(spec):
        cache, _ = prefilled(lm, length, length + 8, seed + i)
        if scattered:  # a recompute: some prompt rows rewritten, then the rows after the prompt
            inside = torch.randperm(length, generator=g)[: rows // 2].sort().values
            positions = torch.cat([inside, torch.arange(length, length + rows - inside.numel())])
        else:
            positions = torch.arange(length, length + rows)
        ids = torch.randint(5, lm.model.config.vocab_size, (positions.numel(),), generator=g)
        requests.append(RowsRequest(cache, ids, positions))
    return requests


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("spec", [
    [(9, 1, False), (23, 1, False), (16, 1, False)],  # decode steps over caches of three lengths
    [(9, 1, False), (30, 6, False), (14, 3, False)],  # ragged row counts (segments of different sizes)
    [(20, 8, True), (12, 4, True), (25, 1, False)],  # scattered recompute rows beside a decode step
])
def test_a_batched_forward_equals_each_request_alone(arch, spec):
    lm = tiny_model(arch)
    requests = requests_of(lm, spec)
    expected = reference(lm, requests)
    got = forward_rows(lm.model, requests)
    for r, logits, (want_logits, want_cache) in zip(requests, got, expected):
        torch.testing.assert_close(logits, want_logits, rtol=1e-4, atol=1e-5)
        # every row the request wrote matches, and no other row changed
        torch.testing.assert_close(r.cache.key_buffer, want_cache.key_buffer, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(r.cache.value_buffer, want_cache.value_buffer, rtol=1e-4, atol=1e-5)


def test_rows_outside_the_slots_are_left_exactly_as_they_were():
    lm = tiny_model("gemma3")
    requests = requests_of(lm, [(10, 1, False), (18, 5, False)])
    before = [(r.cache.key_buffer.clone(), r.cache.value_buffer.clone()) for r in requests]
    forward_rows(lm.model, requests)
    for r, (keys, values) in zip(requests, before):
        untouched = torch.ones(r.cache.capacity, dtype=torch.bool)
        untouched[r.rows] = False
        assert torch.equal(r.cache.key_buffer[:, :, :, untouched], keys[:, :, :, untouched])
        assert torch.equal(r.cache.value_buffer[:, :, :, untouched], values[:, :, :, untouched])
        assert not torch.equal(r.cache.key_buffer[:, :, :, r.rows], keys[:, :, :, r.rows])


def test_bad_batches_are_refused_before_any_forward():
    lm = tiny_model("llama")
    cache, _ = prefilled(lm, 8, 12, 0)
    one = RowsRequest(cache, torch.tensor([7]), torch.tensor([8]))
    with pytest.raises(ValueError, match="at least one request"):
        forward_rows(lm.model, [])
    with pytest.raises(ValueError, match="share a cache"):
        forward_rows(lm.model, [one, RowsRequest(cache, torch.tensor([5]), torch.tensor([9]))])
    with pytest.raises(ValueError, match="beyond the cache capacity"):
        forward_rows(lm.model, [RowsRequest(cache, torch.tensor([7]), torch.tensor([12]))])
    with pytest.raises(ValueError, match="must match"):
        RowsRequest(cache, torch.tensor([7, 8]), torch.tensor([8]))
    with pytest.raises(ValueError, match="non-empty"):
        RowsRequest(cache, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    other = tiny_model("gemma3")
    with pytest.raises(ValueError, match="layers"):
        forward_rows(other.model, [one])


def drive(decoders, batched: bool) -> list[list[int]]:
    """Every decoder to its end: one token each per round, the round's forwards batched or one by one."""
    out: list[list[int]] = [[] for _ in decoders]
    live = list(range(len(decoders)))
    while live:
        if batched:
            waiting = [i for i in live if decoders[i].pending() is not None]
            if waiting:
                logits = forward_rows(decoders[0].lm.model, [decoders[i].pending() for i in waiting])
                for i, row in zip(waiting, logits):
                    decoders[i].provide(row)
        for i in list(live):
            token = next(decoders[i], None)
            if token is None:
                live.remove(i)
            else:
                out[i].append(token)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_greedy_decoding_gives_each_request_its_own_tokens(arch):
    lm = tiny_model(arch)
    lengths, budgets = (7, 19, 12), (9, 4, 12)

    def decoders():
        made = []
        for i, (length, budget) in enumerate(zip(lengths, budgets)):
            cache, logits = prefilled(lm, length, length + budget, 10 + i)
            made.append(TokenDecoder(lm, cache, logits, length, max_new_tokens=budget))
        return made

    alone, together = drive(decoders(), batched=False), drive(decoders(), batched=True)
    assert together == alone
    assert all(len(t) == b or t[-1] in lm.eos_token_ids for t, b in zip(alone, budgets))  # each ran to its own end


def test_a_decoder_takes_provided_logits_once_and_only_when_a_forward_is_pending():
    lm = tiny_model("llama")
    cache, logits = prefilled(lm, 6, 10, 3)
    decoder = TokenDecoder(lm, cache, logits, 6, max_new_tokens=4)
    assert decoder.pending() is None  # the first token's logits came with the prefill
    with pytest.raises(RuntimeError, match="no forward is pending"):
        decoder.provide(logits)
    first = next(decoder)
    step = decoder.pending()
    assert step.input_ids.tolist() == [first] and step.rows.tolist() == [6]
    decoder.provide(forward_rows(lm.model, [step])[0])
    assert decoder.pending() is None
    next(decoder)
    assert decoder.pending().rows.tolist() == [7]
