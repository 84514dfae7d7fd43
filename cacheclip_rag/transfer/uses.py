"""What transfer is for: handing a conversation to another model without re-prefill, and migrating a
chunk store to a new primary."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..stages.recompute.attention import use_cacheclip_attention
from ..stages.load.ingest import SHARED, chunk_key, chunk_unit, new_cache, prefix_cache
from ..models.loading import LoadedModel
from ..stages.recompute.forward import forward_at
from ..store import ChunkEntry
from .mapper import Mapper, transfer_kv

# ---- uses: handing a conversation over, migrating a store ---------------------------------------


def same_tokenizer(a: LoadedModel, b: LoadedModel) -> bool:
    if a.tokenizer is b.tokenizer:
        return True
    return len(a.tokenizer) == len(b.tokenizer) and a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


@dataclass
class Conversation:
    """A running conversation in one model: its text, tokens (with character spans) and KV cache.

    `add` appends text (computed by this model), `reply` decodes greedily, `hand_off` moves the whole
    conversation to another model through a mapper, without re-prefill: the target computes only its
    BOS row and the last token's row (for the next-token logits)."""

    lm: LoadedModel
    capacity: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)
    cache: object = None
    logits: torch.Tensor | None = None

    @classmethod
    def start(cls, lm: LoadedModel, capacity: int = 4096) -> Conversation:
        use_cacheclip_attention(lm.model)
        conv = cls(lm, capacity)
        conv.cache = new_cache(lm, capacity)
        conv._run(lm.encode_prefix(""), 0)
        return conv

    @property
    def start_len(self) -> int:
        return len(self.lm.encode_prefix(""))

    @property
    def length(self) -> int:
        return self.start_len + len(self.ids)

    def _run(self, ids: Sequence[int], at: int) -> None:
        if not ids:
            return
        if at + len(ids) > self.capacity:
            raise ValueError(f"conversation of {at + len(ids)} tokens exceeds its capacity of {self.capacity}")
        self.logits = forward_at(self.lm.model, self.cache, torch.tensor([list(ids)]),
                                 torch.arange(at, at + len(ids))[None])[0, -1]

    def add(self, text: str) -> None:
        ids, offsets = self.lm.encode_with_offsets(text)
        at, shift = self.length, len(self.text)
        self._run(ids, at)
        self.ids += ids
        self.offsets += [(a + shift, b + shift) for a, b in offsets]
        self.text += text

    def reply(self, max_new_tokens: int = 32, stop: Sequence[str] = ("\n",)) -> str:
        """Greedy continuation, appended to the conversation."""
        produced: list[int] = []
        text = ""
        for _ in range(max_new_tokens):
            assert self.logits is not None
            token = int(self.logits.argmax())
            if token in self.lm.eos_token_ids:
                break
            self._run([token], self.length)
            produced.append(token)
            before, text = text, self.lm.tokenizer.decode(produced)
            self.ids.append(token)
            self.offsets.append((len(self.text) + len(before), len(self.text) + len(text)))
            if any(s in text for s in stop):
                break
        self.text += text
        return text

    def hand_off(self, target: LoadedModel, mapper: Mapper, force: bool = False) -> Conversation:
        """The same conversation in `target`, its cache mapped from this one's."""
        mapper.check(self.lm, target, force)
        nxt = Conversation.start(target, self.capacity)
        if same_tokenizer(self.lm, target):  # keep the very tokens (turn boundaries, generated ones)
            ids, offsets = list(self.ids), list(self.offsets)
        else:
            ids, offsets = target.encode_with_offsets(self.text)
        if not ids:
            return nxt
        keys, values = self.cache.rows(self.start_len, self.length)
        at = nxt.start_len
        mk, mv = transfer_kv(mapper, self.lm, target, keys=keys, values=values,
                             source_positions=torch.arange(self.start_len, self.length), source_offsets=self.offsets,
                             target_offsets=offsets, target_positions=torch.arange(at, at + len(ids)),
                             text_length=len(self.text), force=True)
        nxt.cache.place(at, mk, mv)
        nxt.ids, nxt.offsets, nxt.text = list(ids), list(offsets), self.text
        nxt._run(ids[-1:], at + len(ids) - 1)  # the last row, exactly, for the next-token logits
        return nxt


@dataclass(frozen=True)
class MigrationReport:
    moved: int
    already_present: int
    missing: int  # no source entry for the text: computed by the target on first use
    weakest_key_r2: float
    weakest_value_r2: float
    seconds: float


def migrate(store, source: LoadedModel, target: LoadedModel, mapper: Mapper, texts: Sequence[str],
            system_prompt: str, force: bool = False, progress: bool = True) -> MigrationReport:
    """Write the target's shared-prefix chunk entries for `texts`, mapped from the source's stored ones.
    (Direct-variant entries are not migrated; the engine computes them on first use.)"""
    mapper.check(source, target, force)
    started = time.perf_counter()
    src_prefix = prefix_cache(source, store, system_prompt)
    tgt_prefix = prefix_cache(target, store, system_prompt)
    p_src, p_tgt = len(src_prefix.token_ids), len(tgt_prefix.token_ids)
    moved = present = missing = 0
    for text in tqdm(texts, desc=f"migrate {source.name}->{target.name}", unit="chunk", disable=not progress):
        target_key = chunk_key(target, tgt_prefix.token_ids, text, SHARED)
        if store.contains(target_key):
            present += 1
            continue
        entry = store.get(chunk_key(source, src_prefix.token_ids, text, SHARED), source.fingerprint.digest)
        if entry is None:
            missing += 1
            continue
        unit = chunk_unit(target, text)
        ids, offsets = target.encode_with_offsets(unit)
        keys, values = transfer_kv(
            mapper, source, target, keys=entry.keys, values=entry.values,
            source_positions=torch.arange(p_src, p_src + entry.num_tokens), source_offsets=entry.offsets,
            target_offsets=offsets, target_positions=torch.arange(p_tgt, p_tgt + len(ids)), text_length=len(unit),
            force=True,
        )
        store.put(target_key, target.fingerprint.digest, ChunkEntry(keys, values, tuple(ids), tuple(offsets)))
        moved += 1
    return MigrationReport(moved=moved, already_present=present, missing=missing,
                           weakest_key_r2=min(mapper.validation["key_r2"]),
                           weakest_value_r2=min(mapper.validation["value_r2"]), seconds=time.perf_counter() - started)
