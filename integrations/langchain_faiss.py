"""`CacheClipFAISS`: a LangChain vector store on `faiss` itself (no `langchain-community`, which is being
sunset and has no maintained FAISS successor), that stores each inserted text's chunk KV as it indexes it.

Every public insertion route (`add_texts`, `add_embeddings`, `add_documents`, `from_texts`,
`from_documents`, `from_embeddings` and their async forms, which LangChain's base class runs through the
sync ones) goes through `add_embeddings`, which computes the texts' caches first and writes each one's
key into its metadata (`KV_KEY`). Distances are L2 (as `langchain_community`'s FAISS), relevance scores
the base class's Euclidean mapping. `save_local` writes the FAISS index and a JSON file of the documents
(no pickle, so loading needs no trust in the folder).
"""

from __future__ import annotations

import json
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

try:
    import faiss
    import numpy as np
    from langchain_core.documents import Document
    from langchain_core.embeddings import Embeddings
    from langchain_core.vectorstores import VectorStore
    from langchain_core.vectorstores.utils import maximal_marginal_relevance
except ImportError as err:  # pragma: no cover
    raise ImportError("the LangChain integration needs: pip install 'cacheclip-rag[langchain]'") from err

from cacheclip_rag.engine.core import Engine

from .common import KV_KEY

Filter = dict[str, Any] | Callable[[dict[str, Any]], bool] | None


class CacheClipFAISS(VectorStore):
    """FAISS (exact L2 search) whose insertions precompute and store each text's KV; pass `kv_engine=`
    when building it (also to `from_texts`, `from_documents` and `load_local`). `delete(ids=...)` removes
    the documents and releases their chunk caches (a cache another document shares stays); deleting an
    id that is not (or no longer) here is not an error."""

    def __init__(self, embedding: Embeddings, *, kv_engine: Engine, index: Any = None,
                 documents: dict[str, Document] | None = None, rows: dict[int, str] | None = None):
        self.embedding = embedding
        self.kv_engine = kv_engine
        self.index = index  # faiss.IndexIDMap2 over IndexFlatL2; made at the first insertion (its width)
        self._documents: dict[str, Document] = dict(documents or {})  # id -> document, insertion order
        self._rows: dict[int, str] = dict(rows or {})  # FAISS id -> document id
        self._row_of = {doc_id: row for row, doc_id in self._rows.items()}

    @property
    def embeddings(self) -> Embeddings:
        return self.embedding

    @property
    def ids(self) -> list[str]:
        """The stored documents' ids, in insertion order."""
        return list(self._documents)

    def __len__(self) -> int:
        return len(self._documents)

    # ---- insertion ----------------------------------------------------------------------------------

    def add_texts(self, texts: Iterable[str], metadatas: list[dict] | None = None, ids: list[str] | None = None,
                  **kwargs: Any) -> list[str]:
        texts = list(texts)
        return self.add_embeddings(zip(texts, self.embedding.embed_documents(texts)), metadatas, ids, **kwargs)

    def add_embeddings(self, text_embeddings: Iterable[tuple[str, list[float]]], metadatas: Iterable[dict] | None = None,
                       ids: Sequence[str | None] | None = None, **kwargs: Any) -> list[str]:
        pairs = list(text_embeddings)
        if not pairs:
            return []
        texts = [text for text, _ in pairs]
        vectors = np.asarray([vector for _, vector in pairs], dtype=np.float32)  # [N, E]
        metas = [dict(m or {}) for m in metadatas] if metadatas is not None else [{} for _ in pairs]
        ids = [i or str(uuid.uuid4()) for i in ids] if ids is not None else [str(uuid.uuid4()) for _ in pairs]
        if not len(metas) == len(ids) == len(pairs):
            raise ValueError(f"{len(pairs)} texts, {len(metas)} metadatas and {len(ids)} ids: give one of each per text")
        if vectors.ndim != 2 or (self.index is not None and vectors.shape[1] != self.index.d):
            raise ValueError(f"embeddings of width {vectors.shape[1:]} do not fit this index "
                             f"({self.index.d if self.index is not None else '?'})")
        taken = sorted(set(ids) & set(self._documents)) + sorted(i for i, n in Counter(ids).items() if n > 1)
        if taken:
            raise ValueError(f"ids already in the store or repeated: {taken[:5]}")
        # checked: only now the caches are computed, stored and owned by these ids
        keys = self.kv_engine.ingest(texts, progress=len(texts) > 8, owners=ids)
        if self.index is None:
            self.index = faiss.IndexIDMap2(faiss.IndexFlatL2(vectors.shape[1]))
        first = max(self._rows, default=-1) + 1
        rows = np.arange(first, first + len(pairs), dtype=np.int64)
        self.index.add_with_ids(vectors, rows)
        for row, doc_id, text, meta, key in zip(rows.tolist(), ids, texts, metas, keys):
            self._documents[doc_id] = Document(id=doc_id, page_content=text, metadata={**meta, KV_KEY: key.hex()})
            self._rows[row], self._row_of[doc_id] = doc_id, row
        return ids

    @classmethod
    def from_texts(cls, texts: list[str], embedding: Embeddings, metadatas: list[dict] | None = None,
                   ids: list[str] | None = None, *, kv_engine: Engine, **kwargs: Any) -> CacheClipFAISS:
        store = cls(embedding, kv_engine=kv_engine)
        store.add_texts(texts, metadatas, ids)
        return store

    @classmethod
    def from_embeddings(cls, text_embeddings: Iterable[tuple[str, list[float]]], embedding: Embeddings,
                        metadatas: Iterable[dict] | None = None, ids: list[str] | None = None, *,
                        kv_engine: Engine, **kwargs: Any) -> CacheClipFAISS:
        store = cls(embedding, kv_engine=kv_engine)
        store.add_embeddings(text_embeddings, metadatas, ids)
        return store

    # ---- reading --------------------------------------------------------------------------------------

    def get_by_ids(self, ids: Sequence[str], /) -> list[Document]:
        return [self._documents[i] for i in ids if i in self._documents]

    def _search(self, vector: list[float], k: int, filter: Filter, fetch_k: int) -> list[tuple[Document, float, int]]:
        if self.index is None or self.index.ntotal == 0:
            return []
        count = min(self.index.ntotal, k if filter is None else max(k, fetch_k))
        distances, rows = self.index.search(np.asarray([vector], dtype=np.float32), count)
        keep = filter if callable(filter) or filter is None else (
            lambda meta: all(meta.get(name) == value for name, value in filter.items()))
        hits = [(self._documents[self._rows[int(row)]], float(d), int(row)) for d, row in zip(distances[0], rows[0]) if row >= 0]
        return [hit for hit in hits if keep is None or keep(hit[0].metadata)][:k]

    def similarity_search_with_score_by_vector(self, embedding: list[float], k: int = 4, filter: Filter = None,
                                               fetch_k: int = 20, **kwargs: Any) -> list[tuple[Document, float]]:
        """The k nearest documents with their L2 distances (smaller is nearer)."""
        return [(doc, distance) for doc, distance, _ in self._search(embedding, k, filter, fetch_k)]

    def similarity_search_with_score(self, query: str, k: int = 4, filter: Filter = None, fetch_k: int = 20,
                                     **kwargs: Any) -> list[tuple[Document, float]]:
        return self.similarity_search_with_score_by_vector(self.embedding.embed_query(query), k, filter, fetch_k)

    def similarity_search_by_vector(self, embedding: list[float], k: int = 4, filter: Filter = None,
                                    fetch_k: int = 20, **kwargs: Any) -> list[Document]:
        return [doc for doc, _ in self.similarity_search_with_score_by_vector(embedding, k, filter, fetch_k)]

    def similarity_search(self, query: str, k: int = 4, filter: Filter = None, fetch_k: int = 20,
                          **kwargs: Any) -> list[Document]:
        return self.similarity_search_by_vector(self.embedding.embed_query(query), k, filter, fetch_k)

    def _select_relevance_score_fn(self) -> Callable[[float], float]:
        return self._euclidean_relevance_score_fn

    def max_marginal_relevance_search_by_vector(self, embedding: list[float], k: int = 4, fetch_k: int = 20,
                                                lambda_mult: float = 0.5, filter: Filter = None,
                                                **kwargs: Any) -> list[Document]:
        hits = self._search(embedding, fetch_k, filter, fetch_k)
        if not hits:
            return []
        candidates = np.stack([self.index.reconstruct(row) for _, _, row in hits])  # [fetch_k, E]
        chosen = maximal_marginal_relevance(np.asarray(embedding, dtype=np.float32), candidates, lambda_mult, k)
        return [hits[i][0] for i in chosen]

    def max_marginal_relevance_search(self, query: str, k: int = 4, fetch_k: int = 20, lambda_mult: float = 0.5,
                                      filter: Filter = None, **kwargs: Any) -> list[Document]:
        return self.max_marginal_relevance_search_by_vector(self.embedding.embed_query(query), k, fetch_k,
                                                            lambda_mult, filter)

    # ---- deletion and persistence -----------------------------------------------------------------------

    def delete(self, ids: list[str] | None = None, **kwargs: Any) -> bool | None:
        """Remove these documents and release their caches. Ids not here (never added, or deleted
        already) are skipped: deleting twice is not an error."""
        if ids is None:
            raise ValueError("delete needs the ids of the documents to remove")
        present = [i for i in dict.fromkeys(ids) if i in self._documents]
        if present:
            self.index.remove_ids(np.asarray([self._row_of[i] for i in present], dtype=np.int64))
            for doc_id in present:
                del self._documents[doc_id]
                del self._rows[self._row_of.pop(doc_id)]
        self.kv_engine.release(list(ids))
        return True

    def save_local(self, folder_path: str, index_name: str = "index") -> None:
        """`index_name.faiss` (the FAISS index) and `index_name.json` (the documents and their rows),
        each written whole (a temporary file renamed into place)."""
        folder = Path(folder_path)
        folder.mkdir(parents=True, exist_ok=True)
        state = {"rows": {str(row): doc_id for row, doc_id in self._rows.items()},
                 "documents": {doc_id: {"page_content": d.page_content, "metadata": d.metadata}
                               for doc_id, d in self._documents.items()}}
        index = self.index if self.index is not None else faiss.IndexIDMap2(faiss.IndexFlatL2(1))
        faiss.write_index(index, str(folder / f"{index_name}.faiss.tmp"))
        (folder / f"{index_name}.json.tmp").write_text(json.dumps(state), encoding="utf-8")
        os.replace(folder / f"{index_name}.faiss.tmp", folder / f"{index_name}.faiss")
        os.replace(folder / f"{index_name}.json.tmp", folder / f"{index_name}.json")

    @classmethod
    def load_local(cls, folder_path: str, embeddings: Embeddings, index_name: str = "index", *, kv_engine: Engine,
                   allow_dangerous_deserialization: bool = False, **kwargs: Any) -> CacheClipFAISS:
        """What `save_local` wrote. JSON, not pickle: `allow_dangerous_deserialization` (the name
        `langchain_community`'s FAISS takes) is accepted and not needed."""
        folder = Path(folder_path)
        state = json.loads((folder / f"{index_name}.json").read_text(encoding="utf-8"))
        documents = {doc_id: Document(id=doc_id, **fields) for doc_id, fields in state["documents"].items()}
        rows = {int(row): doc_id for row, doc_id in state["rows"].items()}
        index = faiss.read_index(str(folder / f"{index_name}.faiss")) if rows else None
        return cls(embeddings, kv_engine=kv_engine, index=index, documents=documents, rows=rows)
