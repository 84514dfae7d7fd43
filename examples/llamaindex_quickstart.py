# %% [markdown]
# # LlamaIndex quickstart: CacheClip over a FAISS index
# Every node that enters the vector store gets its KV cache precomputed and stored (LMDB); the
# query engine answers from the retrieved nodes with CacheClip. Embedded defaults: Gemma 3 270M
# primary, SmolLM2-135M aux, MiniLM embeddings. Nothing is downloaded.

# %%
import tempfile
from pathlib import Path

import faiss
from llama_index.core import Document, StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.core.node_parser import MarkdownNodeParser
from llama_index.vector_stores.faiss import FaissVectorStore

from cacheclip_rag import Engine, EngineConfig, RequestOptions
from cacheclip_rag.cli import demo_chunks
from cacheclip_rag.integrations.llamaindex import CacheClipQueryEngine, CacheClipVectorStore, MiniLMEmbedding

engine = Engine.from_config(EngineConfig())
embed_model = MiniLMEmbedding()
handbook = "\n\n".join(demo_chunks())  # the bundled observatory handbook

# %% Build the index: the hook stores each node's KV as the node enters FAISS
vector_store = CacheClipVectorStore(FaissVectorStore(faiss_index=faiss.IndexFlatL2(384)), engine)
index = VectorStoreIndex.from_documents(
    [Document(text=handbook)], storage_context=StorageContext.from_defaults(vector_store=vector_store),
    embed_model=embed_model, transformations=[MarkdownNodeParser()],
)
persist_dir = Path(tempfile.mkdtemp(prefix="cacheclip-llamaindex-"))
index.storage_context.persist(persist_dir=str(persist_dir))
print(f"{len(index.docstore.docs)} nodes; KV store {engine.store.path}; index {persist_dir}")

# %% Reload the index from disk; its nodes still carry their KV keys
faiss_store = FaissVectorStore.from_persist_dir(str(persist_dir))
context = StorageContext.from_defaults(vector_store=CacheClipVectorStore(faiss_store, engine), persist_dir=str(persist_dir))
index = load_index_from_storage(context, embed_model=embed_model)
query_engine = CacheClipQueryEngine(engine, index.as_retriever(similarity_top_k=3),
                                    RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=24))

# %% Ask, compare with full attention
question = "How many pistons support the Halvorsen mirror?"
for method in ("full", "cacheclip"):
    response = query_engine.query(question, method=method)
    print(f"{method:>9}: {response.response.strip()!r}  TTFT {response.metadata['timings']['ttft_s']:.2f} s")
print("sources:", [n.node.metadata.get("header_path", n.node.node_id) for n in response.source_nodes])

# %% Streaming
streaming = query_engine.with_options(streaming=True)
for piece in streaming.query("Who is the present director of the observatory?").response_gen:
    print(piece, end="", flush=True)
print()
