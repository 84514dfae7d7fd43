"""LlamaIndex: CacheClip as a response synthesizer (retrieval and postprocessing stay LlamaIndex's),
and the bespoke query engine with per-call method and ratio."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

try:
    from llama_index.core.base.base_query_engine import BaseQueryEngine
    from llama_index.core.base.base_retriever import BaseRetriever
    from llama_index.core.base.response.schema import AsyncStreamingResponse, Response, StreamingResponse
    from llama_index.core.callbacks import CallbackManager
    from llama_index.core.prompts import PromptTemplate
    from llama_index.core.response_synthesizers import BaseSynthesizer
    from llama_index.core.schema import NodeWithScore, QueryBundle
except ImportError as err:  # pragma: no cover
    raise ImportError("the LlamaIndex integration needs: pip install 'cacheclip-rag[llamaindex]'") from err

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.engine.core import Engine, Stream
from cacheclip_rag.models.openmp_pools import to_thread_releasing

from .common import aiter_in_thread, answer_metadata
from .llamaindex_llm import CacheClipLLM
from .llamaindex_store import node_text


class CacheClipSynthesizer(BaseSynthesizer):
    """CacheClip as a LlamaIndex response synthesizer (see the module doc).

    `options` sets method, ratio and decoding; `get_response(..., method=..., ratio=...)` overrides
    them per call. The response's `metadata["cacheclip"]` holds method, ratio, token counts and
    timings (filled when a stream ends)."""

    def __init__(self, engine: Engine | str, options: RequestOptions | None = None, *, streaming: bool = False,
                 text_qa_template: PromptTemplate | None = None, callback_manager: CallbackManager | None = None,
                 api_key: str | None = None):
        """`engine`: an in-process `Engine`, or the URL of a running `cacheclip serve` (no model in this
        process; `api_key` for it)."""
        from cacheclip_rag.serve.client import engine_or_remote

        engine = engine_or_remote(engine, api_key)
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

    def as_query_engine(self, index: Any, **kwargs: Any) -> BaseQueryEngine:
        """`index.as_query_engine(...)` answering with this synthesizer and its LLM (without `llm=`,
        LlamaIndex resolves its default OpenAI LLM and fails for want of its package)."""
        return index.as_query_engine(llm=self.llm, response_synthesizer=self, **kwargs)

    def as_chat_engine(self, index: Any, chat_mode: str = "context", **kwargs: Any) -> Any:
        """A chat engine over `index` whose turns reuse the retrieved chunks' caches: LlamaIndex's context
        chat engines paste the retrieved text into a system message, which a plain LLM prefills in
        full; these answer each turn through this synthesizer instead (see `llamaindex_chat`)."""
        from .llamaindex_chat import chat_engine

        if chat_mode not in ("context", "condense_plus_context"):
            raise ValueError(f"chat_mode must be 'context' or 'condense_plus_context', got {chat_mode!r}")
        return chat_engine(index, self, condense=chat_mode == "condense_plus_context", **kwargs)

    def qa_template_parts(self) -> tuple[str, str]:
        """The QA template's text before `{context_str}` (the shared prefix) and after it."""
        head, tail = self._text_qa_template.get_template().split("{context_str}", 1)
        return head, tail

    def with_template(self, template: PromptTemplate, streaming: bool | None = None) -> CacheClipSynthesizer:
        """This synthesizer (engine, options, callbacks) with another QA template (and streaming)."""
        return CacheClipSynthesizer(self._engine, self._options,
                                    streaming=self._streaming if streaming is None else streaming,
                                    text_qa_template=template, callback_manager=self._callback_manager)

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

        # started here, not on the first read: the LLM's start event fires inside the query, as LlamaIndex's
        # own streaming LLMs do, not after the query's end event
        responses = self._llm.stream_complete(prompt, **kwargs)

        def pieces() -> Iterator[str]:
            for response in responses:
                if response.delta:
                    yield response.delta
                metadata.update(response.additional_kwargs)

        return self._remember(pieces(), metadata)

    async def aget_response(self, query_str: str, text_chunks: Sequence[str], **response_kwargs: Any):
        answer = await to_thread_releasing(self.get_response, query_str, text_chunks, **response_kwargs)
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


class CacheClipQueryEngine(BaseQueryEngine):
    """Retrieve, then answer from the retrieved nodes with the engine (CacheClip by default).

    `query(q, method=..., ratio=...)` overrides the method and ratio for one call; the response's
    `metadata` holds the method, ratio, token counts and timings (filled at the end of a stream)."""

    def __init__(self, engine: Engine, retriever: BaseRetriever | None = None, options: RequestOptions | None = None,
                 *, streaming: bool = False, callback_manager: CallbackManager | None = None):
        super().__init__(callback_manager)
        self.engine = engine
        self.retriever = retriever
        self.options = options or RequestOptions(max_new_tokens=64)
        self.streaming = streaming

    def with_options(self, **overrides: Any) -> CacheClipQueryEngine:
        streaming = overrides.pop("streaming", self.streaming)
        return CacheClipQueryEngine(self.engine, self.retriever, replace(self.options, **overrides), streaming=streaming,
                                    callback_manager=self.callback_manager)

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
            return await to_thread_releasing(self.synthesize, query_bundle, nodes)
        stream = await to_thread_releasing(self._stream, query_bundle, nodes)
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
