"""Chunk KV caches: precomputed behind the shared prefix (or alone, for `direct`) and stored at
ingest; fetched for a request, and computed there where missing (`fetch_or_compute`, `load_into`:
the miss path of every request, in one place)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch
from tqdm.auto import tqdm

from ..cache import BlendedCache
from ...config import check_text
from ...models.loading import LoadedModel, resolve_dtype
from ..recompute.forward import forward_at
from ...store import (STORE_DTYPES, ChunkEntry, EntryView, KVStore, Slot, StoreFullError, as_stored, encode_entry,
                    entry_key, parse_entry)

log = logging.getLogger(__name__)
SHARED, DIRECT, PREFIX = "shared", "direct", "prefix"


def validate_chunks(texts: Sequence[str]) -> None:
    if isinstance(texts, (str, bytes)):
        raise TypeError("chunks must be a list of strings, not one string")
    if not isinstance(texts, Sequence):
        raise TypeError(f"chunks must be a list or tuple of strings, got {type(texts).__name__} "
                        "(materialise an iterator with list(...))")
    if len(texts) == 0:
        raise ValueError("no chunks given: pass at least one chunk")
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"chunk {i} is {type(text).__name__}, not str")
        if not text.strip():
            raise ValueError(f"chunk {i} is empty or whitespace only")
        check_text(f"chunk {i}", text)


def kv_layout(lm: LoadedModel) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model's cache."""
    config = lm.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, head_dim


def new_cache(lm: LoadedModel, length: int, batch: int = 1, dtype: torch.dtype | None = None) -> BlendedCache:
    """An empty cache for `lm` in its dtype (or `dtype`: another module running over its layout)."""
    layers, kv_heads, head_dim = kv_layout(lm)
    return BlendedCache.empty(layers, batch, kv_heads, length, head_dim, dtype=dtype or lm.dtype, device=lm.device)


@dataclass(frozen=True)
class PrefixCache:
    """The shared prefix: its token ids and KV [L, KV, P, D]."""

    token_ids: tuple[int, ...]
    keys: torch.Tensor
    values: torch.Tensor
    read: bool = True  # read from the store (False: computed by this request)


@dataclass(frozen=True)
class Loaded:
    """What a load placed: the prefix, and per chunk whether its cache was read (False: computed now)."""

    prefix: PrefixCache
    read: tuple[bool, ...]


def chunk_unit(lm: LoadedModel, text: str, bare: bool = False) -> str:
    """The text a chunk contributes to the prompt: the chunk and its separator (`bare`: the chunk alone,
    as found in a prompt where something else follows it)."""
    return text if bare else text + lm.prompt.chunk_separator


def unit_key(lm: LoadedModel, prefix_ids: Sequence[int], unit: str, variant: str) -> bytes:
    return entry_key(lm.fingerprint.digest, prefix_ids if variant == SHARED else (), unit, variant)


def chunk_key(lm: LoadedModel, prefix_ids: Sequence[int], text: str, variant: str, bare: bool = False) -> bytes:
    return unit_key(lm, prefix_ids, chunk_unit(lm, text, bare), variant)


@dataclass(frozen=True)
class FormattedPrefix:
    """A shared prefix given as the exact text that starts the prompt (a prompt a client sent), rather
    than a system prompt to lay out with the model's template."""

    text: str


def prefix_text(lm: LoadedModel, system_prompt: str | FormattedPrefix) -> str:
    return system_prompt.text if isinstance(system_prompt, FormattedPrefix) else lm.prompt.prefix(system_prompt)


def fetch(lm: LoadedModel, store: KVStore, keys: list[bytes]) -> list[ChunkEntry | None]:
    """Stored entries for `keys` on the model's device, each checked against the model's cache layout
    (layers, kv heads, head dim): an entry of another layout (a buggy writer, a crafted store) is
    quarantined and reported missing, so it is recomputed rather than zipped short or misread."""
    layers, kv_heads, head_dim = kv_layout(lm)
    found = store.get_many(keys, lm.fingerprint.digest, lm.device)
    for i, (key, entry) in enumerate(zip(keys, found)):
        if entry is None:
            continue
        l, kv, _, d = entry.keys.shape
        if (l, kv, d) != (layers, kv_heads, head_dim):
            store.quarantine(key, f"layout [L={l}, KV={kv}, D={d}] is not {lm.name}'s "
                                  f"[L={layers}, KV={kv_heads}, D={head_dim}]")
            found[i] = None
    return found


def prefix_ids(lm: LoadedModel, system_prompt: str | FormattedPrefix) -> list[int]:
    """The shared prefix's token ids, refused (before any model work) where they leave no room in the context."""
    ids = lm.encode_prefix(prefix_text(lm, system_prompt))
    if len(ids) >= lm.max_context:
        raise ValueError(f"the shared prefix (system prompt) is {len(ids)} tokens: {lm.name}'s context of "
                         f"{lm.max_context} tokens leaves no room for a chunk behind it")
    return ids


def prefix_cache(lm: LoadedModel, store: KVStore, system_prompt: str | FormattedPrefix,
                 ids: Sequence[int] | None = None) -> PrefixCache:
    """The shared prefix's KV (its token `ids`, given where already encoded), computed once per (model, prefix)
    and stored (served unstored when the store is full)."""
    ids = list(prefix_ids(lm, system_prompt) if ids is None else ids)
    key = entry_key(lm.fingerprint.digest, ids, "", PREFIX)
    entry = fetch(lm, store, [key])[0]
    if entry is not None and entry.token_ids != tuple(ids):
        store.quarantine(key, "prefix entry holds other token ids than its key's prefix")
        entry = None
    read = entry is not None
    if entry is None:
        cache = new_cache(lm, len(ids))
        positions = torch.arange(len(ids))[None]
        forward_at(lm.model, cache, torch.tensor([ids]), positions)
        keys, values = cache.rows(0, len(ids))
        entry = ChunkEntry(keys.clone(), values.clone(), tuple(ids), ())
        _store_or_serve(store, [(key, lm.fingerprint.digest, entry)])
    return PrefixCache(tuple(ids), entry.keys, entry.values, read)


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


def storage_dtype(setting: str, lm: LoadedModel) -> torch.dtype:
    """The dtype `lm`'s chunk caches are stored in: "auto" is the model's dtype on CUDA and for a 16-bit
    model, float16 for a float32 model on the CPU (half the bytes, a first-token KL cost measured in
    bench/RESULTS.md); else the named one."""
    if setting != "auto":
        return resolve_dtype(setting, lm.device, STORE_DTYPES)
    return lm.dtype if lm.device.type == "cuda" or lm.dtype.itemsize == 2 else torch.float16


def precompute(
    lm: LoadedModel,
    store: KVStore,
    texts: Sequence[str],
    system_prompt: str | FormattedPrefix,
    *,
    variant: str = SHARED,
    batch_size: int = 4,
    progress: bool = True,
    store_dtype: torch.dtype | None = None,
    bare: bool = False,
) -> list[bytes]:
    """Compute and store each chunk's KV (behind the shared prefix, or alone for `direct`), in
    `store_dtype` (default: the model's own; see `storage_dtype`). `bare=True` also stores each chunk
    without its separator (how a client's prompt holds the chunk it ends a message with), cut from the
    same forward: attention is causal, so the chunk's rows do not depend on the separator after them
    (a chunk whose own tokens change when the separator follows is left to be computed on first use).

    Idempotent: chunks already stored are not recomputed. Returns the store keys in input order.
    """
    validate_chunks(texts)
    if variant not in (SHARED, DIRECT):
        raise ValueError(f"variant must be {SHARED!r} or {DIRECT!r}, got {variant!r}")
    ids = prefix_ids(lm, system_prompt)
    keys = [chunk_key(lm, ids, t, variant) for t in texts]
    bare_keys = {k: chunk_key(lm, ids, t, variant, bare=True) for k, t in zip(keys, texts)} if bare else {}
    todo = {k: chunk_unit(lm, t) for k, t in zip(keys, texts) if not store.contains(k)}
    todo.update({k: chunk_unit(lm, t) for k, t in zip(keys, texts) if k in bare_keys and not store.contains(bare_keys[k])})
    texts_of = dict(zip(keys, texts))
    # every size is checked before any model work: the prefix above, each chunk behind it here
    encoded = _encode_units(lm, list(todo.values()), len(ids) if variant == SHARED else 0)
    prefix = prefix_cache(lm, store, system_prompt, ids)
    for batch, entries in _computed(lm, prefix, list(todo.items()), encoded, variant=variant, batch_size=batch_size,
                                    store_dtype=store_dtype, progress=progress):
        items = [(k, lm.fingerprint.digest, e) for (k, _), e in zip(batch, entries)]
        items += [(bare_keys[k], lm.fingerprint.digest, cut) for (k, _), e in zip(batch, entries) if k in bare_keys
                  for cut in [without_separator(lm, texts_of[k], e)] if cut is not None]
        store.put_many(items)
    store.record_entries([(t, [k, *([bare_keys[k]] if k in bare_keys else [])]) for k, t in zip(keys, texts)])
    return keys


def without_separator(lm: LoadedModel, text: str, entry: ChunkEntry) -> ChunkEntry | None:
    """The entry of `text` alone, cut from the entry of `text` + separator, when its tokens are a prefix."""
    ids, offsets = lm.encode_with_offsets(text)
    n = len(ids)
    if not ids or tuple(ids) != entry.token_ids[:n] or tuple(offsets) != entry.offsets[:n]:
        return None
    return replace(entry, keys=entry.keys[:, :, :n].clone(), values=entry.values[:, :, :n].clone(),
                   token_ids=tuple(ids), offsets=tuple(offsets))


def _computed(lm: LoadedModel, prefix: PrefixCache, todo: list[tuple[bytes, str]], encoded: list[Encoded] | None = None,
              *, variant: str, batch_size: int, store_dtype: torch.dtype | None,
              progress: bool) -> Iterator[tuple[list[tuple[bytes, str]], list[ChunkEntry]]]:
    """(batch of (key, unit), their entries in the storage dtype), a batch at a time; `encoded`: the units'
    tokens, where already encoded (and checked)."""
    behind = prefix if variant == SHARED else None
    if encoded is None:
        encoded = _encode_units(lm, [u for _, u in todo], len(behind.token_ids) if behind else 0)
    bar = tqdm(total=len(todo), desc=f"precompute {lm.name} ({variant})", unit="chunk", disable=not progress)
    for i in range(0, len(todo), batch_size):
        batch = todo[i : i + batch_size]
        entries = [replace(as_stored(e, store_dtype), model=lm.name)
                   for e in _compute_batch(lm, behind, encoded[i : i + batch_size])]
        yield batch, entries
        bar.update(len(batch))
    bar.close()


_full_warned: set[str] = set()


def _store_or_serve(store: KVStore, items: list[tuple[bytes, str, ChunkEntry]]) -> None:
    """Store what a request computed; a full store (its cap, or the disk) must not fail the request:
    the entries are served unstored, and the first such miss per store is logged."""
    try:
        store.put_many(items)
    except StoreFullError as err:
        where = str(getattr(store, "path", store))
        if where not in _full_warned:
            _full_warned.add(where)
            log.warning("store %s is full: chunk caches computed for requests are served but not stored "
                        "(evict or raise the cap to reuse them): %s", where, err)


def compute_missing(lm: LoadedModel, store: KVStore, prefix: PrefixCache, missing: dict[bytes, str], *, variant: str,
                     batch_size: int, store_dtype: torch.dtype | None,
                     texts_of: dict[bytes, str] | None = None) -> dict[bytes, EntryView]:
    """The missing chunks (key -> unit) computed and stored, each as the bytes the store holds (so a
    request served from a miss sees exactly what later requests read back); each recorded as computed from
    its text (`texts_of`: key -> text), so deleting an owned text deletes it too."""
    views: dict[bytes, EntryView] = {}
    fingerprint = lm.fingerprint.digest
    for batch, entries in _computed(lm, prefix, list(missing.items()), variant=variant, batch_size=batch_size,
                                    store_dtype=store_dtype, progress=False):
        _store_or_serve(store, [(k, fingerprint, e) for (k, _), e in zip(batch, entries)])
        for (k, _), e in zip(batch, entries):
            views[k] = parse_entry(encode_entry(fingerprint, e, k), fingerprint, k, checked=True)
    if texts_of:
        store.record_entries([(texts_of[k], [k]) for k in missing if k in texts_of])
    return views


def read_or_compute(lm: LoadedModel, store: KVStore, texts: Sequence[str], read: Callable[[list[bytes]], list], *,
                    variant: str, system_prompt: str | FormattedPrefix, batch_size: int = 4,
                    store_dtype: torch.dtype | None = None, bare: Sequence[bool] | None = None,
                    token_ids: Sequence[Sequence[int]] | None = None) -> tuple[PrefixCache, list[bytes], list, dict]:
    """The one request-time load every loader shares: the prefix, each chunk's key, what `read(keys)` found
    (an intact entry whose tokens are not `token_ids[i]`, another chunk's under this key or a changed
    tokenizer, is quarantined and counts as missing), and the misses computed and stored, as views by key.
    `bare[i]`: chunk i without its separator (`chunk_unit`)."""
    prefix = prefix_cache(lm, store, system_prompt)
    units = [chunk_unit(lm, t, b) for t, b in zip(texts, bare or [False] * len(texts))]
    keys = [unit_key(lm, prefix.token_ids, u, variant) for u in units]
    found = read(keys)
    for i, (key, entry) in enumerate(zip(keys, found)):
        if token_ids is not None and entry is not None and entry.token_ids != tuple(token_ids[i]):
            store.quarantine(key, "its token ids are not those of the text its key names")
            found[i] = None
    missing = {k: u for k, u, e in zip(keys, units, found) if e is None}
    views = compute_missing(lm, store, prefix, missing, variant=variant, batch_size=batch_size, store_dtype=store_dtype,
                            texts_of=dict(zip(keys, texts))) if missing else {}
    return prefix, keys, found, views


def fetch_or_compute(lm: LoadedModel, store: KVStore, texts: Sequence[str], *, variant: str,
                     system_prompt: str | FormattedPrefix, batch_size: int = 4, store_dtype: torch.dtype | None = None,
                     bare: Sequence[bool] | None = None) -> tuple[PrefixCache, list[ChunkEntry]]:
    """The prefix and each chunk's entry (new tensors on the model's device): read, or computed,
    stored and served where missing."""
    prefix, keys, found, views = read_or_compute(lm, store, texts, lambda keys: fetch(lm, store, keys), variant=variant,
                                                 system_prompt=system_prompt, batch_size=batch_size,
                                                 store_dtype=store_dtype, bare=bare)
    return prefix, [views[k].decode(lm.device) if e is None else e for k, e in zip(keys, found)]


def load_into(lm: LoadedModel, store: KVStore, *, texts: Sequence[str], token_ids: Sequence[Sequence[int]],
              slots: Sequence[Slot], variant: str, system_prompt: str | FormattedPrefix, batch_size: int = 4,
              store_dtype: torch.dtype | None = None, bare: Sequence[bool] | None = None) -> Loaded:
    """Each chunk's cache decoded straight into `slots[i]` (views of the request's blended cache), the
    misses computed, stored and placed (`read_or_compute`)."""
    prefix, keys, found, views = read_or_compute(
        lm, store, texts, lambda keys: store.read_into(keys, lm.fingerprint.digest, slots), variant=variant,
        system_prompt=system_prompt, batch_size=batch_size, store_dtype=store_dtype, bare=bare, token_ids=token_ids)
    for key, entry, slot in zip(keys, found, slots):
        if entry is None:
            views[key].copy_into(slot)
    return Loaded(prefix, tuple(e is not None for e in found))
