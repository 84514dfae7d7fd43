"""The command line: ingest a folder into FAISS + the KV store, query the index, inspect the store
(on the embedded SmolLM2, slow); verify, evict and compact a store."""

import pytest

from cacheclip_rag.cli import main
from tests.conftest import has_embedded_models

@pytest.mark.slow
@pytest.mark.skipif(not has_embedded_models(), reason="embedded models not installed")
def test_ingest_query_inspect(tmp_path, capsys):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "ferry.md").write_text("## Ferry\nThe ferry to Marrow Island leaves at 7:40 every morning.\n\n"
                                   "## Bakery\nThe bakery on Mill Street sells out by nine.\n")
    (docs / "notes.txt").write_text("The lighthouse on Gull Point was built in 1871.")
    (docs / "skip.bin").write_bytes(b"\x00\x01")
    models = ["--primary", "smollm2-135m", "--aux", "smollm2-135m", "--store", str(tmp_path / "kv")]
    assert main(["ingest", str(docs), "--index", str(tmp_path / "index"), *models]) == 0
    assert "ingested 3 chunks" in capsys.readouterr().out
    assert main(["query", "When does the ferry leave?", "--index", str(tmp_path / "index"), "--top-k", "2",
                 "--max-new-tokens", "12", *models]) == 0
    out = capsys.readouterr()
    assert "retrieved 2 chunks" in out.err and "ttft_s" in out.err and out.out.strip()
    assert main(["inspect", "--store", str(tmp_path / "kv")]) == 0
    report = capsys.readouterr().out
    assert "entries 7" in report and "quarantined 0" in report  # prefix + 3 chunks x (shared, direct)
    with pytest.raises(SystemExit, match="no such file"):
        main(["ingest", str(tmp_path / "missing"), *models])


def test_store_maintenance_commands(tmp_path, capsys):
    from cacheclip_rag.store import LMDBStore
    from tests.stress.workers import write

    with LMDBStore(tmp_path) as store:
        write(store, 0, 50)
    assert main(["verify", "--store", str(tmp_path)]) == 0
    assert "'ok': 50" in capsys.readouterr().out
    assert main(["evict", "--store", str(tmp_path), "--max-bytes", "100000"]) == 0
    assert "evicted" in capsys.readouterr().out
    assert main(["compact", "--store", str(tmp_path)]) == 0
    assert "compacted" in capsys.readouterr().out
    with LMDBStore(tmp_path) as store:
        assert 0 < store.stats()["bytes"] <= 100000
