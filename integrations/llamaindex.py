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

from .llamaindex_llm import CacheClipLLM, MiniLMEmbedding, minilm_splitter
from .llamaindex_store import (CacheClipVectorStore, attach_kv, faiss_similarity_store, kv_texts, load_faiss_store,
                               node_text)
from .llamaindex_synth import CacheClipQueryEngine, CacheClipSynthesizer

__all__ = ["CacheClipLLM", "CacheClipQueryEngine", "CacheClipSynthesizer", "CacheClipVectorStore", "MiniLMEmbedding",
           "attach_kv", "faiss_similarity_store", "kv_texts", "load_faiss_store", "minilm_splitter", "node_text"]
