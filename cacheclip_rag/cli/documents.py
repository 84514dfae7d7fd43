"""`cacheclip ingest` and `cacheclip query`: files through LlamaIndex's reader and splitters into a FAISS
index (MiniLM embeddings) plus each chunk's KV in the store, and answers over what the index retrieves."""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import EngineConfig, RequestOptions
from .args import engine_config, index_dir
from .files import TEXT_SUFFIXES, read_text, text_files

if TYPE_CHECKING:
    from llama_index.core.schema import Document, TextNode


def _load_documents(paths: list[str], suffixes: tuple[str, ...] | None = TEXT_SUFFIXES,
                    texts: dict[Path, str] | None = None) -> list[Document]:
    """One LlamaIndex Document per file under `paths` (a folder recursively, hidden files skipped, only
    `suffixes`), its id and `file` metadata the resolved path. The files were checked (strict UTF-8, not
    binary, not empty) before anything heavy loaded (`args`); they are read as plain text, which is all
    .md and .txt need (so LlamaIndex's readers for other formats are not consulted). `texts`: the files as
    the checks read them (file -> text), so no file is read twice."""
    from llama_index.core.schema import Document

    texts = texts if texts is not None else {file: read_text(file) for file in text_files(paths, suffixes)}
    return [Document(id_=str(file), text=text, metadata={"file": str(file)}) for file, text in texts.items()]


def _read_nodes(paths: list[str], chunk_size: int | None = None, texts: dict[Path, str] | None = None) -> list[TextNode]:
    """The files under `paths` as LlamaIndex nodes: markdown files split at their headings by
    MarkdownNodeParser (text before the first heading is a node of its own: nothing is dropped), then
    every node longer than `chunk_size` tokens of the MiniLM embedder split by SentenceSplitter (so no
    chunk is cut short by the embedder's 256-token window). Every node's document (`ref_doc_id`) is its
    file, so `delete_ref_doc(file)` removes all of it; node ids hash the file and the text, so ingesting
    a document again adds nothing."""
    from llama_index.core.node_parser import MarkdownNodeParser, SentenceSplitter
    from llama_index.core.schema import NodeRelationship, RelatedNodeInfo, TextNode

    headings, nodes = MarkdownNodeParser(include_prev_next_rel=False), []
    for doc in _load_documents(paths, texts=texts):
        if doc.metadata["file"].endswith(".md"):
            nodes += headings([doc])
        else:
            nodes.append(TextNode(text=doc.text, metadata=dict(doc.metadata)))
    if chunk_size is not None:
        from ..integrations.embeddings import minilm_tokenizer

        splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=min(20, chunk_size // 8),
                                    tokenizer=minilm_tokenizer().tokenize, include_prev_next_rel=False)
        nodes = splitter(nodes)
    out = [n for n in nodes if n.get_content().strip()]
    for node in out:
        node.id_ = _node_id(node.metadata["file"], node.get_content())
        node.relationships = {NodeRelationship.SOURCE: RelatedNodeInfo(node_id=node.metadata["file"])}
    return out


@contextmanager
def _index_lock(directory: Path) -> Iterator[None]:
    """Serialise ingest runs into one index: the second waits, then adds to what the first wrote."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".ingest.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def ingest(args: argparse.Namespace) -> int:
    """Files -> chunks -> FAISS index (MiniLM embeddings, LlamaIndex) + each chunk's KV in the store."""
    from llama_index.core import StorageContext, VectorStoreIndex, load_index_from_storage

    from ..integrations.llamaindex import (CacheClipVectorStore, MiniLMEmbedding, faiss_similarity_store, kv_texts,
                                           load_faiss_store)

    from ..engine.core import Engine

    read = _read_nodes(args.paths, args.chunk_size, getattr(args, "texts", None))
    if not read:
        raise SystemExit("no .md or .txt text found")
    if args.server is not None:
        return _ingest_on_server(args, read)
    config = engine_config(args)
    nodes = {node.node_id: node for node in read}  # ids hash file and text: a repeated chunk is one node
    if args.ray is not None:  # the nodes' KV on Ray workers first (the very texts the index hook stores)
        _ingest_on_ray(args, config, kv_texts(list(nodes.values())))
    engine = Engine.from_config(config)
    directory = index_dir(args)
    replaced = 0
    with _index_lock(directory):
        if (directory / "docstore.json").exists():
            faiss_store = load_faiss_store(str(directory))
            context = StorageContext.from_defaults(vector_store=CacheClipVectorStore(faiss_store, engine),
                                                   persist_dir=str(directory))
            index = load_index_from_storage(context, embed_model=MiniLMEmbedding())
            new = []
            for file, file_nodes in _by_file(nodes.values()).items():
                info = index.docstore.get_ref_doc_info(file)
                known = set(info.node_ids) if info is not None else set()
                if known - {n.node_id for n in file_nodes}:  # the file changed: its old chunks go
                    index.delete_ref_doc(file, delete_from_docstore=True)
                    replaced, known = replaced + 1, set()
                new += [n for n in file_nodes if n.node_id not in known]
            index.insert_nodes(new, show_progress=True)
        else:
            new = list(nodes.values())
            vector_store = CacheClipVectorStore(faiss_similarity_store(), engine)
            index = VectorStoreIndex(new, storage_context=StorageContext.from_defaults(vector_store=vector_store),
                                     embed_model=MiniLMEmbedding(), show_progress=True)
        index.storage_context.persist(persist_dir=str(directory))
    print(f"ingested {len(new)} new chunks ({len(nodes) - len(new)} already present"
          f"{f'; {replaced} changed files replaced' if replaced else ''}): index {directory}, KV store {engine.store.path}")
    return 0


def _ingest_on_server(args: argparse.Namespace, nodes: list[TextNode]) -> int:
    """The chunks to a running server's /v1/ingest (it computes and stores their caches and recognises
    them in prompts from then on), each under its node id in its file's group (`cacheclip delete --file`)."""
    body = {"documents": [n.get_content() for n in nodes], "ids": [n.node_id for n in nodes],
            "groups": [n.metadata["file"] for n in nodes], **({"system": args.system} if args.system else {})}
    body = _post(args, "/v1/ingest", body, "the chunks")
    print(f"ingested {body['documents']} chunks on {args.server} ({body['indexed']} new to its index)")
    return 0


def delete(args: argparse.Namespace) -> int:
    """Documents off a running server, by id or by file (the group `ingest --server` put its chunks in):
    their caches, texts and recognition go there at once."""
    total = 0
    for ids, group in [(args.ids, None)] * bool(args.ids) + [([], str(Path(f).resolve())) for f in args.file]:
        total += _post(args, "/v1/documents/delete", {"ids": ids, **({"group": group} if group else {})},
                       "the delete")["deleted_entries"]
    print(f"deleted on {args.server}: {total} cache entries (an id this key never ingested deletes nothing)")
    return 0


def _post(args: argparse.Namespace, route: str, body: dict, what: str) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    url = args.server.rstrip("/") + route
    try:
        reply = httpx.post(url, json=body, headers=headers, timeout=3600)
    except httpx.HTTPError as err:
        raise SystemExit(f"cannot reach {url}: {err}") from None
    if reply.status_code != 200:
        raise SystemExit(f"{url} refused {what} ({reply.status_code}): {reply.text[:300]}")
    return reply.json()


def _ingest_on_ray(args: argparse.Namespace, config: EngineConfig, texts: list[str]) -> None:
    from functools import partial

    from ..distributed import ingest_on_ray
    from ..store.factory import open_store
    from ..models.loading import load_model

    store = partial(open_store, config.store_path, config.shared_store)
    for name, device in ((config.primary, config.device), (config.aux, config.aux_device)):
        if name is None:
            continue
        _, computed = ingest_on_ray(partial(load_model, name, device=device, dtype=config.dtype), store, texts,
                                    config.system_prompt, workers=args.ray_workers, address=args.ray or None,
                                    num_gpus=1 if device.startswith("cuda") else 0, store_dtype=config.store_dtype)
        print(f"{name}: {computed} chunks computed on Ray", file=sys.stderr)


def _by_file(nodes: Iterable[TextNode]) -> dict[str, list[TextNode]]:
    grouped: dict[str, list[TextNode]] = {}
    for node in nodes:
        grouped.setdefault(node.metadata["file"], []).append(node)
    return grouped


def _node_id(file: str, chunk: str) -> str:
    return hashlib.sha256(f"{file}\0{chunk}".encode("utf-8", "surrogatepass")).hexdigest()


def query(args: argparse.Namespace) -> int:
    from ..engine.core import Engine

    sources: list[tuple[str, float | None]] = []
    if args.chunk_files is not None:
        documents = _load_documents(args.chunk_files, suffixes=None, texts=getattr(args, "texts", None))
        chunks = [doc.text for doc in documents]
        sources = [(doc.metadata["file"], None) for doc in documents]
    engine = Engine.from_config(engine_config(args))
    options = RequestOptions(method=args.method, ratio=args.ratio, max_new_tokens=args.max_new_tokens,
                             selection=args.selection)
    if args.chunk_files is None:
        from llama_index.core import StorageContext, load_index_from_storage

        from ..integrations.llamaindex import MiniLMEmbedding, load_faiss_store, node_text

        directory = str(index_dir(args))
        context = StorageContext.from_defaults(vector_store=load_faiss_store(directory),
                                               persist_dir=directory)
        index = load_index_from_storage(context, embed_model=MiniLMEmbedding())
        nodes = index.as_retriever(similarity_top_k=args.top_k).retrieve(args.question)
        chunks = [node_text(n.node) for n in nodes]
        sources = [(n.node.metadata.get("file", "?"), n.score) for n in nodes]
        print(f"retrieved {len(chunks)} chunks from {directory}", file=sys.stderr)
    stream = engine.stream(args.question, chunks, options)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    assert stream.answer is not None
    print("sources:")
    for name, score in sources:
        print(f"  {name}" + ("" if score is None else f"  (similarity {score:.3f})"))
    timings = stream.answer.timings.as_dict()
    store = {k: round(v, 4) for k, v in timings.pop("store").items()}
    print({**{k: round(v, 4) for k, v in timings.items()}, "store": store}, file=sys.stderr)
    return 0


