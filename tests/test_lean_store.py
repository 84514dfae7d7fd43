"""The lean store: chunk caches stored in float16 on the CPU by default, `direct` only when asked,
bytes per token and model names in `inspect`."""

import subprocess
import sys

import torch

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine import Engine
from cacheclip_rag.ingest import DIRECT, SHARED, as_stored, chunk_key, prefix_cache
from cacheclip_rag.store import ChunkEntry, LMDBStore
from cacheclip_rag.testing import tiny_model
from tests.conftest import CHUNKS, QUESTION, max_diff


def _engine(tmp_path, lm, **config):
    store = LMDBStore(tmp_path / "store")
    return Engine(primary=lm, store=store, aux=lm,
                  config=EngineConfig(store_path=tmp_path / "store", system_prompt="Be brief.", **config))


def _stored(engine, text, variant=SHARED):
    prefix = prefix_cache(engine.primary, engine.store, engine.config.system_prompt)
    return engine.store.get(chunk_key(engine.primary, prefix.token_ids, text, variant), engine.primary.fingerprint.digest)


def test_cpu_default_stores_float16_at_half_the_bytes_and_nearly_the_same_answer(tmp_path):
    lm = tiny_model("gemma3")
    lean, exact = _engine(tmp_path / "a", lm), _engine(tmp_path / "b", lm, store_dtype="float32")
    for engine in (lean, exact):
        engine.ingest(CHUNKS, progress=False)
    half, full_size = _stored(lean, CHUNKS[0]), _stored(exact, CHUNKS[0])
    assert half.keys.dtype == torch.float16 and full_size.keys.dtype == torch.float32
    assert half.nbytes * 2 == full_size.nbytes
    assert max_diff(half.keys, full_size.keys) < 2e-3 * float(full_size.keys.abs().max())  # rounding, not damage
    options = RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=1)
    a = lean.generate(QUESTION, CHUNKS, options).first_logits
    b = exact.generate(QUESTION, CHUNKS, options).first_logits
    log_p, log_q = torch.log_softmax(b.double(), -1), torch.log_softmax(a.double(), -1)
    assert 0 < float((log_p.exp() * (log_p - log_q)).sum()) < 1e-3


def test_direct_is_stored_only_when_asked(tmp_path):
    engine = _engine(tmp_path, tiny_model("llama"))
    engine.ingest(CHUNKS, progress=False)
    assert _stored(engine, CHUNKS[0]) is not None and _stored(engine, CHUNKS[0], DIRECT) is None
    answer = engine.generate(QUESTION, CHUNKS, RequestOptions(method="direct", max_new_tokens=2))
    assert answer.text is not None and _stored(engine, CHUNKS[0], DIRECT) is not None  # computed on the miss
    engine.ingest(CHUNKS[1:], progress=False, direct=True)
    assert _stored(engine, CHUNKS[1], DIRECT) is not None


def test_an_entry_beyond_float16_range_is_kept_in_bfloat16():
    keys = torch.ones(2, 1, 3, 4)
    keys[0, 0, 0, 0] = 1e5
    entry = as_stored(ChunkEntry(keys, torch.ones(2, 1, 3, 4), (1, 2, 3), ((0, 1), (1, 2), (2, 3))), torch.float16)
    assert entry.keys.dtype == torch.bfloat16 and torch.isfinite(entry.keys).all()
    small = as_stored(ChunkEntry(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4), (1, 2, 3), ((0, 1),) * 3), torch.float16)
    assert small.keys.dtype == torch.float16


def test_inspect_prints_bytes_per_token_and_model_names(tmp_path):
    engine = _engine(tmp_path, tiny_model("qwen2"))
    engine.ingest(CHUNKS, progress=False)
    row = engine.store.stats()["models"][engine.primary.fingerprint.digest]
    # chunks in float16; the one shared-prefix entry stays in the model's dtype (exact rows for every request)
    assert row["names"] == ["tiny-qwen2-0"] and row["dtypes"] == ["float16", "float32"]
    layers, kv, dim = 3, 2, 16  # tiny config: 3 layers, 2 KV heads of 64 / 4 = 16
    per_token = 2 * layers * kv * dim * 2  # K and V, float16
    assert per_token < row["bytes_per_token"] < per_token * 1.5  # the rest is headers and token ids
    engine.store.close()
    out = subprocess.run([sys.executable, "-m", "cacheclip_rag.cli", "inspect", "--store", str(tmp_path / "store")],
                         capture_output=True, text=True, check=True).stdout
    assert "tiny-qwen2-0" in out and "KB/token" in out and "float16" in out
