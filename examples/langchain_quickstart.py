# %% [markdown]
# # LangChain quickstart: CacheClip behind a FAISS retriever
# `CacheClipFAISS` stores each text's KV as it is indexed; `CacheClipGenerate` is a Runnable that
# answers `{"docs", "question"}` with CacheClip, streamed token by token, and can return its
# sources and token usage.
#
# **What to expect from these models.** Gemma 3 270M is a tiny *base* model: it answers a fact
# stated plainly next to the question's words and often fails otherwise (`full` attention too).
# The examples show the mechanics; bring a larger model for real use (README, "Bring your own model").

# %%
import asyncio
from concurrent.futures import ThreadPoolExecutor

from langchain_core.documents import Document
from langchain_core.runnables import RunnableParallel, RunnablePassthrough

from cacheclip_rag import Engine, EngineConfig, RequestOptions
from cacheclip_rag.cli import DEMO_QUESTIONS, demo_chunks
from cacheclip_rag.integrations.langchain import CacheClipFAISS, CacheClipGenerate, MiniLMEmbeddings

engine = Engine.from_config(EngineConfig())
sections = demo_chunks()
vector_store = CacheClipFAISS.from_documents(
    [Document(page_content=s, metadata={"file": "observatory_handbook.md", "section": s.splitlines()[0][3:]})
     for s in sections], MiniLMEmbeddings(), kv_engine=engine)
retriever = vector_store.as_retriever(search_kwargs={"k": 3})

# %% A RAG chain: retrieve, then generate over the retrieved chunks' stored caches; answer, sources, usage
generate = CacheClipGenerate(engine, RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=24),
                             return_sources=True)
chain = RunnableParallel(docs=retriever, question=RunnablePassthrough()) | generate
question, expected = DEMO_QUESTIONS[1]
out = chain.invoke(question)
answer = out["answer"].strip().splitlines()[0] if out["answer"].strip() else ""
print(f"Q: {question}\nA: {answer!r} ({'right' if expected.lower() in answer.lower() else 'wrong'}; the handbook says {expected})")
print("sources:", "; ".join(f"{d.metadata['file']} › {d.metadata['section']}" for d in out["source_documents"]))
print("usage:", out["usage_metadata"])

# %% Per-call options: the same chain with full attention, through bind
full = (RunnableParallel(docs=retriever, question=RunnablePassthrough()) | generate.bind(method="full"))
print("full:", repr(full.invoke(question)["answer"].strip()))

# %% Streaming, sync and async (the async loop runs in a thread when a notebook already runs one)
text_chain = RunnableParallel(docs=retriever, question=RunnablePassthrough()) | CacheClipGenerate(
    engine, RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=24))
for piece in text_chain.stream(DEMO_QUESTIONS[2][0]):
    print(piece, end="|", flush=True)
print()


async def main() -> None:
    async for piece in text_chain.astream("How far away is the nearest hospital?"):
        print(piece, end="|", flush=True)
    print()


with ThreadPoolExecutor(1) as pool:
    pool.submit(asyncio.run, main()).result()
