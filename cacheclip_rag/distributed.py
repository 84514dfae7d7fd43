"""Distributed ingest on Ray: actors each load the model once, take batches of chunks that the
shared store does not hold yet, compute their KV and write straight to the store.

The driver sees only keys and a progress bar. Fault tolerance is Ray's own: actors restart when
their process dies (`max_restarts`) and the batch they were computing is retried
(`max_task_retries`). A batch is idempotent (chunks already stored are skipped) and every entry is
written whole or not at all (one store transaction, or parts-then-key on Redis), so a retry or a
rerun computes only what is missing.

    keys = ingest_on_ray(partial(load_model, "gemma3-270m"), partial(RedisStore, "redis://host:6379"),
                         texts, system_prompt, workers=8, num_gpus=1)

Needs `pip install 'cacheclip-rag[ray]'`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from tqdm.auto import tqdm

from .stages.load.ingest import SHARED, chunk_key, precompute, prefix_cache, storage_dtype, validate_chunks
from .models.loading import LoadedModel


class IngestWorker:
    """One Ray actor: a model and a store connection, loaded once."""

    def __init__(self, model_factory: Callable[[], LoadedModel], store_factory: Callable, *, system_prompt: str,
                 variant: str, threads: int, store_dtype: str = "auto"):
        torch.set_num_threads(threads)
        self.lm = model_factory()
        self.store = store_factory()
        self.system_prompt, self.variant = system_prompt, variant
        self.store_dtype = storage_dtype(store_dtype, self.lm)

    def keys(self, texts: list[str]) -> list[bytes]:
        prefix = prefix_cache(self.lm, self.store, self.system_prompt)
        return [chunk_key(self.lm, prefix.token_ids, t, self.variant) for t in texts]

    def compute(self, texts: list[str]) -> int:
        precompute(self.lm, self.store, texts, self.system_prompt, variant=self.variant, batch_size=len(texts), progress=False,
                   store_dtype=self.store_dtype)
        return len(texts)

    def pid(self) -> int:
        import os

        return os.getpid()


def ingest_on_ray(
    model_factory: Callable[[], LoadedModel],
    store_factory: Callable,
    texts: Sequence[str],
    system_prompt: str,
    *,
    variant: str = SHARED,
    workers: int = 2,
    batch_size: int = 8,
    address: str | None = None,
    num_gpus: float = 0,
    threads_per_worker: int = 1,
    max_retries: int = 3,
    progress: bool = True,
    on_started: Callable[[list], None] | None = None,
    store_dtype: str = "auto",
) -> tuple[list[bytes], int]:
    """Precompute `texts` on `workers` Ray actors into the store `store_factory()` opens in each.

    `model_factory` and `store_factory` are picklable callables (e.g. `functools.partial`); the
    store must be reachable from every worker (a Redis URL; an LMDB folder only on one machine).
    Connects to the cluster at `address` (None: the running one, else a local one). Returns the
    keys in input order and how many chunks were computed (0 on a rerun). `on_started` gets the
    actor handles once they run (for tests that kill one). `store_dtype` as `EngineConfig.store_dtype`
    (resolved in each worker, for its model and device)."""
    try:
        import ray
        from ray.util import ActorPool
    except ImportError as err:
        raise ModuleNotFoundError("distributed ingest needs Ray: pip install 'cacheclip-rag[ray]'") from err
    validate_chunks(texts)
    if workers < 1 or batch_size < 1:
        raise ValueError(f"workers and batch_size must be >= 1, got {workers} and {batch_size}")
    if not ray.is_initialized():
        ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    remote = ray.remote(num_cpus=threads_per_worker, num_gpus=num_gpus, max_restarts=max_retries,
                        max_task_retries=max_retries)(IngestWorker)
    actors = [remote.remote(model_factory, store_factory, system_prompt=system_prompt, variant=variant,
                            threads=threads_per_worker, store_dtype=store_dtype) for _ in range(workers)]
    keys = ray.get(actors[0].keys.remote(list(texts)))
    store = store_factory()
    try:
        todo = list(dict.fromkeys(t for k, t in zip(keys, texts) if not store.contains(k)))
    finally:
        store.close()
    if on_started is not None:
        on_started(actors)
    batches = [todo[i : i + batch_size] for i in range(0, len(todo), batch_size)]
    bar = tqdm(total=len(todo), desc=f"ingest on {workers} Ray workers", unit="chunk", disable=not progress)
    computed = 0
    for done in ActorPool(actors).map_unordered(lambda actor, batch: actor.compute.remote(batch), batches):
        computed += done
        bar.update(done)
    bar.close()
    for actor in actors:
        ray.kill(actor)
    return keys, computed
