"""Command line: `cacheclip demo | ingest | query | inspect | verify | evict | compact | eval | bench`.

Environment variables are read here only (CACHECLIP_CACHE moves the model cache and default store).
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .chunking import split_sections
from .config import METHODS, EngineConfig, RequestOptions, is_redis_url
from .engine import Engine
from .models import DTYPES
from .store import STORE_DTYPES, LMDBStore, StoreError

if TYPE_CHECKING:
    from llama_index.core.schema import Document, TextNode

DEMO_QUESTIONS = (
    ("How many pistons support the Halvorsen mirror?", "96"),
    ("What is the name of the archive server that releases the data?", "Gull"),
    ("In which year did the Lantern programme announce its first confirmed planet?", "2016"),
    ("Who is the present director of the observatory?", "Amara Lindqvist-Oduya"),
)


def demo_chunks() -> list[str]:
    text = files("cacheclip_rag").joinpath("data/observatory_handbook.md").read_text(encoding="utf-8")
    return [c for c in split_sections(text) if c.startswith("## ")]  # the handbook's preamble is its title alone


def _config(args: argparse.Namespace) -> EngineConfig:
    overrides = {"primary": args.primary, "aux": None if str(args.aux).lower() == "none" else args.aux,
                 "device": args.device, "aux_device": args.aux_device, "dtype": args.dtype,
                 "store_dtype": args.store_dtype}
    if args.store:
        overrides["store_path"] = args.store if is_redis_url(args.store) else Path(args.store)
    if getattr(args, "shared_store", None):
        overrides["shared_store"] = args.shared_store
    return EngineConfig(**overrides)


def cmd_demo(args: argparse.Namespace) -> int:
    engine = Engine.from_config(_config(args))
    chunks = demo_chunks()
    print(f"primary={engine.primary.name} aux={engine.aux.name if engine.aux else None} "
          f"chunks={len(chunks)} store={engine.store.path}")
    engine.ingest(chunks)
    methods = args.methods.split(",")
    engine.generate(DEMO_QUESTIONS[0][0], chunks, RequestOptions(method="full", max_new_tokens=1))  # warm-up
    header = f"{'method':<14} {'ratio':>5} {'recomp%':>7} {'TTFT s':>7} {'speedup':>7}  answer"
    for question, expected in DEMO_QUESTIONS[: args.questions]:
        print(f"\nQ: {question}   (expected: {expected})\n{header}")
        full_ttft = None
        for method in methods:
            options = RequestOptions(method=method, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
            answer = engine.generate(question, chunks, options)
            ttft = answer.timings.ttft_s
            full_ttft = ttft if method == "full" else full_ttft
            speedup = f"{full_ttft / ttft:6.2f}x" if full_ttft else "    n/a"
            mark = "+" if expected.lower() in answer.text.lower() else "-"
            print(f"{method:<14} {args.ratio:>5.2f} {100 * answer.recompute_fraction:>6.1f}% {ttft:>7.3f} {speedup:>7}  "
                  f"{mark} {answer.text.strip()[:70]!r}")
    return 0


TEXT_SUFFIXES = (".md", ".txt")


def _load_documents(paths: list[str], suffixes: tuple[str, ...] | None = TEXT_SUFFIXES) -> list[Document]:
    """LlamaIndex's SimpleDirectoryReader over each path (a folder recursively, hidden files skipped), one
    Document per file with its name as `file` metadata. Decoding is strict: a file that is not UTF-8,
    is binary or is empty stops here, named, before any model loads; no file is skipped in silence."""
    from llama_index.core import SimpleDirectoryReader

    settings = {"file_metadata": lambda name: {"file": name}, "filename_as_id": True, "encoding": "utf-8",
                "errors": "strict", "raise_on_error": True}
    documents: list[Document] = []
    for path in map(Path, paths):
        if not path.exists():
            raise SystemExit(f"no such file or folder: {path}")
        if path.is_dir():
            try:
                reader = SimpleDirectoryReader(input_dir=str(path), recursive=True, required_exts=list(suffixes or ()),
                                               **settings)
            except ValueError:  # the reader's "No files found": nothing of ours in this folder
                continue
        else:
            reader = SimpleDirectoryReader(input_files=[str(path)], **settings)
        for file in sorted(reader.input_files):
            documents.extend(_checked(file, reader))
    return documents


def _checked(file: Path, reader: Any) -> list[Document]:
    """One file through the reader's own settings, its failure named."""
    try:
        loaded = reader.load_file(file, reader.file_metadata, reader.file_extractor, reader.filename_as_id,
                                  reader.encoding, reader.errors, reader.raise_on_error)
    except Exception as err:  # the reader wraps what it meets; the cause names the problem
        cause = err if isinstance(err, UnicodeDecodeError) else err.__cause__ or err
        if isinstance(cause, UnicodeDecodeError):
            raise SystemExit(f"{file}: not UTF-8 text (byte {cause.start}); convert it or leave it out") from None
        raise SystemExit(f"{file}: cannot be read ({cause})") from None
    text = "".join(doc.text for doc in loaded)
    if "\x00" in text:
        raise SystemExit(f"{file}: binary data (NUL bytes), not text")
    if not text.strip():
        raise SystemExit(f"{file}: empty")
    return loaded


def _read_nodes(paths: list[str], chunk_size: int | None = None) -> list[TextNode]:
    """The files under `paths` as LlamaIndex nodes: markdown files split at their headings by
    MarkdownNodeParser (text before the first heading is a node of its own: nothing is dropped), then
    every node longer than `chunk_size` tokens of the MiniLM embedder split by SentenceSplitter (so no
    chunk is cut short by the embedder's 256-token window). Node ids hash the file and the text, so
    ingesting a document again adds nothing."""
    from llama_index.core.node_parser import MarkdownNodeParser, SentenceSplitter
    from llama_index.core.schema import TextNode

    headings, nodes = MarkdownNodeParser(include_prev_next_rel=False), []
    for doc in _load_documents(paths):
        if doc.metadata["file"].endswith(".md"):
            nodes += headings([doc])
        else:
            nodes.append(TextNode(text=doc.text, metadata=dict(doc.metadata)))
    if chunk_size is not None:
        from .integrations.embeddings import minilm_tokenizer

        splitter = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=min(20, chunk_size // 8),
                                    tokenizer=minilm_tokenizer().tokenize, include_prev_next_rel=False)
        nodes = splitter(nodes)
    out = [n for n in nodes if n.get_content().strip()]
    for node in out:
        node.id_ = _node_id(node.metadata["file"], node.get_content())
    return out


@contextmanager
def _index_lock(directory: Path) -> Iterator[None]:
    """Serialise ingest runs into one index: the second waits, then adds to what the first wrote."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".ingest.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def _index_dir(args: argparse.Namespace) -> Path:
    from .models import cache_dir

    return Path(args.index) if args.index else cache_dir() / "index"


def cmd_ingest(args: argparse.Namespace) -> int:
    """Files -> chunks -> FAISS index (MiniLM embeddings, LlamaIndex) + each chunk's KV in the store."""
    import faiss
    from llama_index.core import StorageContext, VectorStoreIndex, load_index_from_storage
    from llama_index.vector_stores.faiss import FaissVectorStore

    from .integrations.llamaindex import CacheClipVectorStore, MiniLMEmbedding, kv_texts

    if args.chunk_size < 16:
        raise SystemExit(f"--chunk-size must be >= 16 tokens, got {args.chunk_size}")
    read = _read_nodes(args.paths, args.chunk_size)
    if not read:
        raise SystemExit("no .md or .txt text found")
    config = _config(args)
    nodes = {node.node_id: node for node in read}  # ids hash file and text: a repeated chunk is one node
    if args.ray is not None:  # the nodes' KV on Ray workers first (the very texts the index hook stores)
        _ingest_on_ray(args, config, kv_texts(list(nodes.values())))
    engine = Engine.from_config(config)
    directory = _index_dir(args)
    with _index_lock(directory):
        if (directory / "docstore.json").exists():
            faiss_store = FaissVectorStore.from_persist_dir(str(directory))
            context = StorageContext.from_defaults(vector_store=CacheClipVectorStore(faiss_store, engine),
                                                   persist_dir=str(directory))
            index = load_index_from_storage(context, embed_model=MiniLMEmbedding())
            new = [n for node_id, n in nodes.items() if not index.docstore.document_exists(node_id)]
            index.insert_nodes(new, show_progress=True)
        else:
            new = list(nodes.values())
            vector_store = CacheClipVectorStore(FaissVectorStore(faiss_index=faiss.IndexFlatL2(384)), engine)
            index = VectorStoreIndex(new, storage_context=StorageContext.from_defaults(vector_store=vector_store),
                                     embed_model=MiniLMEmbedding(), show_progress=True)
        index.storage_context.persist(persist_dir=str(directory))
    print(f"ingested {len(new)} new chunks ({len(nodes) - len(new)} already present): index {directory}, "
          f"KV store {engine.store.path}")
    return 0


def _ingest_on_ray(args: argparse.Namespace, config: EngineConfig, texts: list[str]) -> None:
    from functools import partial

    from .distributed import ingest_on_ray
    from .engine import open_store
    from .models import load_model

    store = partial(open_store, config.store_path, config.shared_store)
    for name, device in ((config.primary, config.device), (config.aux, config.aux_device)):
        if name is None:
            continue
        _, computed = ingest_on_ray(partial(load_model, name, device=device, dtype=config.dtype), store, texts,
                                    config.system_prompt, workers=args.ray_workers, address=args.ray or None,
                                    num_gpus=1 if device.startswith("cuda") else 0, store_dtype=config.store_dtype)
        print(f"{name}: {computed} chunks computed on Ray", file=sys.stderr)


def _node_id(file: str, chunk: str) -> str:
    return hashlib.sha256(f"{file}\0{chunk}".encode("utf-8", "surrogatepass")).hexdigest()


def _check_query_args(args: argparse.Namespace) -> None:
    """Everything a query can get wrong, before ~30 s of model loading."""
    if not args.question.strip():
        raise SystemExit("the question is empty")
    if not 0.0 <= args.ratio <= 1.0:
        raise SystemExit(f"--ratio must be in [0, 1], got {args.ratio}")
    if args.top_k < 1:
        raise SystemExit(f"--top-k must be >= 1, got {args.top_k}")
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for device in (args.device, args.aux_device):
        if device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise SystemExit(f"--device {device}: no CUDA device is available here")
    if args.chunk_files is not None:
        if not args.chunk_files:
            raise SystemExit("--chunk-files needs at least one file")
        for name in args.chunk_files:
            if not Path(name).is_file():
                raise SystemExit(f"no such file: {name}")
    elif not (_index_dir(args) / "docstore.json").exists():
        raise SystemExit(f"no index at {_index_dir(args)}: build one with `cacheclip ingest DOCS"
                         f"{' --index ' + args.index if args.index else ''}`, or pass --chunk-files")


def cmd_query(args: argparse.Namespace) -> int:
    _check_query_args(args)
    sources: list[tuple[str, float | None]] = []
    if args.chunk_files is not None:
        documents = _load_documents(args.chunk_files, suffixes=None)
        chunks = [doc.text for doc in documents]
        sources = [(doc.metadata["file"], None) for doc in documents]
    engine = Engine.from_config(_config(args))
    options = RequestOptions(method=args.method, ratio=args.ratio, max_new_tokens=args.max_new_tokens)
    if args.chunk_files is None:
        from llama_index.core import StorageContext, load_index_from_storage
        from llama_index.vector_stores.faiss import FaissVectorStore

        from .integrations.llamaindex import MiniLMEmbedding, node_text

        directory = str(_index_dir(args))
        context = StorageContext.from_defaults(vector_store=FaissVectorStore.from_persist_dir(directory),
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
        print(f"  {name}" + ("" if score is None else f"  (score {score:.3f})"))
    timings = stream.answer.timings.as_dict()
    store = {k: round(v, 4) for k, v in timings.pop("store").items()}
    print({**{k: round(v, 4) for k, v in timings.items()}, "store": store}, file=sys.stderr)
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    path = Path(args.store) if args.store else EngineConfig().store_path
    with LMDBStore(path, readonly=True) as store:
        stats = store.stats()
    print(f"store   {stats['path']}\nentries {stats['entries']}\nbytes   {stats['bytes']:,} "
          f"(file {stats['file_bytes']:,})\nquarantined {stats['quarantined']}")
    for fingerprint, row in stats["models"].items():
        names = ", ".join(row["names"]) or "unnamed"
        per_token = f"{row['bytes_per_token'] / 1024:.1f} KB/token" if row["bytes_per_token"] else "–"
        print(f"model   {names} [{fingerprint[:12]}]: {row['entries']} entries, {row['tokens']:,} tokens, "
              f"{row['bytes']:,} bytes, {per_token}, stored as {'/'.join(row['dtypes'])}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    import datetime
    import os
    import platform
    from dataclasses import replace

    import torch

    from .evaluation import report, runner
    from .models import cache_dir

    profile = runner.PROFILES[args.profile]
    if args.tasks:
        profile = replace(profile, tasks=tuple(args.tasks.split(",")))
    if args.lengths:
        profile = replace(profile, lengths=tuple(int(x) for x in args.lengths.split(",")))
    if args.ratios:
        profile = replace(profile, ratios=tuple(float(x) for x in args.ratios.split(",")))
    if args.variants:
        profile = replace(profile, variants=tuple(args.variants.split(",")))
    if args.samples:
        samples = tuple(int(x) for x in args.samples.split(","))
        profile = replace(profile, samples=samples[0] if len(samples) == 1 else samples)
    if args.alignment_samples is not None:
        profile = replace(profile, alignment_samples=args.alignment_samples)
    if args.alignment_lengths:
        profile = replace(profile, alignment_lengths=tuple(int(x) for x in args.alignment_lengths.split(",")))
    config = _config(args)
    if not args.store:
        config = replace(config, store_path=cache_dir() / "eval-store")
    for length in profile.lengths:
        profile.samples_at(length)  # one count per length, checked before the models load
    unknown = [v for v in profile.variants if v not in runner.VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(runner.VARIANTS)}")
    if args.limit_minutes is not None and not args.limit_minutes >= 0:
        raise SystemExit(f"--limit-minutes must be >= 0 (0 runs one sample), got {args.limit_minutes}")
    out = Path(args.out)
    merged = []  # other run folders' samples, read (and checked) before any model loads
    for folder in args.merge or ():
        done = runner.load_records(Path(folder))
        if not done:
            raise SystemExit(f"--merge {folder}: no finished samples there")
        merged.append((folder, [r for rows in done.values() for r in rows]))
    if args.report_only:  # the report of what the run folder holds, no model loaded
        done = runner.load_records(out)
        records = [r for job in runner.jobs_of(profile, args.seed) if job in done for r in done[job]]
        if not records:
            raise SystemExit(f"{out} holds no finished samples of this profile")
        engine = None
    else:
        engine = Engine.from_config(config)
        limit = None if args.limit_minutes is None else args.limit_minutes * 60  # 0: one sample, not no limit
        records = runner.run(engine, profile, seed=args.seed, out_dir=out, limit_s=limit)
    if not records:
        print(f"no sample finished within the time limit; rerun the same command to resume {out}")
        return 0
    alignment, maps = [], {}
    if engine is not None and engine.aux and profile.alignment_lengths and profile.alignment_samples:
        alignment, maps = runner.alignment_study(engine, profile.alignment_lengths, seed=args.seed,
                                                 samples=profile.alignment_samples, progress=True)
    meta = {
        "date": datetime.date.today().isoformat(), "command": "cacheclip " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} {os.cpu_count()} CPUs, torch {torch.__version__}, device {config.device}",
        "models": f"primary {config.primary}, aux {config.aux}",
        "profile": f"{profile.name}: lengths {profile.lengths}, {len(profile.tasks)} tasks x {profile.samples} samples "
                   f"per length, ratios {profile.ratios}, greedy, RULER wording; decode budget per sample fits its "
                   f"references (+8 tokens), ending once every reference is out",
        "samples done": f"{len({(r.task, r.length, r.seed) for r in records})} of {len(runner.jobs_of(profile, args.seed))}",
    }
    if merged:
        meta["merged"] = ", ".join(f"{folder} ({len(rows)} rows)" for folder, rows in merged) + \
            ": same samples, their shared rows checked equal"
        records = runner.merge_runs([(str(out), records), *merged])
    paths = report.write(out, records, alignment, maps, meta, profile.headline_ratio)
    print(paths["markdown"].read_text())
    print("wrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def cmd_maintain(args: argparse.Namespace) -> int:
    """verify (quarantine damaged entries), evict (LRU down to --max-bytes), compact (shrink the file)."""
    path = Path(args.store) if args.store else EngineConfig().store_path
    if not (path / "data.mdb").is_file():
        raise SystemExit(f"no store at {path}")  # never create an empty one under a mistyped path
    if args.command == "evict" and args.max_bytes < 0:
        raise SystemExit(f"--max-bytes must be >= 0, got {args.max_bytes}")
    with LMDBStore(path) as store:
        if args.command == "verify":
            print(store.verify())
        elif args.command == "evict":
            print(f"evicted {store.evict(args.max_bytes)} entries")
        else:
            before, after = store.compact()
            print(f"compacted {path}: {before:,} -> {after:,} bytes")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """Run `bench/bench_<name>.py` of the source checkout with the remaining arguments."""
    import runpy

    script = Path(__file__).resolve().parents[1] / "bench" / f"bench_{args.name}.py"
    if not script.exists():
        raise SystemExit(f"no benchmark {script}: benchmarks live in the source checkout's bench/ folder")
    sys.argv = [str(script), *args.rest]
    runpy.run_path(str(script), run_name="__main__")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cacheclip", description=__doc__)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)

    def with_models(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--primary", default=EngineConfig.primary,
                        help="embedded name, a local Hugging Face model folder, or a .gguf file")
        sp.add_argument("--aux", default=EngineConfig.aux, help="the selector model (same forms), or none")
        sp.add_argument("--device", default="cpu")
        sp.add_argument("--dtype", default="auto", choices=("auto", *DTYPES),
                        help="auto: bfloat16 on CUDA, float32 on CPU")
        sp.add_argument("--store-dtype", default="auto",
                        choices=("auto", *STORE_DTYPES),
                        help="how chunk caches are stored: auto = the model's dtype on CUDA, float16 on CPU; "
                        "float8_e4m3fn = one byte an element with a scale per channel")
        sp.add_argument("--aux-device", default="cpu")
        sp.add_argument("--store", default=None, help="LMDB directory (default: user cache) or a redis:// URL")
        sp.add_argument("--shared-store", default=None, help="redis:// URL of a tier shared by machines, behind "
                        "the local --store")
        return sp

    demo = with_models(sub.add_parser("demo", help="ingest the bundled handbook and compare methods"))
    demo.add_argument("--methods", default=",".join(METHODS))
    demo.add_argument("--ratio", type=float, default=0.2)
    demo.add_argument("--questions", type=int, default=len(DEMO_QUESTIONS))
    demo.add_argument("--max-new-tokens", type=int, default=16)
    demo.set_defaults(func=cmd_demo)

    ingest = with_models(sub.add_parser("ingest", help="files or folders (.md/.txt) -> FAISS index + KV store"))
    ingest.add_argument("paths", nargs="+")
    ingest.add_argument("--index", default=None, help="index directory (default: user cache)")
    ingest.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="compute the chunks' KV on Ray workers (a local cluster, or the one at ADDRESS)")
    ingest.add_argument("--ray-workers", type=int, default=2)
    ingest.add_argument("--chunk-size", type=int, default=256,
                        help="split sections longer than this many tokens (default 256: MiniLM's window)")
    ingest.set_defaults(func=cmd_ingest)

    query = with_models(sub.add_parser("query", help="answer a question over the ingested index (or --chunk-files)"))
    query.add_argument("question")
    query.add_argument("--chunk-files", nargs="*", help="answer over these files (default: the ingested index)")
    query.add_argument("--index", default=None, help="index directory written by `ingest`")
    query.add_argument("--top-k", type=int, default=4)
    query.add_argument("--method", default="cacheclip", choices=METHODS)
    query.add_argument("--ratio", type=float, default=0.2)
    query.add_argument("--max-new-tokens", type=int, default=32)
    query.set_defaults(func=cmd_query)

    evaluate = with_models(sub.add_parser("eval", help="RULER retrieval, fidelity and alignment evaluation"))
    evaluate.add_argument("--profile", default="quick", choices=("quick", "power", "sweep", "ablations", "full"))
    evaluate.add_argument("--tasks", default=None, help="comma-separated subset of the RULER tasks")
    evaluate.add_argument("--lengths", default=None, help="comma-separated context lengths in tokens")
    evaluate.add_argument("--ratios", default=None, help="comma-separated recompute ratios")
    evaluate.add_argument("--variants", default=None, help="comma-separated methods and ablations")
    evaluate.add_argument("--samples", default=None, help="samples per task: one count, or one per length (25,13)")
    evaluate.add_argument("--alignment-samples", type=int, default=None, help="prose samples per alignment length")
    evaluate.add_argument("--report-only", action="store_true", help="write the report of the samples --out holds")
    evaluate.add_argument("--limit-minutes", type=float, default=None,
                          help="start no new sample after this long (0: run one sample); rerun the same "
                               "command to resume")
    evaluate.add_argument("--alignment-lengths", default=None, help="context lengths of the alignment study")
    evaluate.add_argument("--merge", action="append", metavar="DIR",
                          help="another run folder over the same samples (e.g. the power run for --profile sweep) "
                               "whose records join the report; repeatable")
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--out", default="eval-results", help="run folder: records.jsonl is appended as samples "
                          "finish, and a rerun resumes it")
    evaluate.set_defaults(func=cmd_eval)

    bench = sub.add_parser("bench", help="run a benchmark script: reuse, methods, kernel, transfer, ...")
    bench.add_argument("name")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=cmd_bench)

    for name, text in (("verify", "check every entry's checksum; quarantine damaged ones"),
                       ("evict", "drop least-recently-used entries down to --max-bytes"),
                       ("compact", "rewrite the store file without free pages (no other process may use it)")):
        maintain = sub.add_parser(name, help=text)
        maintain.add_argument("--store", default=None)
        if name == "evict":
            maintain.add_argument("--max-bytes", type=int, required=True)
        maintain.set_defaults(func=cmd_maintain)

    inspect = sub.add_parser("inspect", help="store statistics: entries, bytes, models")
    inspect.add_argument("--store", default=None)
    inspect.set_defaults(func=cmd_inspect)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return args.func(args)
    except StoreError as err:  # a damaged, foreign, busy or full store: one line, not a traceback
        raise SystemExit(f"cacheclip {args.command}: {err}") from None


if __name__ == "__main__":
    raise SystemExit(main())
