"""The lean store: chunk caches stored in float16 on the CPU by default, `direct` only when asked,
bytes per token and model names in `inspect`."""

import subprocess
import sys

import pytest
import torch

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.stages.load.ingest import DIRECT, SHARED, as_stored, chunk_key, prefix_cache
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
    options = RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=1, min_recompute_tokens=0)
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


def _fp8_reference(t: torch.Tensor) -> torch.Tensor:
    """Independent e4m3 round trip with one scale per channel (layer, head, dim), in plain torch."""
    scale = t.abs().amax(dim=2, keepdim=True) / 448.0
    return (t / scale).to(torch.float8_e4m3fn).float() * scale


def test_float8_entries_round_trip_through_the_format_as_their_quantization():
    from cacheclip_rag.store import FP8, CorruptEntryError, decode_entry, encode_entry

    torch.manual_seed(0)
    keys, values = torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 8) * 0.01
    keys[..., 3] *= 50  # an outlier channel must not crush the others: scales are per channel
    entry = as_stored(ChunkEntry(keys, values, tuple(range(7)), tuple((i, i + 1) for i in range(7)), model="m"), FP8)
    assert entry.keys.dtype == FP8 and entry.scales[0].shape == (3, 2, 1, 8)
    raw = encode_entry("fp", entry)
    half = encode_entry("fp", ChunkEntry(keys.half(), values.half(), entry.token_ids, entry.offsets, model="m"))
    # K and V one byte less an element, plus two float32 scales a channel (and the longer dtype name)
    assert len(raw) - len(half) == -2 * keys.numel() + 2 * 3 * 2 * 8 * 4 + len("float8_e4m3fn") - len("float16")
    decoded = decode_entry(raw, "fp")
    assert decoded.keys.dtype == torch.float32 and decoded.stored_dtype == FP8 and decoded.model == "m"
    torch.testing.assert_close(decoded.keys, _fp8_reference(keys), rtol=1e-6, atol=0)
    torch.testing.assert_close(decoded.values, _fp8_reference(values), rtol=1e-6, atol=0)
    # e4m3 keeps 3 mantissa bits: each element within 1/16 of its own magnitude (or of the channel's
    # amax / 2^9 below the normal range)
    bound = keys.abs() / 16 + keys.abs().amax(2, keepdim=True) / 448 * 2**-9
    assert bool(((decoded.keys - keys).abs() <= bound + 1e-7).all())
    # the quantization of a decoded entry is the same entry (a tier filling from another one keeps it)
    again = decode_entry(encode_entry("fp", as_stored(decoded, decoded.stored_dtype)), "fp")
    assert torch.equal(again.keys, decoded.keys) and torch.equal(again.values, decoded.values)
    damaged = bytearray(raw)
    damaged[-3] ^= 0x10  # inside V's scales
    try:
        decode_entry(bytes(damaged), "fp")
    except CorruptEntryError:
        pass
    else:
        raise AssertionError("a flipped scale byte was served")


def test_float8_storage_halves_float16_and_the_engine_answers_from_the_dequantized_cache(tmp_path):
    lm = tiny_model("qwen2")
    fp8, exact = (_engine(tmp_path / "a", lm, store_dtype="float8_e4m3fn"),
                  _engine(tmp_path / "b", lm, store_dtype="float32"))
    for engine in (fp8, exact):
        engine.ingest(CHUNKS, progress=False)
    stored, reference = _stored(fp8, CHUNKS[0]), _stored(exact, CHUNKS[0])
    torch.testing.assert_close(stored.keys, _fp8_reference(reference.keys), rtol=1e-6, atol=0)
    row = fp8.store.stats()["models"][lm.fingerprint.digest]
    assert row["dtypes"] == ["float32", "float8_e4m3fn"]  # the shared prefix stays exact
    layers, kv, dim = 3, 2, 16
    assert 2 * layers * kv * dim < row["bytes_per_token"] < 2 * layers * kv * dim * 2  # < float16's per token
    options = RequestOptions(method="cacheclip", ratio=0.2, max_new_tokens=1, min_recompute_tokens=0)
    a = fp8.generate(QUESTION, CHUNKS, options).first_logits
    b = exact.generate(QUESTION, CHUNKS, options).first_logits
    assert 0 < max_diff(a, b) < 0.1 * float(b.abs().max())
    full = exact.generate(QUESTION, CHUNKS, RequestOptions(method="full", max_new_tokens=1)).first_logits
    torch.testing.assert_close(fp8.generate(QUESTION, CHUNKS, RequestOptions(method="full", max_new_tokens=1)).first_logits,
                               full)  # full reads no stored chunk: unchanged


def test_config_accepts_float8_storage_and_names_bad_dtypes():
    assert EngineConfig(store_dtype="float8_e4m3fn").store_dtype == "float8_e4m3fn"
    with pytest.raises(ValueError, match="dtype must be"):
        EngineConfig(store_dtype="float8")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_float8_entries_decode_on_cuda_as_on_the_cpu():
    from cacheclip_rag.store import FP8, decode_entry, encode_entry

    torch.manual_seed(1)
    entry = as_stored(ChunkEntry(torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8), tuple(range(5)), ()), FP8)
    raw = encode_entry("fp", entry)
    cpu, gpu = decode_entry(raw, "fp"), decode_entry(raw, "fp", device="cuda")
    assert gpu.keys.device.type == "cuda"
    assert torch.equal(gpu.keys.cpu(), cpu.keys) and torch.equal(gpu.values.cpu(), cpu.values)
