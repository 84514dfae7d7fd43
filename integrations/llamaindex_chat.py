"""LlamaIndex chat engines whose turns reuse the retrieved chunks' caches.

LlamaIndex's context chat engines (`context`, `condense_plus_context`) paste each turn's retrieved
text into the prompt of a plain LLM call, which a `CacheClipLLM` can only prefill in full. These are
the same engines with one change: each turn's retrieved nodes are answered by a `CacheClipSynthesizer`
(chunk reuse), the conversation so far framing the question after the documents. Retrieval, memory,
postprocessors, condensing and streaming stay LlamaIndex's. Build them with
`CacheClipSynthesizer.as_chat_engine(index, chat_mode=...)`.
"""

from __future__ import annotations

from typing import Any, Protocol

try:
    from llama_index.core.chat_engine import CondensePlusContextChatEngine, ContextChatEngine
    from llama_index.core.llms import ChatMessage, MessageRole
    from llama_index.core.prompts import PromptTemplate
except ImportError as err:  # pragma: no cover
    raise ImportError("the LlamaIndex integration needs: pip install 'cacheclip-rag[llamaindex]'") from err

class Synthesis(Protocol):
    """What the chat engines need of a `CacheClipSynthesizer` (which builds them: `as_chat_engine`; so this
    module does not import it)."""

    llm: Any

    def qa_template_parts(self) -> tuple[str, str]: ...

    def with_template(self, template: PromptTemplate, streaming: bool | None = None) -> Any: ...


class _ReuseSynthesis:
    """Replaces the engines' response synthesizer (CompactAndRefine over a plain LLM) with CacheClip's."""

    _cacheclip: Synthesis

    def _system_text(self) -> str | None:
        prefix = getattr(self, "_prefix_messages", None) or []
        if prefix and prefix[0].role == MessageRole.SYSTEM and prefix[0].content:
            return str(prefix[0].content)
        return getattr(self, "_system_prompt", None) or None

    def _get_response_synthesizer(self, chat_history: list[ChatMessage], streaming: bool = False) -> Any:
        head, tail = self._cacheclip.qa_template_parts()
        system = self._system_text()
        head = f"{system}\n" if system else head  # without one of their own, the chunks' ingest prefix: reuse
        turns = "\n".join(f"{m.role.value}: {m.content}" for m in chat_history if m.content)
        framing = f"Conversation so far:\n{turns}\n\n" if turns else ""
        template = PromptTemplate(head + "{context_str}" + tail.replace("{query_str}", framing + "{query_str}", 1))
        return self._cacheclip.with_template(template, streaming=streaming)


class CacheClipContextChatEngine(_ReuseSynthesis, ContextChatEngine):
    """`ContextChatEngine` answering each turn with chunk reuse."""


class CacheClipCondensePlusContextChatEngine(_ReuseSynthesis, CondensePlusContextChatEngine):
    """`CondensePlusContextChatEngine` answering each turn with chunk reuse (the condense step is a
    short plain completion)."""


def chat_engine(index: Any, synthesizer: Synthesis, condense: bool = False, **kwargs: Any) -> Any:
    """A context chat engine over `index`'s retriever (`similarity_top_k` and other retriever arguments
    go to it; the rest to the engine's `from_defaults`)."""
    retriever_args = {k: kwargs.pop(k) for k in ("similarity_top_k", "filters", "vector_store_query_mode")
                      if k in kwargs}
    cls = CacheClipCondensePlusContextChatEngine if condense else CacheClipContextChatEngine
    engine = cls.from_defaults(retriever=index.as_retriever(**retriever_args), llm=synthesizer.llm, **kwargs)
    engine._cacheclip = synthesizer
    return engine
