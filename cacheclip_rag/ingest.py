"""Precomputing chunk KV caches behind the shared prefix (or alone, for `direct`) and storing them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from .cache import BlendedCache
from .models import LoadedModel
from .recompute import forward_at
from .store import ChunkEntry, LMDBStore, entry_key

SHARED, DIRECT, PREFIX = "shared", "direct", "prefix"


def validate_chunks(texts: Sequence[str]) -> None:
    if isinstance(texts, str):
        raise TypeError("chunks must be a list of strings, not one string")
    if len(texts) == 0:
        raise ValueError("no chunks given: pass at least one chunk")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"chunk {i} is {type(text).__name__}, not str")
        if not text.strip():
            raise ValueError(f"chunk {i} is empty or whitespace only")


def kv_layout(lm: LoadedModel) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model's cache."""
    config = lm.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def new_cache(lm: LoadedModel, length: int, batch: int = 1) -> BlendedCache:
    layers, kv_heads, head_dim = kv_layout(lm)
    return BlendedCache.empty(layers, batch, kv_heads, length, head_dim, lm.dtype, lm.device)


@dataclass(frozen=True)
class PrefixCache:
    """The shared prefix: its token ids and KV [L, KV, P, D]."""

    token_ids: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor


def chunk_unit(lm: LoadedModel, text: str) -> str:
    """The text a chunk contributes to the prompt: the chunk and its separator."""
    return text + lm.prompt.chunk_separator


def chunk_key(lm: LoadedModel, prefix_ids: Sequence[int], text: str, variant: str) -> bytes:
    return entry_key(lm.fingerprint.digest, prefix_ids if variant == SHARED else (), chunk_unit(lm, text), variant)


def prefix_cache(lm: LoadedModel, store: LMDBStore, system_prompt: str) -> PrefixCache:
    """The shared prefix's KV, computed once per (model, prefix) and stored."""
    ids = lm.encode_prefix(lm.prompt.prefix(system_prompt))
    key = entry_key(lm.fingerprint.digest, ids, "", PREFIX)
    entry = store.get(key, lm.fingerprint.digest, lm.device)
    if entry is None:
        cache = new_cache(lm, len(ids))
        positions = torch.arange(len(ids))[None]
        forward_at(lm.model, cache, torch.tensor([ids]), positions)
        keys, values = cache.rows(0, len(ids))
        entry = ChunkEntry(keys.clone(), values.clone(), tuple(ids), ())
        store.put(key, lm.fingerprint.digest, entry)
    return PrefixCache(tuple(ids), entry.keys, entry.values)


Encoded = tuple[list[int], list[tuple[int, int]]]


def _encode_units(lm: LoadedModel, units: Sequence[str], start: int) -> list[Encoded]:
    """Token ids and offsets of each unit, checked to fit the context behind `start` prefix tokens."""
    encoded = [lm.encode_with_offsets(u) for u in units]
    for i, (ids, _) in enumerate(encoded):
        if not ids:
            raise ValueError(f"chunk {i} encodes to no tokens")
        if start + len(ids) > lm.max_context:
            raise ValueError(
                f"chunk {i} of {len(ids)} tokens behind a prefix of {start} exceeds {lm.name}'s context of "
                f"{lm.max_context} tokens; split it (e.g. chunking.split_tokens)"
            )
    return encoded


def _compute_batch(lm: LoadedModel, prefix: PrefixCache | None, encoded: list[Encoded]) -> list[ChunkEntry]:
    """Prefill a right-padded batch of chunks behind `prefix` (or alone) and cut out each chunk's rows."""
    start = 0 if prefix is None else len(prefix.token_ids)
    longest = max(len(ids) for ids, _ in encoded)
    cache = new_cache(lm, start + longest, batch=len(encoded))
    if prefix is not None:
        for layer, k, v in zip(cache.layers, prefix.keys, prefix.values):
            layer.keys[:, :, :start] = k
            layer.values[:, :, :start] = v
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([t + [pad] * (longest - len(t)) for t, _ in encoded])
    positions = torch.arange(start, start + longest).expand(len(encoded), -1)
    forward_at(lm.model, cache, ids, positions)  # right padding: real tokens never see the pads
    entries = []
    for b, (token_ids, offsets) in enumerate(encoded):
        keys, values = cache.rows(start, start + len(token_ids), batch=b)
        entries.append(ChunkEntry(keys.clone(), values.clone(), tuple(token_ids), tuple(offsets)))
    return entries


def precompute(
    lm: LoadedModel,
    store: LMDBStore,
    texts: Sequence[str],
    system_prompt: str,
    variant: str = SHARED,
    batch_size: int = 4,
    progress: bool = True,
) -> list[bytes]:
    """Compute and store each chunk's KV (behind the shared prefix, or alone for `direct`).

    Idempotent: chunks already stored are not recomputed. Returns the store keys in input order.
    """
    validate_chunks(texts)
    if variant not in (SHARED, DIRECT):
        raise ValueError(f"variant must be {SHARED!r} or {DIRECT!r}, got {variant!r}")
    prefix = prefix_cache(lm, store, system_prompt)
    keys = [chunk_key(lm, prefix.token_ids, t, variant) for t in texts]
    todo = list({k: t for k, t in zip(keys, texts) if not store.contains(k)}.items())
    behind = prefix if variant == SHARED else None
    encoded = _encode_units(lm, [chunk_unit(lm, t) for _, t in todo], len(behind.token_ids) if behind else 0)
    bar = tqdm(total=len(todo), desc=f"precompute {lm.name} ({variant})", unit="chunk", disable=not progress)
    for i in range(0, len(todo), batch_size):
        batch = todo[i : i + batch_size]
        entries = _compute_batch(lm, behind, encoded[i : i + batch_size])
        store.put_many([(k, lm.fingerprint.digest, e) for (k, _), e in zip(batch, entries)])
        bar.update(len(batch))
    bar.close()
    return keys
