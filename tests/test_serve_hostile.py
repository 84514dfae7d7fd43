"""`cacheclip serve` under hostile clients, on loopback with a real uvicorn, the real `openai` client and raw
httpx and sockets: tenants cannot learn each other's documents, bounded work before every refusal, a 4xx
for every malformed request, slow clients cannot hold the server, and nothing stored is lost."""

import json
import random
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from cacheclip_rag.config import EngineConfig  # noqa: E402
from cacheclip_rag.engine.core import Engine  # noqa: E402
from cacheclip_rag.serve.keys import load_keys  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.test_serve import running  # noqa: E402

A, B, READER, ADMIN = ("sk-tenant-a-" + "a" * 12, "sk-tenant-b-" + "b" * 12, "sk-reader-" + "r" * 14,
                       "sk-admin-" + "x" * 15)
WORDS = "harbour ferry tide gull lantern basalt archive piston mirror dome cliff fog rye".split()


def document(i: int) -> str:
    """A distinct document of a fixed length in characters."""
    rng = random.Random(i)
    return f"Record {i:04d}: " + " ".join(rng.choice(WORDS) for _ in range(30)) + f". Its code is {1000000 + i}."


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({A: {"tenant": "a", "roles": ["ingest"]}, B: {"tenant": "b", "roles": ["ingest"]},
                                READER: {"tenant": "c", "roles": []}, ADMIN: {"tenant": "ops", "roles": ["admin"]}}))
    return path


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    lm = tiny_model("llama")
    path = tmp_path_factory.mktemp("hostile-store")
    return Engine(primary=lm, aux=lm, store=LMDBStore(path),
                  config=EngineConfig(store_path=path, system_prompt="Be brief.", store_dtype="float32"))


@pytest.fixture(scope="module")
def live(engine, keys_file):
    with running(engine, tenant_keys=load_keys(keys_file), max_queue=8, max_ingest_documents=64,
                 max_document_chars=4096, max_system_chars=512, body_timeout_s=1.0, header_timeout_s=1.0) as found:
        yield found


def ask(url: str, key: str, doc: str, **extra) -> dict:
    reply = httpx.post(url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {key}"}, json={
        "model": "cacheclip", "max_tokens": 1, **extra,
        "messages": [{"role": "system", "content": "Context:\n" + doc}, {"role": "user", "content": "Which code?"}]})
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]


def ingest(url: str, key: str, docs: list[str], **extra) -> httpx.Response:
    return httpx.post(url + "/v1/ingest", timeout=300, headers={"Authorization": f"Bearer {key}"},
                      json={"documents": docs, **extra})


def threshold_accuracy(train: list[tuple[float, bool]], test: list[tuple[float, bool]]) -> float:
    """A threshold classifier fitted on `train` (midpoint of the class medians, the side the members
    fall on) and scored on `test`: 0.5 when the feature carries nothing."""
    members = sorted(v for v, m in train if m)
    others = sorted(v for v, m in train if not m)
    cut = (members[len(members) // 2] + others[len(others) // 2]) / 2
    above = members[len(members) // 2] > cut
    return sum(((v > cut) == above) == m for v, m in test) / len(test)


def test_a_tenant_cannot_tell_which_documents_another_tenant_holds(live, engine):
    """Tenant A ingests and asks about half of 240 documents; tenant B then asks about all of them.
    B's cached_tokens, recognised-chunk count and time to first token are the same for A's documents
    as for unseen ones: a threshold classifier (fitted on 80, scored on 160) stays at chance (before:
    accuracy 1.00 over 12 documents, from cached_tokens 157 against 23)."""
    url, _ = live
    docs = [document(i) for i in range(240)]
    held = set(random.Random(1).sample(range(len(docs)), len(docs) // 2))
    mine = [docs[i] for i in sorted(held)]
    for start in range(0, len(mine), 60):  # within the server's 64 documents a request
        assert ingest(url, A, mine[start:start + 60]).status_code == 200
    ask(url, A, docs[min(held)])  # the first request computes the chunk behind this prompt's own start ...
    own = ask(url, A, docs[min(held)])  # ... and the next reads it
    assert own["cacheclip"]["chunks_recognised"] == 1 and own["prompt_tokens_details"]["cached_tokens"] > 0
    features: dict[str, list[tuple[float, bool]]] = {"cached": [], "recognised": [], "ttft": []}
    order = list(range(len(docs)))
    random.Random(2).shuffle(order)
    for i in order:
        usage = ask(url, B, docs[i])
        features["cached"].append((usage["prompt_tokens_details"]["cached_tokens"], i in held))
        features["recognised"].append((usage["cacheclip"]["chunks_recognised"], i in held))
        features["ttft"].append((usage["cacheclip"]["timings"]["ttft_s"], i in held))
    for name in ("cached", "recognised"):
        assert {v for v, _ in features[name]} == {0}, name  # nothing of A's is found or read
    accuracy = threshold_accuracy(features["ttft"][:80], features["ttft"][80:])
    assert accuracy <= 0.65, accuracy  # chance is 0.5; at n = 160, above 0.65 has probability < 1e-4
    again = ask(url, A, docs[min(held)])  # nothing of A's was lost or changed by B's traffic
    assert again["prompt_tokens_details"]["cached_tokens"] == own["prompt_tokens_details"]["cached_tokens"]


def test_each_tenant_has_its_own_entry_for_the_same_text_and_the_operator_shares_with_all(live, engine):
    url, server = live
    text = document(9001)
    before = sum(1 for _ in engine.store.keys())
    keys_a, keys_b = ingest(url, A, [text]).json()["keys"], ingest(url, B, [text]).json()["keys"]
    assert keys_a == keys_b  # the same chunk key as the client sees it ...
    assert sum(1 for _ in engine.store.keys()) > before + 1  # ... stored twice, once per namespace
    assert ingest(url, READER, [text]).status_code == 403  # no ingest role
    shared = document(9002)
    assert ingest(url, ADMIN, [shared]).status_code == 200  # the operator's corpus
    ask(url, ADMIN, shared)  # computed behind this prompt's start, in the shared corpus
    for key in (A, B, READER):
        usage = ask(url, key, shared)
        assert usage["cacheclip"]["chunks_recognised"] == 1 and usage["prompt_tokens_details"]["cached_tokens"] > 0
    assert shared in engine.store.texts() and text not in engine.store.texts()  # tenants' texts are marked


def test_cache_salt_reuses_only_between_requests_with_the_same_salt(live):
    url, _ = live
    docs = [document(9100), document(9101)]
    first = ask(url, A, "", documents=docs, cache_salt="s1")
    assert first["prompt_tokens_details"]["cached_tokens"] == 0  # nothing under this salt yet
    assert ask(url, A, "", documents=docs, cache_salt="s1")["prompt_tokens_details"]["cached_tokens"] > 0
    assert ask(url, A, "", documents=docs, cache_salt="s2")["prompt_tokens_details"]["cached_tokens"] == 0
    assert ask(url, B, "", documents=docs, cache_salt="s1")["prompt_tokens_details"]["cached_tokens"] == 0


def test_ingest_limits_are_refused_before_any_compute(live, engine):
    url, _ = live
    before = sum(1 for _ in engine.store.keys())
    cases = [({"documents": [document(i) for i in range(65)]}, 413, "64"),
             ({"documents": ["x" * 4097]}, 413, "4096"),
             ({"documents": [document(1)], "system": "s" * 513}, 413, "512"),
             ({"documents": ["a\x00b" * 10]}, 400, "NUL"),
             ({"documents": [document(1)], "extra": 1}, 400, "extra")]
    for body, status, says in cases:
        reply = ingest(url, A, body.pop("documents"), **body)
        assert reply.status_code == status and says in reply.json()["error"]["message"], (body, reply.text)
    assert sum(1 for _ in engine.store.keys()) == before


CHAT = {"model": "cacheclip", "messages": [{"role": "user", "content": "hi"}]}
MALFORMED = [
    ("deep nesting", "/v1/chat/completions", b'{"model": "cacheclip", "messages": ' + b"[" * 60000 + b"]" * 60000 + b"}",
     400, "nests too deeply"),
    ("deep nesting, completions", "/v1/completions", b'{"prompt": ' + b"[" * 60000 + b"]" * 60000 + b"}", 400,
     "nests too deeply"),
    ("deep nesting, ingest", "/v1/ingest", b'{"documents": ' + b"{\"a\":" * 60000 + b"1" + b"}" * 60000 + b"}", 400,
     "nests too deeply"),
    ("lone surrogate, user", "/v1/chat/completions",
     b'{"model": "cacheclip", "messages": [{"role": "user", "content": "hi \\ud800"}]}', 400, "not valid Unicode"),
    ("lone surrogate, system", "/v1/chat/completions", b'{"model": "cacheclip", "messages": [{"role": "system", '
     b'"content": "\\udfff"}, {"role": "user", "content": "hi"}]}', 400, "not valid Unicode"),
    ("lone surrogate, ingest", "/v1/ingest", b'{"documents": ["text \\ud800 more text here"]}', 400, "not valid Unicode"),
    ("lone surrogate, ingest system", "/v1/ingest", b'{"documents": ["text"], "system": "\\ud800"}', 400,
     "not valid Unicode"),
    ("wrong type", "/v1/chat/completions", {**CHAT, "top_p": "high"}, 400, "top_p"),
    ("unknown field", "/v1/chat/completions", {**CHAT, "temprature": 0.5}, 400, "unknown field 'temprature'"),
    ("tools", "/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ("functions", "/v1/chat/completions", {**CHAT, "functions": [{"name": "f"}]}, 400, "functions"),
    ("logprobs", "/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs"),
    ("n = 3", "/v1/chat/completions", {**CHAT, "n": 3}, 400, "'n'"),
    ("response_format", "/v1/chat/completions", {**CHAT, "response_format": {"type": "json_object"}}, 400,
     "response_format"),
    ("completion logprobs", "/v1/completions", {"model": "cacheclip", "prompt": "hi", "logprobs": 5}, 400, "logprobs"),
    ("cache_salt not a string", "/v1/chat/completions", {**CHAT, "cache_salt": 7}, 400, "cache_salt"),
]


@pytest.mark.parametrize("name,path,body,status,says", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_every_malformed_request_is_a_4xx_naming_the_problem_and_nothing_internal(live, name, path, body, status, says):
    url, _ = live
    headers = {"Authorization": f"Bearer {A}", "Content-Type": "application/json"}
    if isinstance(body, bytes):
        reply = httpx.post(url + path, content=body, headers=headers, timeout=60)
    else:
        reply = httpx.post(url + path, json=body, headers=headers, timeout=60)
    assert reply.status_code == status, reply.text
    message = reply.json()["error"]["message"]
    assert says in message, message
    assert not any(word in reply.text for word in ("Traceback", "TypeError", "RecursionError", "Exception"))


def test_the_openai_client_gets_a_400_for_features_the_server_does_not_have(live):
    url, _ = live
    client = openai.OpenAI(base_url=url + "/v1", api_key=A, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="tools"):
        client.chat.completions.create(model="cacheclip", messages=CHAT["messages"], tools=[
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}])
    assert client.chat.completions.create(model="cacheclip", messages=CHAT["messages"], max_tokens=1,
                                          user="someone", metadata={"run": "1"}).choices  # without effect: accepted


def test_health_says_only_alive_and_metrics_need_an_admin_key(live):
    url, _ = live
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    assert httpx.get(url + "/metrics").status_code == 401
    assert httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {A}"}).status_code == 403
    metrics = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert metrics.status_code == 200 and "cacheclip_requests_total" in metrics.text


def test_a_huge_prompt_is_refused_before_tokenizing_and_never_stalls_other_clients(live):
    """7 MiB of prompt: refused by its character count, and meanwhile /health and another client's stream
    answer (measured by order of completion, not by a time limit)."""
    url, server = live
    done: list[str] = []
    huge = {"model": "cacheclip", "messages": [{"role": "user", "content": "word " * ((7 << 20) // 5)}]}

    def send_huge():
        reply = httpx.post(url + "/v1/chat/completions", json=huge, timeout=300, headers={"Authorization": f"Bearer {A}"})
        assert reply.status_code == 400 and "characters" in reply.json()["error"]["message"], reply.text[:300]
        done.append("huge")

    thread = threading.Thread(target=send_huge)
    thread.start()
    for _ in range(20):
        assert httpx.get(url + "/health", timeout=30).status_code == 200
    thread.join()
    assert done == ["huge"]


def test_a_long_prompt_being_tokenized_does_not_stop_health_or_other_streams(engine, keys_file):
    """With the character limit lifted, a 7 MiB prompt takes seconds to tokenize; that happens off the
    event loop, so /health and another client's stream finish while it is still being processed."""
    order: list[str] = []
    with running(engine, tenant_keys=load_keys(keys_file), max_prompt_chars=64 << 20) as (url, _):
        huge = {"model": "cacheclip", "messages": [{"role": "user", "content": "word " * ((7 << 20) // 5)}]}

        def send_huge():
            httpx.post(url + "/v1/chat/completions", json=huge, timeout=600, headers={"Authorization": f"Bearer {A}"})
            order.append("huge")

        thread = threading.Thread(target=send_huge)
        thread.start()
        time.sleep(1.0)  # the body is in; tokenizing has begun
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        order.append("health")
        client = openai.OpenAI(base_url=url + "/v1", api_key=B, max_retries=0)
        pieces = list(client.chat.completions.create(model="cacheclip", messages=CHAT["messages"], max_tokens=3,
                                                     stream=True))
        order.append("stream")
        thread.join()
    assert pieces and order == ["health", "stream", "huge"], order


def test_slow_clients_are_closed_and_cannot_hold_the_server(live):
    """Connections that send their headers a byte at a time are closed after the header timeout; a body
    that stalls gets 408; a normal request is answered throughout."""
    url, _ = live
    host, port = url.removeprefix("http://").split(":")
    slow = []
    for _ in range(30):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        slow.append(sock)
    assert httpx.get(url + "/health").status_code == 200
    closed = 0
    for sock in slow:
        sock.settimeout(60)
        try:
            closed += sock.recv(1024) == b""
        except ConnectionResetError:
            closed += 1
        sock.close()
    assert closed == len(slow)
    stalled = socket.create_connection((host, int(port)))
    body = json.dumps(CHAT).encode()
    stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    + f"Authorization: Bearer {A}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body[:10])
    stalled.settimeout(60)
    assert b" 408 " in stalled.recv(4096).split(b"\r\n")[0] + b" "
    stalled.close()
    assert httpx.get(url + "/health").status_code == 200
