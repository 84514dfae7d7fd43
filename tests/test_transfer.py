"""Cross-model KV transfer: the ridge fit, RoPE strip/apply, the gate, hand-offs and store migration.

The exact pair: a tiny Llama and a copy whose keys are scaled per KV head (queries scaled back) and
whose values go through an invertible matrix per KV head (the output projection undoes it). Both
give identical logits, and every target layer's K/V is an exact linear function of the same source
layer's, so a correct calibration must find R² ≈ 1 and a transferred cache must reproduce the
target's own logits.
"""

import copy
import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cacheclip_rag.config import EngineConfig, RequestOptions
from cacheclip_rag.engine.core import Engine
from cacheclip_rag.evaluation.ruler import prose_sentence
from cacheclip_rag.models.loading import LoadedModel
from cacheclip_rag.store import LMDBStore
from cacheclip_rag.testing import tiny_model
from cacheclip_rag.transfer import (
    Conversation, Mapper, MapperError, RidgeAccumulator, TransferConfig, align, apply_rope, calibrate,
    fit_all_at_once, migrate, prefill_kv, strip_rope,
)
from tests.conftest import max_diff


def texts(n: int, seed: int = 0, sentences: int = 12) -> list[str]:
    import random

    rng = random.Random(seed)
    return [" ".join(prose_sentence(rng) for _ in range(sentences)) for _ in range(n)]


@torch.no_grad()
def equivalent_copy(lm: LoadedModel, seed: int = 1) -> LoadedModel:
    """Same function, different KV: K scaled per kv head, V through an invertible map per kv head."""
    g = torch.Generator().manual_seed(seed)
    model = copy.deepcopy(lm.model)
    cfg = model.config
    kv, heads, dim = cfg.num_key_value_heads, cfg.num_attention_heads, cfg.head_dim
    group = heads // kv
    for layer in model.model.layers:
        attn = layer.self_attn
        for h in range(kv):
            s = 0.5 + torch.rand((), generator=g)
            m = torch.eye(dim) + 0.3 * torch.randn(dim, dim, generator=g)
            rows = slice(h * dim, (h + 1) * dim)
            attn.k_proj.weight[rows] *= s
            attn.v_proj.weight[rows] = m @ attn.v_proj.weight[rows]
            for q in range(h * group, (h + 1) * group):
                attn.q_proj.weight[q * dim : (q + 1) * dim] /= s
                attn.o_proj.weight[:, q * dim : (q + 1) * dim] = attn.o_proj.weight[:, q * dim : (q + 1) * dim] @ torch.linalg.inv(m)
    return LoadedModel(f"{lm.name}-equivalent", model, lm.tokenizer, lm.prompt)


@pytest.fixture(scope="module")
def pair():
    source = tiny_model("llama")
    return source, equivalent_copy(source)


@pytest.fixture(scope="module")
def exact_mapper(pair):
    source, target = pair
    return calibrate(source, target, texts(8), TransferConfig(top_k=1, ridge=1e-6, select_texts=3), progress=False)


def test_rope_strip_and_apply_round_trip(tiny):
    keys, _ = prefill_kv(tiny, list(range(5, 60)))
    positions = torch.arange(keys.shape[2]) + 3
    back = apply_rope(tiny, strip_rope(tiny, keys, positions), positions)
    assert max_diff(back, keys) < 1e-5 * max(1.0, keys.abs().max().item())
    # stripping makes a key position-free: the same raw key at two positions strips to one value
    moved = apply_rope(tiny, strip_rope(tiny, keys, positions), positions + 100)
    assert max_diff(strip_rope(tiny, moved, positions + 100), strip_rope(tiny, keys, positions)) < 1e-4


def test_equivalent_copy_really_is_equivalent(pair):
    source, target = pair
    ids = source.encode(texts(1)[0])
    ks, vs = prefill_kv(source, ids)
    kt, vt = prefill_kv(target, ids)
    assert max_diff(ks, kt) > 0.05 and max_diff(vs, vt) > 0.05  # the caches differ
    logits = [m(torch.tensor([ids])).logits for m in (source.model, target.model)]
    assert max_diff(*logits) < 2e-3  # the function does not (fp32 rounding through the inverse maps: ~5e-4)


def test_fit_recovers_an_exact_linear_pair(pair, exact_mapper):
    source, target = pair
    assert exact_mapper.layers == [[i] for i in range(source.config.num_hidden_layers)]  # layer l -> layer l
    assert min(exact_mapper.validation["key_r2"]) > 0.9999
    assert min(exact_mapper.validation["value_r2"]) > 0.9999


def test_streaming_accumulation_equals_one_fit_and_handles_other_shapes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(900, 48, generator=g)  # e.g. 3 source kv heads x 16 dims
    true = torch.randn(48, 40, generator=g)  # to 5 target kv heads x 8 dims
    y = x @ true
    stream = RidgeAccumulator(48, 40)
    for part in range(0, 900, 128):
        stream.add(x[part : part + 128], y[part : part + 128])
    at_once = fit_all_at_once(x, y, 1e-9)
    assert torch.allclose(stream.solve(1e-9), at_once, atol=1e-5)
    assert torch.allclose(at_once, true, atol=1e-3)


def test_transferred_conversation_reproduces_the_targets_own_logits(pair, exact_mapper):
    source, target = pair
    conv = Conversation.start(source, capacity=2048)
    conv.add(texts(1, seed=5)[0] + " Question: what was repaired? Answer:")
    handed = conv.hand_off(target, exact_mapper)
    reference = Conversation.start(target, capacity=2048)
    reference.add(conv.text)
    assert max_diff(handed.logits, reference.logits) < 1e-3
    assert handed.reply(8) == reference.reply(8)


def test_several_hand_offs_in_one_conversation(pair, exact_mapper):
    source, target = pair
    back = calibrate(target, source, texts(8, seed=3), TransferConfig(top_k=1, ridge=1e-6, select_texts=3), progress=False)
    conv = Conversation.start(source, capacity=2048)
    for turn in range(3):
        conv.add(f" Turn {turn}: " + texts(1, seed=10 + turn, sentences=4)[0])
        conv.reply(6)
        conv = conv.hand_off(target if conv.lm is source else source, exact_mapper if conv.lm is source else back)
    prefix = conv.lm.encode_prefix("")
    reference = conv.lm.model(torch.tensor([[*prefix, *conv.ids]])).logits[0, -1]
    # each fp32 mapping moves logits by ~1e-3 (held-out R² 1 - 1e-7); three stay far below the ~0.4 that
    # one misaligned or wrong-position mapping causes
    assert max_diff(conv.logits, reference) < 1e-2
    assert int(conv.logits.argmax()) == int(reference.argmax())


def test_gate_refuses_a_poor_mapper_and_another_pair(pair, exact_mapper, tmp_path):
    source, target = pair
    unrelated = tiny_model("llama", seed=7)
    poor = calibrate(source, unrelated, texts(6), TransferConfig(top_k=1, min_r2=0.9, select_texts=2), progress=False)
    assert poor.gate_r2 < 0.9
    with pytest.raises(MapperError, match="validation gate"):
        poor.check(source, unrelated)
    poor.check(source, unrelated, force=True)  # forced: allowed
    with pytest.raises(MapperError, match="fitted for"):
        exact_mapper.check(source, unrelated)
    exact_mapper.save(tmp_path / "mapper")
    loaded = Mapper.load(tmp_path / "mapper", source, target)
    assert loaded.layers == exact_mapper.layers and loaded.validation == exact_mapper.validation
    assert all(torch.equal(a, b) for a, b in zip(loaded.key_weights, exact_mapper.key_weights))
    with pytest.raises(MapperError, match="fitted for"):
        Mapper.load(tmp_path / "mapper", target, source)


def test_default_gate_refuses_the_measured_mappers_that_lost_needles_and_passes_the_one_that_kept_them(pair,
                                                                                                      exact_mapper):
    """Held-out R² means (keys, values) measured on real pairs (bench/RESULTS.md): SmolLM2 -> SmolLM2-pruned kept
    re-prefill's NIAH accuracy; Qwen2.5-Coder 1.5B -> 0.5B kept 3 of 12 needles, 0.5B -> 1.5B none."""
    source, target = pair
    for keys, values, passes in ((0.973, 0.950, True), (0.896, 0.852, False), (0.792, 0.701, False)):
        mapper = replace(exact_mapper, min_r2=TransferConfig().min_r2,
                         validation={"key_r2": [keys] * 2, "value_r2": [values] * 2, "rows": 10})
        if passes:
            mapper.check(source, target)
        else:
            with pytest.raises(MapperError, match="validation gate"):
                mapper.check(source, target)


def test_alignment_by_characters():
    # source tokens: "ab|cd|ef", target tokens: "abc|def"
    index = align([(0, 2), (2, 4), (4, 6)], [(0, 3), (3, 6)], 6)
    assert index.tolist() == [1, 2]  # each target token takes the source token holding its last char
    assert align([(0, 2), (2, 4)], [(0, 2), (2, 4)], 4).tolist() == [0, 1]


def test_migrate_moves_a_store_to_another_primary(pair, exact_mapper, tmp_path):
    source, target = pair
    chunks = texts(3, seed=21, sentences=5)
    store = LMDBStore(tmp_path / "store")
    config = EngineConfig(store_path=tmp_path / "store", system_prompt="Be brief.", store_dtype="float32")
    Engine(primary=source, store=store, config=config, aux=source).ingest(chunks, progress=False)
    report = migrate(store, source, target, exact_mapper, [*chunks, "never ingested"], "Be brief.", progress=False)
    assert (report.moved, report.already_present, report.missing) == (3, 0, 1)
    assert report.weakest_key_r2 > 0.9999
    again = migrate(store, source, target, exact_mapper, chunks, "Be brief.", progress=False)
    assert again.moved == 0 and again.already_present == 3
    options = RequestOptions(method="shared_prefix", max_new_tokens=4)
    migrated = Engine(primary=target, store=store, config=config).generate("what was repaired?", chunks, options)
    fresh_store = LMDBStore(tmp_path / "fresh")
    native = Engine(primary=target, store=fresh_store, config=EngineConfig(store_path=tmp_path / "fresh",
                    system_prompt="Be brief.", store_dtype="float32")).generate("what was repaired?", chunks, options)
    assert max_diff(migrated.first_logits, native.first_logits) < 1e-3
    with pytest.raises(MapperError):
        migrate(store, target, source, exact_mapper, chunks, "Be brief.", progress=False)


def test_config_validation():
    with pytest.raises(ValueError, match="top_k"):
        TransferConfig(top_k=0)
    with pytest.raises(ValueError, match="ridge"):
        TransferConfig(ridge=0.0)


def test_mlp_learns_what_a_linear_map_cannot():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 12, generator=g)
    y = torch.tanh(2 * x[:, :6]) * x[:, 6:12]  # no linear map explains this
    linear = fit_all_at_once(_bias(x), y, 1e-6)
    residual = y - _bias(x) @ linear
    from cacheclip_rag.transfer import apply_mlp, fit_mlp, r_squared

    mlp = fit_mlp(x[:3000], residual[:3000], hidden=64, steps=600)
    held_linear = _bias(x[3000:]) @ linear
    assert r_squared(held_linear, y[3000:]) < 0.2
    assert r_squared(held_linear + apply_mlp(mlp, x[3000:]), y[3000:]) > 0.6


def _bias(x):
    return torch.cat([x, torch.ones(len(x), 1)], dim=1)


def test_calibration_with_mlps_validates_and_round_trips(pair, tmp_path):
    source, _ = pair
    unrelated = tiny_model("llama", seed=7)
    config = TransferConfig(top_k=2, select_texts=2, mlp_hidden=16, mlp_steps=50)
    mapper = calibrate(source, unrelated, texts(6), config, progress=False)
    assert len(mapper.key_mlps) == len(mapper.layers) == unrelated.config.num_hidden_layers
    assert len(mapper.validation["key_r2"]) == len(mapper.layers)
    mapper.save(tmp_path / "mlp")
    loaded = Mapper.load(tmp_path / "mlp")
    keys = torch.randn(source.config.num_hidden_layers, 5, 32)
    # same weights; BLAS may take another path for the loaded (contiguous) copies: rounding only
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(loaded.map(keys, keys), mapper.map(keys, keys)))


def test_transfer_results_keep_other_mappers_rows_and_replace_a_rerun(tmp_path):
    """bench_transfer_qwen writes one JSON for every mapper it was run with: a rerun replaces its own row."""
    path = Path(__file__).resolve().parents[1] / "bench" / "bench_transfer_qwen.py"
    spec = importlib.util.spec_from_file_location("bench_transfer_qwen", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def run(mapper: str, retention: float) -> tuple[list[dict], dict]:
        row = {"source": "a", "target": "b", "mapper": mapper, "retention": retention, "_calibration_s": 1.0}
        return [row], {"a->b": [{"direction": "a->b", "mapper": mapper, "niah_transfer": retention}]}

    out = tmp_path / "transfer.json"
    bench.write_rows(out, *run("top3", 0.0))
    bench.write_rows(out, *run("top24", 0.5))
    bench.write_rows(out, *run("top24", 0.75))
    saved = json.loads(out.read_text())
    assert [(r["mapper"], r["retention"]) for r in saved["rows"]] == [("top3", 0.0), ("top24", 0.75)]
    assert [d["_calibration_s"] for d in saved["details"]] == [1.0, 1.0]
    assert all("_calibration_s" not in r for r in saved["rows"])
    assert [(s["mapper"], s["niah_transfer"]) for s in saved["samples"]["a->b"]] == [("top3", 0.0), ("top24", 0.75)]
