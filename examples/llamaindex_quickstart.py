# %% [markdown]
# # LlamaIndex quickstart: CacheClip over a FAISS index
# Every node that enters the vector store gets its KV cache precomputed and stored (LMDB). The
# answer comes from LlamaIndex's own query engine with `CacheClipSynthesizer` as its response
# synthesizer: retrieval (and any postprocessors) run as LlamaIndex runs them, then the retrieved
# nodes are answered with chunk reuse. Embedded defaults: Gemma 3 270M primary, SmolLM2-135M aux,
# MiniLM embeddings. Nothing is downloaded.
#
# **What to expect from these models.** Gemma 3 270M is a tiny *base* model: it finds a fact that
# is stated plainly next to the question's words, and often fails otherwise (in `bench/RESULTS.md`
# full attention itself solves under half of the RULER samples). Wrong answers below are the
# model's, and `full` attention gets them wrong too; the point is that CacheClip answers like
# `full`, faster. Bring a larger model for real use (README, "Bring your own model").

# %%
import tempfile
from pathlib import Path

import faiss
from llama_index.core import Document, StorageContext, VectorStoreIndex, load_index_from_storage
from llama_index.vector_stores.faiss import FaissVectorStore

from cacheclip_rag import Engine, EngineConfig, RequestOptions
from cacheclip_rag.cli import DEMO_QUESTIONS, demo_chunks
from cacheclip_rag.integrations.llamaindex import CacheClipSynthesizer, CacheClipVectorStore, MiniLMEmbedding

engine = Engine.from_config(EngineConfig())
embed_model = MiniLMEmbedding()
# one Document per section of the bundled observatory handbook, labelled by file and section
documents = [Document(text=section, metadata={"file": "observatory_handbook.md", "section": section.splitlines()[0][3:]})
             for section in demo_chunks()]

# %% Build the index: the hook stores each node's KV as the node enters FAISS
vector_store = CacheClipVectorStore(FaissVectorStore(faiss_index=faiss.IndexFlatL2(384)), engine)
index = VectorStoreIndex.from_documents(documents, storage_context=StorageContext.from_defaults(vector_store=vector_store),
                                        embed_model=embed_model)
persist_dir = Path(tempfile.mkdtemp(prefix="cacheclip-llamaindex-"))
index.storage_context.persist(persist_dir=str(persist_dir))
print(f"{len(index.docstore.docs)} nodes; KV store {engine.store.path}; index {persist_dir}")

# %% Reload the index from disk (its nodes still carry their KV keys) and build LlamaIndex's query engine
faiss_store = FaissVectorStore.from_persist_dir(str(persist_dir))
context = StorageContext.from_defaults(vector_store=CacheClipVectorStore(faiss_store, engine), persist_dir=str(persist_dir))
index = load_index_from_storage(context, embed_model=embed_model)


def query_engine(method: str, streaming: bool = False):
    synth = CacheClipSynthesizer(engine, RequestOptions(method=method, ratio=0.2, max_new_tokens=24), streaming=streaming)
    return index.as_query_engine(llm=synth.llm, response_synthesizer=synth, similarity_top_k=3)


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
