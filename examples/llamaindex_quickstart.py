# %% [markdown]
# # LlamaIndex quickstart: CacheClip over a FAISS index
# Every node that enters the vector store gets its KV cache precomputed and stored (LMDB). The
# answer comes from LlamaIndex's own query engine with `CacheClipSynthesizer` as its response
# synthesizer: retrieval (and any postprocessors) run as LlamaIndex runs them, then the retrieved
# nodes are answered with chunk reuse. Embedded defaults: Qwen2.5-Coder-0.5B-Instruct primary,
# SmolLM2-135M aux, MiniLM embeddings. Nothing is downloaded.
#
# **What to expect from these models.** A 0.5B instruct model reads short documents well but not
# perfectly (on the demo's four questions full attention answered three); where `full` is wrong,
# the error is the model's. The point is that CacheClip answers like `full`, faster. Bring a larger
# model for real use (README, "Bring your own model").

# %%
import tempfile
from pathlib import Path

from llama_index.core import Document, StorageContext, VectorStoreIndex, load_index_from_storage

from cacheclip_rag import Engine, EngineConfig, RequestOptions
from cacheclip_rag.cli import DEMO_QUESTIONS, demo_chunks
from cacheclip_rag.integrations.llamaindex import (CacheClipSynthesizer, CacheClipVectorStore, MiniLMEmbedding,
                                                   faiss_similarity_store, load_faiss_store, minilm_splitter)

engine = Engine.from_config(EngineConfig())
embed_model = MiniLMEmbedding()
# one Document per section of the bundled observatory handbook, labelled by file and section
documents = [Document(text=section, metadata={"file": "observatory_handbook.md", "section": section.splitlines()[0][3:]})
             for section in demo_chunks()]

# %% Build the index: nodes split to MiniLM's window; the hook stores each node's KV as it enters FAISS
vector_store = CacheClipVectorStore(faiss_similarity_store(), engine)  # cosine similarities, and it can delete
index = VectorStoreIndex.from_documents(documents, storage_context=StorageContext.from_defaults(vector_store=vector_store),
                                        embed_model=embed_model, transformations=[minilm_splitter()])
persist_dir = Path(tempfile.mkdtemp(prefix="cacheclip-llamaindex-"))
index.storage_context.persist(persist_dir=str(persist_dir))
print(f"{len(index.docstore.docs)} nodes; KV store {engine.store.path}; index {persist_dir}")

# %% Reload the index from disk (its nodes still carry their KV keys) and build LlamaIndex's query engine
faiss_store = load_faiss_store(str(persist_dir))
context = StorageContext.from_defaults(vector_store=CacheClipVectorStore(faiss_store, engine), persist_dir=str(persist_dir))
index = load_index_from_storage(context, embed_model=embed_model)


def query_engine(method: str, streaming: bool = False):
    synth = CacheClipSynthesizer(engine, RequestOptions(method=method, ratio=0.2, max_new_tokens=24), streaming=streaming)
    return synth.as_query_engine(index, similarity_top_k=3)


# %% Ask, compare with full attention, show the sources by file and section
for question, expected in DEMO_QUESTIONS[:2]:
    print(f"Q: {question}  (the handbook says: {expected})")
    for method in ("full", "cacheclip"):
        response = query_engine(method).query(question)
        answer = response.response.strip().splitlines()[0] if response.response.strip() else ""
        verdict = "right" if expected.lower() in answer.lower() else "wrong"
        print(f"  {method:>9}: {answer!r} ({verdict}), TTFT {response.metadata['cacheclip']['timings']['ttft_s']:.2f} s")
    print("  sources:", "; ".join(f"{n.node.metadata['file']} › {n.node.metadata['section']} ({n.score:.2f})"
                                  for n in response.source_nodes))

# %% Streaming
response = query_engine("cacheclip", streaming=True).query("Who is the present director of the observatory?")
for piece in response.response_gen:
    print(piece, end="", flush=True)
print()

# %% Deleting a document reaches the KV store: its nodes leave FAISS and their caches the store
before = engine.store.stats()["entries"]
index.delete_ref_doc(documents[0].doc_id)
print(f"store entries {before} -> {engine.store.stats()['entries']} after deleting {documents[0].metadata['section']!r}")
