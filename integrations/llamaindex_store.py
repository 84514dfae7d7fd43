"""LlamaIndex: the vector-store hook that stores each node's chunk KV as it enters the index."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

try:
    from llama_index.core.bridge.pydantic import PrivateAttr
    from llama_index.core.schema import BaseNode, MetadataMode
    from llama_index.core.vector_stores.types import BasePydanticVectorStore, VectorStoreQuery, VectorStoreQueryResult
except ImportError as err:  # pragma: no cover
    raise ImportError("the LlamaIndex integration needs: pip install 'cacheclip-rag[llamaindex]'") from err

from cacheclip_rag.engine.core import Engine
from cacheclip_rag.models.openmp_pools import to_thread_releasing

from .common import KV_KEY


def node_text(node: BaseNode) -> str:
    """The text a node contributes to the prompt, and the text its KV is stored under."""
    text = node.get_content(metadata_mode=MetadataMode.LLM)
    if not text or not text.strip():
        raise ValueError(f"node {node.node_id} has no text to answer from")
    return text


def kv_texts(nodes: Sequence[BaseNode]) -> list[str]:
    """The texts the nodes' KV is stored under (their LLM text, metadata included; the KV key itself is
    excluded first, so it never enters the text): what to precompute elsewhere, e.g. on Ray workers."""
    for node in nodes:
        for excluded in (node.excluded_llm_metadata_keys, node.excluded_embed_metadata_keys):
            if KV_KEY not in excluded:
                excluded.append(KV_KEY)
    return [node_text(n) for n in nodes]


def attach_kv(engine: Engine, nodes: Sequence[BaseNode]) -> list[str]:
    """Precompute and store the KV of each node (a no-op for what is stored), record its key, and
    register the node as a user of its caches (its document as the group), so deleting the document
    frees what no other node uses."""
    texts = kv_texts(nodes)
    if not nodes:
        return []
    keys = [k.hex() for k in engine.ingest(texts, progress=len(nodes) > 8, owners=[n.node_id for n in nodes],
                                           groups=[n.ref_doc_id for n in nodes])]
    for node, key in zip(nodes, keys):
        node.metadata[KV_KEY] = key
    return keys


class CacheClipVectorStore(BasePydanticVectorStore):
    """A vector store that stores each added node's chunk KV first, then delegates to `inner`.

    Deletes reach the KV store: `index.delete_ref_doc(doc_id)` and `delete_nodes(ids)` remove the
    nodes from `inner` and release their chunk caches (a cache shared with another node stays). The
    inner store must support deletion: `FaissMapVectorStore` (over `faiss.IndexIDMap2`) does, by node
    id; LlamaIndex's `FaissVectorStore` cannot delete at all (upstream `NotImplementedError`)."""

    @classmethod
    def class_name(cls) -> str:
        return "CacheClipVectorStore"

    stores_text: bool = False
    is_embedding_query: bool = True
    _inner: BasePydanticVectorStore = PrivateAttr()
    _engine: Any = PrivateAttr()  # an Engine, or a RemoteEngine (a running `cacheclip serve`)

    def __init__(self, inner: BasePydanticVectorStore, engine: Engine, **kwargs: Any):
        super().__init__(stores_text=inner.stores_text, is_embedding_query=inner.is_embedding_query, **kwargs)
        self._inner = inner
        self._engine = engine

    @property
    def inner(self) -> BasePydanticVectorStore:
        return self._inner

    @property
    def client(self) -> Any:
        return self._inner.client

    def add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        attach_kv(self._engine, nodes)
        return self._inner.add(nodes, **kwargs)

    async def async_add(self, nodes: Sequence[BaseNode], **kwargs: Any) -> list[str]:
        await to_thread_releasing(attach_kv, self._engine, nodes)
        return await self._inner.async_add(nodes, **kwargs)

    def delete(self, ref_doc_id: str, **kwargs: Any) -> None:
        """The document's nodes out of `inner` (by node id where the hook recorded them: stores such as
        FaissMapVectorStore delete only by node id), then its caches released."""
        owners = self._engine.owners_of(ref_doc_id)
        if owners:
            try:
                self._inner.delete_nodes(owners)
            except NotImplementedError as err:
                raise NotImplementedError(f"{type(self._inner).__name__} cannot delete nodes: use a vector store "
                                          "that can (e.g. FaissMapVectorStore over faiss.IndexIDMap2)") from err
        try:
            self._inner.delete(ref_doc_id, **kwargs)
        except NotImplementedError as err:
            if not owners:
                raise NotImplementedError(f"{type(self._inner).__name__} cannot delete documents: use a vector "
                                          "store that can (e.g. FaissMapVectorStore over faiss.IndexIDMap2)") from err
        self._engine.release(group=ref_doc_id)

    def delete_nodes(self, node_ids: list[str] | None = None, filters: Any = None, **kwargs: Any) -> None:
        self._inner.delete_nodes(node_ids, filters, **kwargs)
        if node_ids:
            self._engine.release(node_ids)

    def clear(self) -> None:
        self._inner.clear()

    def get_nodes(self, node_ids: list[str] | None = None, filters: Any = None) -> list[BaseNode]:
        return self._inner.get_nodes(node_ids, filters)

    def query(self, query: VectorStoreQuery, **kwargs: Any) -> VectorStoreQueryResult:
        return self._inner.query(query, **kwargs)

    def persist(self, persist_path: str, fs: Any = None) -> None:
        self._inner.persist(persist_path, fs=fs)


def faiss_similarity_store(dimension: int = 384) -> Any:
    """A FAISS vector store whose scores are cosine similarities (inner product over the normalised
    embeddings LlamaIndex's HuggingFace embeddings give), so postprocessors such as
    `SimilarityPostprocessor(similarity_cutoff=...)` keep the nearest nodes, and which can delete
    (`FaissMapVectorStore` over `IndexIDMap2`): wrap it in `CacheClipVectorStore`."""
    import faiss
    from llama_index.vector_stores.faiss import FaissMapVectorStore

    return FaissMapVectorStore(faiss_index=faiss.IndexIDMap2(faiss.IndexFlatIP(dimension)))


def load_faiss_store(persist_dir: str) -> Any:
    """The FAISS store persisted in `persist_dir`: a `faiss_similarity_store`, or (an index built by an
    older release) a plain `FaissVectorStore` of L2 distances, which cannot delete."""
    import os

    from llama_index.vector_stores.faiss import FaissMapVectorStore, FaissVectorStore

    if any(name.endswith("id_map.json") for name in os.listdir(persist_dir)):
        return FaissMapVectorStore.from_persist_dir(persist_dir)
    return FaissVectorStore.from_persist_dir(persist_dir)
