"""Short checks on the real embedded models (marked slow; a few seconds each after conversion).

Exactness is checked in float32 (pinned: "auto" is bfloat16 on a CPU with native bf16), with tolerance
2e-3 on float32 logits of magnitude ~10-30: the reuse path sums in another order over
~1K rows and 30 layers, which moves logits by ~1e-4; a wrong row or position moves them by >0.1.
"""

import pytest

from cacheclip_rag.cli import demo_chunks
from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.models.loading import load_model
from cacheclip_rag.models.packed_linear import packing_available
from cacheclip_rag.store import LMDBStore
from tests.conftest import has_embedded_models, max_diff

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not has_embedded_models(), reason="embedded models not installed")]
TOL = 2e-3
QUESTION = "How many pistons support the Halvorsen mirror?"


@pytest.fixture(scope="module")
def smollm2():
    return load_model("smollm2-135m", dtype="float32")


def engine_for(primary, aux, path, store_dtype="float32"):
    """float32 storage for the exactness checks; the default float16 storage is checked on its own."""
    return Engine(primary=primary, store=LMDBStore(path), aux=aux,
                  config=EngineConfig(store_path=path, store_dtype=store_dtype))


def first_logits(engine, method, chunks, ratio=0.2, **kw):
    return engine.generate(QUESTION, chunks, RequestOptions(method=method, ratio=ratio, max_new_tokens=1, **kw)).first_logits


def test_smollm2_single_chunk_reuse_equals_full(smollm2, tmp_path):
    engine = engine_for(smollm2, smollm2, tmp_path)
    chunk = demo_chunks()[1:2]
    assert max_diff(first_logits(engine, "shared_prefix", chunk), first_logits(engine, "full", chunk)) < TOL


def test_smollm2_ratio_one_equals_full_and_reuse_does_not(smollm2, tmp_path):
    engine = engine_for(smollm2, smollm2, tmp_path)
    chunks = demo_chunks()[:4]
    full = first_logits(engine, "full", chunks)
    assert max_diff(first_logits(engine, "cacheclip", chunks, ratio=1.0), full) < TOL
    assert max_diff(first_logits(engine, "shared_prefix", chunks), full) > 0.1


def test_gemma_primary_with_smollm2_aux_ratio_one_equals_full(smollm2, tmp_path):
    gemma = load_model("gemma3-270m", dtype="float32")
    engine = engine_for(gemma, smollm2, tmp_path)
    chunks = demo_chunks()[:3]
    full = first_logits(engine, "full", chunks)
    for selection in ("aux", "question"):  # the aux's selection and the question's
        assert max_diff(first_logits(engine, "cacheclip", chunks, ratio=1.0, selection=selection), full) < TOL
    answer = engine.generate(QUESTION, demo_chunks(), RequestOptions(method="full", max_new_tokens=8))
    assert "96" in answer.text  # the real model answers from the documents


def test_float16_storage_costs_little_on_the_real_pair(smollm2, tmp_path):
    """The CPU default stores chunk caches in float16: the first-token distribution moves by a KL far
    below what any reuse method costs (shared_prefix vs full is ~0.1 nats on these chunks)."""
    import torch

    gemma = load_model("gemma3-270m", dtype="float32")
    chunks = demo_chunks()[:4]
    exact = first_logits(engine_for(gemma, smollm2, tmp_path / "fp32"), "cacheclip", chunks)
    half = first_logits(engine_for(gemma, smollm2, tmp_path / "fp16", store_dtype="auto"), "cacheclip", chunks)
    p, q = torch.log_softmax(exact.double(), -1), torch.log_softmax(half.double(), -1)
    kl = float((p.exp() * (p - q)).sum())
    assert 0 <= kl < 1e-3, kl


def test_bfloat16_keeps_the_invariants_within_its_rounding(tmp_path):
    """In bfloat16 (the CPU default where bf16 is native) ratio 1.0 still lands on full attention: its
    first-token KL to `full` is rounding (different row batching rounds differently), far below what
    reuse without recompute costs, and the greedy token is full's."""
    import torch

    lm = load_model("smollm2-135m", dtype="bfloat16")
    engine = engine_for(lm, lm, tmp_path, store_dtype="auto")
    chunks = demo_chunks()[:4]
    full = first_logits(engine, "full", chunks)
    assert full.dtype == torch.bfloat16

    def kl(other):
        p, q = torch.log_softmax(full.double(), -1), torch.log_softmax(other.double(), -1)
        return float((p.exp() * (p - q)).sum())

    exact, reused = first_logits(engine, "cacheclip", chunks, ratio=1.0), first_logits(engine, "shared_prefix", chunks)
    assert int(exact.argmax()) == int(full.argmax())
    assert kl(exact) < 0.1 * kl(reused), (kl(exact), kl(reused))


@pytest.mark.skipif(not packing_available(), reason="this CPU lacks oneDNN's bf16 kernels (AVX-512 BW/VL/DQ)")
def test_prepacked_linears_give_the_dense_models_logits_on_a_real_model():
    """SmolLM2-135M in bf16 (tied head): the prepacked model is as close to float32's logits as the dense bf16
    model is, and picks float32's greedy token as often. (Against each other the two bf16 models differ by up
    to 3% of the largest logit on an AMX machine, where oneDNN sums in other orders: each is bf16's error.)"""
    import torch

    from cacheclip_rag.models.packed_linear import PackedLinear

    packed, dense = load_model("smollm2-135m", dtype="bfloat16"), load_model("smollm2-135m", dtype="bfloat16",
                                                                             prepack=False)
    assert isinstance(packed.model.lm_head, PackedLinear) and packed.fingerprint == dense.fingerprint
    reference = load_model("smollm2-135m", dtype="float32")
    ids = torch.tensor([packed.encode(" ".join(demo_chunks()[:3]))])
    with torch.inference_mode():
        a, b = packed.model(ids).logits[0].float(), dense.model(ids).logits[0].float()
        f = reference.model(ids).logits[0].float()
    assert (a - f).abs().max() <= 1.25 * (b - f).abs().max() and (a - f).abs().mean() <= 1.25 * (b - f).abs().mean()
    agree = lambda x: float((x.argmax(-1) == f.argmax(-1)).float().mean())  # noqa: E731
    assert agree(a) >= agree(b) - 0.01 and agree(a) >= 0.95
