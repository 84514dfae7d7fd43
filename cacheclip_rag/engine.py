"""The reuse engine: one prefix, chunks at contiguous positions, selective recompute, decode.

A request reads as the algorithm: plan -> load (+ select, overlapped) -> group -> recompute -> decode.
Each method is a prefill function `(engine, plan, options) -> Prefill` (`methods`); the engine holds
the models and the store and the building blocks the methods share.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from .align import map_selection
from .attention import SelectedRowsKernel, use_cacheclip_attention
from .cache import BlendedCache
from .config import EngineConfig, RequestOptions, is_redis_url
from .decode import TokenDecoder, text_deltas
from .group import grouped_to_budget
from .ingest import (DIRECT, SHARED, FormattedPrefix, PrefixCache, chunk_key, chunk_unit, fetch_or_compute, load_into,
                     new_cache, precompute, storage_dtype)
from .layerwise import LayerStream, cuda_layer_stream, load_layerwise
from .models import LoadedModel, int8_scorer, layer_types, load_model
from .recompute import forward_at, recompute
from .rope import rotate_keys_
from .methods import PREFILLS, side_stream
from .planning import plan_chunks, plan_layout
from .recognize import Layout, StoreIndex, layout
from .request import Answer, Plan, Prefill, Stream, Timings
from .select import aux_scores, boundary_selection, question_tokens, top_k_candidates
from .store import ChunkEntry, KVStore, LMDBStore, tally_reads
from .tier import DeviceTier, HostTier

__all__ = ["Answer", "Engine", "Plan", "Prefill", "Stream", "Timings", "default_kernel", "open_store"]


@dataclass
class Engine:
    """Primary model, optional aux model, and the store, with the request path over them."""

    primary: LoadedModel
    store: KVStore  # LMDBStore, RedisStore, TieredStore, and the HostTier / DeviceTier in front of them
    config: EngineConfig = field(default_factory=EngineConfig)
    aux: LoadedModel | None = None
    # "auto": the Triton selected-rows kernel on CUDA (a warning if Triton is missing), SDPA elsewhere;
    # None: always SDPA with position masks
    kernel: SelectedRowsKernel | None | str = "auto"
    # the stream a layer-wise load runs on (behind a host tier): CUDA's by default, none on a CPU
    layer_stream: Callable[[LoadedModel], LayerStream | None] = cuda_layer_stream

    def __post_init__(self) -> None:
        if self.kernel == "auto":
            self.kernel = default_kernel(self.primary)
        elif isinstance(self.kernel, str):
            raise ValueError(f"kernel must be 'auto', None or a callable, got {self.kernel!r}")
        use_cacheclip_attention(self.primary.model)
        if self.aux is not None:
            use_cacheclip_attention(self.aux.model)
        self.aux_scorer = None  # the module the aux's selection pass runs (its int8 copy when configured)
        if self.aux is not None and self.config.aux_quantization == "int8":
            if self.aux.device.type != "cpu":
                raise ValueError("aux_quantization='int8' needs the aux on the CPU")
            self.aux_scorer = int8_scorer(self.aux.model)

    @classmethod
    def from_config(cls, config: EngineConfig) -> Engine:
        primary = load_model(config.primary, device=config.device, dtype=config.dtype)
        aux = None
        if config.aux is not None:
            aux = primary if config.aux == config.primary and config.aux_device == config.device else load_model(
                config.aux, device=config.aux_device, dtype=config.dtype
            )
        store = open_store(config.store_path, config.shared_store)
        if config.host_cache_bytes:
            store = HostTier(store, config.host_cache_bytes)
        if config.device_cache_bytes:
            store = DeviceTier(store, primary.device, config.device_cache_bytes)
        return cls(primary=primary, store=store, config=config, aux=aux)

    # ---- ingest ------------------------------------------------------------------------------

    def ingest(self, texts: Sequence[str], progress: bool = True, direct: bool = False,
               system_prompt: str | FormattedPrefix | None = None, bare: bool = False) -> list[bytes]:
        """Precompute and store every chunk for the primary (behind the shared prefix) and the aux;
        `direct=True` also stores the chunks computed alone (only the `direct` baseline reads them,
        and it computes them on a miss anyway). `system_prompt`: the prefix to compute behind (default
        the engine's; a FormattedPrefix: the exact text a client's prompt starts with, for `serve`);
        `bare=True` also stores each chunk as it ends a message (without the separator)."""
        prefix = system_prompt or self.config.system_prompt
        keys = precompute(self.primary, self.store, texts, prefix, SHARED,
                          self.config.ingest_batch_size, progress, self.store_dtype(self.primary), bare)
        if direct:
            precompute(self.primary, self.store, texts, prefix, DIRECT,
                       self.config.ingest_batch_size, progress, self.store_dtype(self.primary))
        if self.aux is not None:
            precompute(self.aux, self.store, texts, prefix, SHARED,
                       self.config.ingest_batch_size, progress, self.store_dtype(self.aux), bare)
        self.store.remember_texts(texts)  # a server finds these texts inside its clients' prompts
        return keys

    def chunk_keys(self, text: str, system_prompt: str | None = None) -> list[bytes]:
        """Every key a chunk's caches can be stored under: the primary's (behind the shared prefix, and
        alone for `direct`) and the aux's."""
        system_prompt = system_prompt or self.config.system_prompt
        keys = []
        for lm, variants in ((self.primary, (SHARED, DIRECT)), (self.aux, (SHARED,))):
            if lm is None:
                continue
            prefix_ids = lm.encode_prefix(lm.prompt.prefix(system_prompt))
            keys += [chunk_key(lm, prefix_ids, text, variant) for variant in variants]
        return list(dict.fromkeys(keys))

    def retain(self, owner: str, text: str, group: str | None = None) -> None:
        """Record that `owner` (a framework's node) uses `text`'s caches, inside `group` (its document)."""
        self.store.retain(owner, self.chunk_keys(text), group)

    def owners_of(self, group: str) -> list[str]:
        """The owners `retain` recorded in `group` (a document's nodes)."""
        return self.store.owners_of(group)

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> int:
        """Forget `owners` (or every owner in `group`); caches no other owner uses are deleted. Returns
        how many entries went."""
        return len(self.store.release(owners, group))

    def store_dtype(self, lm: LoadedModel) -> torch.dtype:
        """The dtype `lm`'s chunk caches are stored in (see `EngineConfig.store_dtype`)."""
        return storage_dtype(self.config.store_dtype, lm)

    def entries(self, lm: LoadedModel, texts: Sequence[str], variant: str, system_prompt: object = None,
                bare: Sequence[bool] | None = None) -> tuple[PrefixCache, list[ChunkEntry]]:
        """Stored entries for `texts` behind `system_prompt` (default the engine's; or a FormattedPrefix);
        a miss is computed, stored and used."""
        return fetch_or_compute(lm, self.store, texts, variant, system_prompt or self.config.system_prompt,
                                self.config.ingest_batch_size, self.store_dtype(lm), bare)

    # ---- request path ------------------------------------------------------------------------

    def plan(self, question: str, texts: Sequence[str], options: RequestOptions) -> Plan:
        """The engine's own layout of a request: prefix, each chunk with its separator, the question."""
        return plan_chunks(self.primary, question, texts, options, options.system_prompt or self.config.system_prompt)

    def stream(self, question: str, texts: Sequence[str], options: RequestOptions | None = None) -> Stream:
        """Answer `question` over `texts`; iterate the result for text pieces as they decode."""
        options = options or RequestOptions()
        started = time.perf_counter()
        return self.stream_plan(self.plan(question, texts, options), options, started)

    def stream_plan(self, plan: Plan, options: RequestOptions, started: float | None = None) -> Stream:
        """Answer a planned request (`plan`, `plan_layout`); TTFT counts from `started` (default: now)."""
        started = time.perf_counter() if started is None else started
        return self.decode(plan, self.run_prefill(plan, options), options, started)

    def prefill(self, question: str, texts: Sequence[str], options: RequestOptions) -> tuple[Plan, Prefill]:
        """The request's prompt layout and its method's prefill (cache and first-token logits)."""
        plan = self.plan(question, texts, options)
        return plan, self.run_prefill(plan, options)

    def run_prefill(self, plan: Plan, options: RequestOptions) -> Prefill:
        """The method's prefill of a planned request, its store reads tallied."""
        with tally_reads() as tally:
            prefill = PREFILLS[options.method](self, plan, options)
        prefill.timings.store = tally.as_dict()
        stored = getattr(prefill.cache, "from_store", None)
        if stored is not None:  # rows read from the store and not recomputed: the tokens this request reused
            kept = stored.clone()
            kept[prefill.recomputed_positions.cpu()] = False
            prefill.reused_tokens = int(kept[: plan.length].sum())
        return prefill

    @property
    def chunk_index(self) -> StoreIndex:
        """The stored chunks' texts, for finding them inside ordinary prompts (`plan_prompt`)."""
        if getattr(self, "_chunk_index", None) is None:
            self._chunk_index = StoreIndex(self.store)
        return self._chunk_index

    def plan_prompt(self, prompt: str, options: RequestOptions, question: str | None = None) -> Plan | None:
        """The plan of a prompt written by someone else (a framework's RAG template, a client of the server):
        every stored chunk in it found and laid out (`plan_layout`); None when it holds none (then it is
        plain full prefill: `complete`). `question`: the user's words alone, for the aux's selection pass
        (default: the prompt's text after its last chunk)."""
        matches = self.chunk_index.find(prompt)
        if not matches:
            return None
        found = layout(prompt, matches, question or prompt[matches[-1].stop:].strip() or prompt[-500:])
        return self.plan_layout(found, options)

    def stream_prompt(self, prompt: str, options: RequestOptions | None = None, question: str | None = None) -> Stream:
        """Answer a whole prompt, reusing the caches of the stored chunks it holds (full prefill if none)."""
        options = options or RequestOptions()
        started = time.perf_counter()
        plan = self.plan_prompt(prompt, options, question)
        if plan is None:
            return self.complete(prompt, options)
        return self.stream_plan(plan, options, started)

    def plan_layout(self, layout: Layout, options: RequestOptions) -> Plan:
        """The plan of a prompt a client wrote, as `recognize` found it (see `planning.plan_layout`)."""
        return plan_layout(self.primary, layout, options)

    def decode(self, plan: Plan, prefill: Prefill, options: RequestOptions, started: float | None = None) -> Stream:
        """Decode from a prefill; TTFT counts from `started` (default: now)."""
        return self._stream(plan.length, options, prefill, time.perf_counter() if started is None else started)

    def teacher_forced_logits(self, plan: Plan, prefill: Prefill, tokens: Sequence[int]) -> torch.Tensor:
        """Next-token logits [len(tokens), V] along `tokens` written after the question: row i is the
        distribution of tokens[i] given tokens[:i]. Writes the answer rows of the prefill's cache (a
        later decode of the same prefill overwrites them before reading), never the prompt's rows."""
        tokens = list(tokens)
        if not tokens:
            raise ValueError("teacher forcing needs at least one token")
        if plan.length + len(tokens) > prefill.cache.capacity:
            raise ValueError(f"{len(tokens)} forced tokens do not fit the cache's {prefill.cache.capacity - plan.length} "
                             "answer rows (raise max_new_tokens)")
        rows = [prefill.logits[None]]
        if len(tokens) > 1:
            slots = torch.arange(plan.length, plan.length + len(tokens) - 1)
            logits = forward_at(self.primary.model, prefill.cache, torch.tensor([tokens[:-1]]),
                                (slots - prefill.rope_shift)[None], slots=slots, logits_to_keep=len(tokens) - 1,
                                chunk_scaling=prefill.chunk_scaling)[0]
            rows.append(logits.to(prefill.logits.dtype))
        return torch.cat(rows)

    def complete(self, prompt: str, options: RequestOptions | None = None) -> Stream:
        """Plain generation from a whole prompt (no chunks, no reuse): full prefill, then decode.
        The prompt is used as written (no chat template); BOS is added when the model uses one."""
        options = options or RequestOptions(method="full")
        started = time.perf_counter()
        lm = self.primary
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError("prompt is empty")
        ids = lm.encode_prefix(prompt)
        if len(ids) + options.max_new_tokens > lm.max_context:
            raise ValueError(f"prompt of {len(ids)} tokens plus max_new_tokens={options.max_new_tokens} "
                             f"exceeds the model's context of {lm.max_context} tokens")
        cache = new_cache(lm, len(ids) + options.max_new_tokens)
        logits = forward_at(lm.model, cache, torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
        timings = Timings(recompute_s=time.perf_counter() - started)
        prefill = Prefill(cache, logits, torch.arange(len(ids)), timings)
        return self._stream(len(ids), replace(options, method="full"), prefill, started)

    def generate(self, question: str, texts: Sequence[str], options: RequestOptions | None = None) -> Answer:
        stream = self.stream(question, texts, options)
        for _ in stream:
            pass
        assert stream.answer is not None
        return stream.answer

    def _stream(self, length: int, options: RequestOptions, prefill: Prefill, started: float) -> Stream:
        """The decode of a prefill as text pieces; `stream.decoder` lets a server batch its forwards."""
        stream = Stream(iter(()))
        stream.decoder = TokenDecoder(self.primary, prefill.cache, prefill.logits, length, options.max_new_tokens,
                                      options.temperature, options.top_p, options.seed,
                                      rope_shift=prefill.rope_shift, chunk_scaling=prefill.chunk_scaling)
        stream.pieces = self._decode(stream.decoder, length, options, prefill, started, stream)
        return stream

    def _decode(self, tokens: TokenDecoder, length: int, options: RequestOptions, prefill: Prefill, started: float,
                stream: Stream) -> Iterator[str]:
        lm, timings = self.primary, prefill.timings
        generated = stream.token_ids
        pieces: list[str] = []
        for piece in text_deltas(lm, _timed_first(tokens, lambda: started, timings), (*(lm.prompt.stop_strings if options.prompt_stops else ()), *options.stop), generated):
            pieces.append(piece)
            yield piece
        timings.decode_tokens = max(0, len(generated) - 1)
        timings.decode_s = time.perf_counter() - started - timings.ttft_s
        stream.answer = Answer(
            text="".join(pieces), token_ids=generated, method=options.method, ratio=options.ratio,
            prompt_tokens=length, recomputed_tokens=prefill.recomputed_rows,
            first_logits=prefill.logits, timings=timings, reused_tokens=prefill.reused_tokens,
        )

    # ---- building blocks ---------------------------------------------------------------------

    def blended_cache(self, plan: Plan, options: RequestOptions, shared: bool, reposition: bool = True) -> BlendedCache:
        """One prefix, then every chunk's cached rows at its offset in the prompt: decoded from the store
        straight into its place, its keys then re-rotated there to the contiguous positions (or, with
        `reposition=False`, APE, left at the positions they were computed at, right behind the prefix, so
        the chunks' positions overlap). On CUDA behind a host tier the load runs layer by layer beside
        the recompute (`layerwise`)."""
        lm = self.primary
        cache = new_cache(lm, plan.length + options.max_new_tokens)
        computed_at = plan.prefix_len if shared else 0
        slots = [cache.slot(offset, len(ids)) for offset, ids in zip(plan.chunk_offsets, plan.chunk_ids)]
        deltas = [offset - computed_at if reposition else 0 for offset in plan.chunk_offsets]
        variant = SHARED if shared else DIRECT
        batch, dtype = self.config.ingest_batch_size, self.store_dtype(lm)
        stream = self.layer_stream(lm) if isinstance(self.store, HostTier) else None
        if stream is not None:
            loaded = load_layerwise(lm, self.store, plan.texts, plan.chunk_ids, slots, deltas, variant,
                                    plan.system_prompt, stream, batch, dtype, plan.bare or None)
            cache.wait_for_layer = stream.wait
        else:
            loaded = load_into(lm, self.store, plan.texts, plan.chunk_ids, slots, variant, plan.system_prompt,
                               batch, dtype, plan.bare or None)
            rotations: dict = {}
            for (keys, _), delta in zip(slots, deltas):
                rotate_keys_(lm.model, keys, delta, rotations=rotations)  # in the compute dtype, in place
        cache.place(0, loaded.prefix.keys, loaded.prefix.values)
        # which rows came from the store, for the answer's count of reused tokens
        cache.from_store = torch.zeros(cache.capacity, dtype=torch.bool)
        cache.from_store[: plan.prefix_len] = loaded.prefix.read
        for offset, ids, read in zip(plan.chunk_offsets, plan.chunk_ids, loaded.read):
            cache.from_store[offset : offset + len(ids)] = read
        return cache

    def recompute_and_answer(self, cache: BlendedCache, plan: Plan, positions: torch.Tensor,
                             options: RequestOptions | None = None) -> torch.Tensor:
        """Recompute the chunk rows at `positions` together with the text between chunks (a client's own
        layout) and the question; next-token logits. `options.recompute_layers` (a diagnostic) writes the
        recomputed chunk rows back only in that kind of layer."""
        positions = torch.cat([positions, plan.gap_positions()]).sort().values if plan.has_gaps else positions.sort().values
        positions = torch.cat([positions, plan.question_positions()])
        ids = torch.tensor(plan.all_ids())[positions]
        which = options.recompute_layers if options is not None else "all"
        if which != "all":
            kinds = layer_types(self.primary.model)
            if "sliding_attention" not in kinds or plan.has_gaps:
                raise ValueError(f"recompute_layers={which!r} needs a primary with sliding-window layers and the "
                                 f"engine's own layout ({self.primary.name} has {sorted(set(kinds))})")
            keep = "full_attention" if which == "sliding" else "sliding_attention"
            cache.stale_layers = frozenset(i for i, kind in enumerate(kinds) if kind == keep)
            cache.stale_before = plan.question_start
        try:
            return recompute(self.primary.model, cache, ids, positions, kernel=self.kernel)
        finally:
            cache.stale_layers = frozenset()

    def aux_selection(self, plan: Plan, options: RequestOptions) -> list[torch.Tensor]:
        """Per chunk, the primary tokens CacheClip recomputes: aux scores -> grouped to the budget ->
        mapped to the primary's tokens. Chunk 0 behind the shared prefix is exact already: it is not
        scored (no aux pass) and never recomputed. Separator tokens are not chunk text: they rank last."""
        aux = self.aux
        if aux is None:
            raise ValueError("cacheclip's aux selection (requery=None or > 0) needs an aux model; set EngineConfig.aux, "
                             "or use the default selection (requery=0), which needs none")
        prefix, entries = self.entries(aux, plan.texts, SHARED, plan.system_prompt, plan.bare or None)
        question_ids, question_rows = question_tokens(aux, plan.question, options.answer_prefix)
        skip = 1 if options.shared_prefix else 0
        forced, ratio = None, options.ratio
        if options.boundary_tokens is not None and 0.0 < options.ratio < 1.0:
            forced = boundary_selection(plan, options.boundary_tokens, skip, options.ratio)
            total = sum(len(ids) for ids in plan.chunk_ids)
            ratio = max(0.0, (math.ceil(options.ratio * total - 1e-9) - sum(int(f.sum()) for f in forced)) / total)
        with side_stream(aux.device):  # on a GPU, off the stream that loads the primary's caches
            scored = (aux_scores(aux, prefix, entries[skip:], question_ids, question_rows, model=self.aux_scorer)
                      if len(entries) > skip else [])
        scores = [torch.full((entries[0].num_tokens,), float("-inf"))] * skip + scored
        outside = [torch.tensor([start >= len(text) for start, _ in entry.offsets], dtype=torch.bool)
                   for entry, text in zip(entries, plan.texts)]
        for score, out in zip(scores, outside):
            # separators rank below every chunk token: chosen only once the budget has room for all text
            # (their cached K/V lack cross-chunk attention too, so ratio 1 still recomputes them)
            score[out & torch.isfinite(score)] = -1e30
        if options.grouping:
            chosen = grouped_to_budget(scores, ratio, self.config.window, self.config.threshold, options.exact_budget)
        else:
            chosen = top_k_candidates(scores, ratio)
        bare = plan.bare or (False,) * len(plan.texts)
        mapped = [map_selection(entry.offsets, c, spans, len(chunk_unit(aux, text, b)))
                  for text, b, entry, c, spans in zip(plan.texts, bare, entries, chosen, plan.char_spans)]
        return mapped if forced is None else [m | f for m, f in zip(mapped, forced)]

    def positions_of(self, plan: Plan, selected: Sequence[torch.Tensor]) -> torch.Tensor:
        parts = [offset + torch.nonzero(mask).flatten() for offset, mask in zip(plan.chunk_offsets, selected)]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def open_store(location: str | Path, shared: str | None = None):
    """The store for `location`: an LMDB folder, or a redis URL; with `shared` (a redis URL), a local
    LMDB tier in front of the shared one."""
    if is_redis_url(str(location)):
        from .redis_store import RedisStore

        return RedisStore(str(location))
    local = LMDBStore(location)
    if shared is None:
        return local
    from .redis_store import RedisStore, TieredStore

    return TieredStore(local, RedisStore(shared))


def default_kernel(lm: LoadedModel) -> SelectedRowsKernel | None:
    """The Triton selected-rows kernel when the primary runs on CUDA and Triton is installed."""
    if lm.device.type != "cuda":
        return None
    from .kernels import selected_attention as module

    if module.triton is None:
        warnings.warn("Triton is not installed: selective recompute on CUDA falls back to SDPA with dense "
                      "position masks, several times slower at long contexts; pip install 'cacheclip-rag[triton]'",
                      RuntimeWarning, stacklevel=3)
        return None
    return module.selected_attention


def _timed_first(tokens: Iterator[int], started: Callable[[], float], timings: Timings) -> Iterator[int]:
    for i, token in enumerate(tokens):
        if i == 0:
            timings.ttft_s = time.perf_counter() - started()
        yield token
