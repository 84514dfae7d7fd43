# %% [markdown]
# # LangChain quickstart: CacheClip behind a FAISS retriever
# `CacheClipFAISS` stores each text's KV as it is indexed; `CacheClipGenerate` is a Runnable that
# answers `{"docs", "question"}` with CacheClip, streamed token by token.

# %%
import asyncio

from langchain_core.runnables import RunnableParallel, RunnablePassthrough

from cacheclip_rag import Engine, EngineConfig, RequestOptions
from cacheclip_rag.cli import demo_chunks
from cacheclip_rag.integrations.langchain import CacheClipFAISS, CacheClipGenerate, MiniLMEmbeddings

engine = Engine.from_config(EngineConfig())
vector_store = CacheClipFAISS.from_texts(demo_chunks(), MiniLMEmbeddings(), kv_engine=engine)
retriever = vector_store.as_retriever(search_kwargs={"k": 3})

# %% A RAG chain: retrieve, then generate over the retrieved chunks' stored caches
generate = CacheClipGenerate(engine, RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=24))
chain = RunnableParallel(docs=retriever, question=RunnablePassthrough()) | generate
print(chain.invoke("What is the name of the archive server that releases the data?"))

# %% Streaming, sync and async
for piece in chain.stream("In which year did the Lantern programme announce its first confirmed planet?"):
    print(piece, end="|", flush=True)
print()


async def main() -> None:
    async for piece in chain.astream("How far away is the nearest hospital?"):
        print(piece, end="|", flush=True)
    print()


asyncio.run(main())
