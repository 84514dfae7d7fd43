"""The reuse engine: one prefix, chunks at contiguous positions, selective recompute, decode.

A request reads as the algorithm: plan -> load (+ select, overlapped) -> group -> recompute -> decode.
Each method is a prefill function `(engine, plan, options) -> Prefill` (`methods`); the engine holds
the models and the store and the building blocks the methods share.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from . import blend
from .blend import Parts
from .attention import SelectedRowsKernel, use_cacheclip_attention
from .cache import BlendedCache
from .config import EngineConfig, RequestOptions, is_redis_url
from .decode import TokenDecoder, text_deltas
from .ingest import (DIRECT, SHARED, FormattedPrefix, PrefixCache, chunk_key, new_cache, precompute)
from .layerwise import LayerStream, cuda_layer_stream
from .models import LoadedModel, int8_scorer, load_model
from .recompute import forward_at
from .methods import PREFILLS
from .planning import plan_chunks, plan_layout
from .recognize import Layout, StoreIndex, layout
from .request import Answer, Plan, Prefill, Stream, Timings
from .store import ChunkEntry, KVStore, LMDBStore, tally_reads
from .store.tiers import DeviceTier, HostTier

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
        return blend.store_dtype(self.parts, lm)

    def entries(self, lm: LoadedModel, texts: Sequence[str], variant: str, system_prompt: object = None,
                bare: Sequence[bool] | None = None) -> tuple[PrefixCache, list[ChunkEntry]]:
        """Stored entries for `texts` behind `system_prompt` (default the engine's; or a FormattedPrefix);
        a miss is computed, stored and used."""
        return blend.chunk_entries(self.parts, lm, texts, variant, system_prompt, bare)

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
            prefill = PREFILLS[options.method](self.parts, plan, options)
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

    # ---- the parts and building blocks the methods run on (`blend`) ------------------------------

    @property
    def parts(self) -> Parts:
        """The models, store, settings and kernel a request runs on (the methods take these, not the engine)."""
        return Parts(primary=self.primary, store=self.store, config=self.config, aux=self.aux,
                     aux_scorer=self.aux_scorer, kernel=self.kernel, layer_stream=self.layer_stream)

    def blended_cache(self, plan: Plan, options: RequestOptions, shared: bool, reposition: bool = True) -> BlendedCache:
        """`blend.blended_cache` over this engine's parts."""
        return blend.blended_cache(self.parts, plan, options, shared, reposition)

    def aux_selection(self, plan: Plan, options: RequestOptions) -> list[torch.Tensor]:
        """`blend.aux_selection` over this engine's parts: the paper's selection, per chunk."""
        return blend.aux_selection(self.parts, plan, options)

    @staticmethod
    def positions_of(plan: Plan, selected: Sequence[torch.Tensor]) -> torch.Tensor:
        return blend.positions_of(plan, selected)


def open_store(location: str | Path, shared: str | None = None):
    """The store for `location`: an LMDB folder, or a redis URL; with `shared` (a redis URL), a local
    LMDB tier in front of the shared one."""
    if is_redis_url(str(location)):
        from .store.redis_store import RedisStore

        return RedisStore(str(location))
    local = LMDBStore(location)
    if shared is None:
        return local
    from .store.redis_store import RedisStore, TieredStore

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
