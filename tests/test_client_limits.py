"""One client cannot starve the others (issue 71): per-address connection limits and per-key and per-address
queue limits, each tested with an abusive client beside a legitimate one on a real server (uvicorn on
loopback; the abuser's sockets come from other loopback addresses, 127.0.0.2 and up, which Linux routes
to the same interface)."""

import asyncio
import contextlib
import json
import select
import socket
import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")

from cacheclip_rag.serve.keys import load_keys  # noqa: E402
from cacheclip_rag.serve.limits import ClientSlots  # noqa: E402
from cacheclip_rag.engine.scheduler import Job  # noqa: E402
from tests.test_serve import engine, rag_messages, running  # noqa: E402,F401 - engine: the served tiny model fixture

GOOD, BAD = "sk-good-client-" + "g" * 10, "sk-abusive-one-" + "b" * 10
CHAT = {"model": "cacheclip", "messages": rag_messages(), "max_tokens": 2}


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({GOOD: {"tenant": "good"}, BAD: {"tenant": "bad"}}))
    return load_keys(path)


def slow_connection(host: str, port: int, source: str) -> socket.socket:
    """A connection from `source` that sends half a request's headers and then nothing."""
    sock = socket.create_connection((host, port), source_address=(source, 0))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
    return sock


def test_one_address_holding_300_connections_does_not_shut_out_another(engine, keys):
    """300 connections held open by one client (slow headers) once filled the 256-connection limit and a
    legitimate client got 503. Now one address holds at most 64; the rest are answered 503 at once."""
    with running(engine, tenant_keys=keys, header_timeout_s=120) as (url, _):
        host, port = url.removeprefix("http://").split(":")
        held = [slow_connection(host, int(port), "127.0.0.2") for _ in range(300)]
        try:
            refused, waiting, deadline = 0, set(held), time.monotonic() + 60
            while refused < 300 - 64 and time.monotonic() < deadline:
                for sock in select.select(list(waiting), [], [], 1.0)[0]:
                    waiting.discard(sock)
                    refused += sock.recv(4096).startswith(b"HTTP/1.1 503")
            assert refused == 300 - 64 and not select.select(list(waiting), [], [], 0.5)[0]  # the 64 are held
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {GOOD}"}) as http:
                answers = [http.post(url + "/v1/chat/completions", json=CHAT).status_code for _ in range(8)]
            assert answers == [200] * 8
        finally:
            for sock in held:
                sock.close()


@contextlib.contextmanager
def held_worker(server):
    """The worker busy with a job the test releases: requests queue behind it."""
    release, entered = threading.Event(), threading.Event()

    def hold():
        entered.set()
        release.wait(60)
        raise RuntimeError("released")

    loop, ended = asyncio.new_event_loop(), threading.Event()  # the held job's (no) pieces: never run
    server.worker.submit(Job(hold, loop, 120, on_end=ended.set))
    assert entered.wait(30)
    try:
        yield
    finally:
        release.set()
        assert ended.wait(60)
        loop.close()


def open_stream(http: httpx.Client, url: str):
    stream = http.stream("POST", url + "/v1/chat/completions", json={**CHAT, "stream": True})
    return stream, stream.__enter__()


def test_one_key_or_address_cannot_fill_the_queue(engine, keys):
    """max_queue 8, so 4 requests a client: the abuser's fifth is refused (429, named), from its address or,
    with the same key, from another address; the legitimate client is admitted and served throughout."""
    with running(engine, tenant_keys=keys, max_queue=8) as (url, server), held_worker(server):
        bad = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {BAD}"},
                           transport=httpx.HTTPTransport(local_address="127.0.0.2"))
        elsewhere = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {BAD}"},
                                 transport=httpx.HTTPTransport(local_address="127.0.0.3"))
        good = httpx.Client(timeout=60, headers={"Authorization": f"Bearer {GOOD}"})
        opened = [open_stream(bad, url) for _ in range(5)]
        assert [r.status_code for _, r in opened] == [200] * 4 + [429]
        assert opened[-1][1].read() and opened[-1][1].json()["error"]["code"] == "client_queue_full"
        same_key = open_stream(elsewhere, url)
        assert same_key[1].status_code == 429  # the key's limit, from a fresh address
        mine = open_stream(good, url)
        assert mine[1].status_code == 200  # admitted while the abuser is at its limit
        unkeyed = ClientSlots.names(None, "127.0.0.2")
        assert server.slots.held(unkeyed[0]) == 4
    text = b"".join(mine[1].iter_bytes())
    assert b"[DONE]" in text
    for stream, _ in [*opened, same_key, mine]:
        stream.__exit__(None, None, None)
    for client in (bad, elsewhere, good):
        client.close()


def test_slots_are_given_back_however_a_request_ends(engine, keys):
    """Finished, refused by the full queue, or dropped by its client: the client's slots come back."""
    with running(engine, tenant_keys=keys, max_queue=2, max_queued_per_client=2) as (url, server):
        names = ClientSlots.names(GOOD, "127.0.0.1")
        with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {GOOD}"}) as http:
            assert http.post(url + "/v1/chat/completions", json=CHAT).status_code == 200
            assert all(server.slots.held(n) == 0 for n in names)
            with held_worker(server):
                queued = open_stream(http, url)  # the queue's second slot
                full = http.post(url + "/v1/chat/completions", json=CHAT)
                assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"
                assert server.slots.held(names[0]) == 1
                queued[0].__exit__(None, None, None)  # the client goes before its request ran
            deadline = time.monotonic() + 60
            while any(server.slots.held(n) for n in names) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert all(server.slots.held(n) == 0 for n in names)


def test_per_client_limits_are_checked_and_can_be_switched_off():
    from cacheclip_rag.serve.app import ServerSettings

    with pytest.raises(ValueError, match="per-client"):
        ServerSettings(max_connections_per_client=-1)
    assert ServerSettings(max_queue=8).queued_per_client == 4 and ServerSettings(max_queue=1).queued_per_client == 1
    slots = ClientSlots(0)
    assert all(slots.take(("key:x",)) for _ in range(100))
