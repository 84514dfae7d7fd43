"""The command line's arguments and every check of them that needs no model: parsed and checked here
with nothing heavy imported, so `--help` and each refusal of bad input answer in milliseconds."""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from pathlib import Path

from ..config import DEFAULT_AUX, DEFAULT_SELECTION, DTYPE_NAMES, METHODS, SELECTIONS, STORE_DTYPE_NAMES, EngineConfig, is_redis_url
from ..models.embedded import missing
from ..models.sources import ModelSourceError, check_model_source

DESCRIPTION = ("cacheclip-rag: fast RAG answers from precomputed chunk caches. Arguments are checked before anything "
               "heavy loads; torch, transformers and LlamaIndex load only when a command's work starts.")
DEMO_QUESTION_COUNT = 5  # demo.DEMO_SET (a test pins it)
EVAL_PROFILES = ("quick", "power", "sweep", "tail", "ablations", "gap", "full", "multichunk")  # evaluation.profiles.PROFILES (a test pins it)


def fail(message: str) -> None:
    raise SystemExit(message)


def index_dir(args: argparse.Namespace) -> Path:
    from ..config import default_cache_dir

    return Path(args.index) if args.index else default_cache_dir() / "index"


def check_models(args: argparse.Namespace) -> None:
    """The primary and the aux: embedded names, or folders and files that hold a causal LM."""
    for role in ("primary", "aux"):
        source = getattr(args, role)
        if role == "aux" and str(source).lower() == "none":
            continue
        if role == "aux" and source == DEFAULT_AUX and (command := missing(DEFAULT_AUX)) is not None:
            if getattr(args, "selection", None) == "aux":
                fail(f"--selection aux needs the aux model, and the default one (SmolLM2-135M) is not installed: {command}")
            continue  # the engine runs without it (the default selection needs none) and says so
        try:
            check_model_source(source, f"--{role}")
        except ModelSourceError as err:
            fail(str(err))


def check_devices(args: argparse.Namespace) -> None:
    for flag in ("device", "aux_device"):
        device = getattr(args, flag)
        if device.startswith("cuda"):
            import torch  # only for a CUDA request: the question needs torch anyway

            if not torch.cuda.is_available():
                fail(f"--{flag.replace('_', '-')} {device}: no CUDA device is available here")
        elif device not in ("cpu", "mps", "meta") and not device.startswith(("xpu", "mps:")):
            fail(f"--{flag.replace('_', '-')} {device!r}: not a device (cpu, cuda, cuda:N)")


def add_selection(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--selection", default=DEFAULT_SELECTION, choices=SELECTIONS,
                        help="cacheclip's choice of rows to recompute: question = the question's attention over the "
                             "reused cache (default; it keeps more of full's answers), aux = the paper's aux-model "
                             "selection")


def _check_ratio(ratio: float) -> None:
    if not 0.0 <= ratio <= 1.0 or math.isnan(ratio):
        fail(f"--ratio must be in [0, 1], got {ratio}")


def check_demo(args: argparse.Namespace) -> None:
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        fail(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    _check_ratio(args.ratio)
    if not 1 <= args.questions <= DEMO_QUESTION_COUNT:
        fail(f"--questions must be in [1, {DEMO_QUESTION_COUNT}], got {args.questions}")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_devices(args)
    check_models(args)


def check_server(url: str) -> None:
    """A running server answers at `url` (any HTTP status will do: it is there); probed with the standard
    library, so an unreachable one is refused at once."""
    import urllib.error
    import urllib.request

    probe = url.rstrip("/") + "/health"
    try:
        urllib.request.urlopen(probe, timeout=10).close()
    except urllib.error.HTTPError:
        return  # it answered
    except (urllib.error.URLError, OSError, ValueError) as err:
        fail(f"--server {url}: cannot reach it ({getattr(err, 'reason', err)}); is `cacheclip serve` running there?")


def check_ingest(args: argparse.Namespace) -> None:
    """In the order a user reads the command: the options, the files (each read and checked: strict UTF-8,
    not binary, not empty; a folder with none is refused), then the models or the server."""
    from .files import checked_texts

    if args.server is not None and not args.server.startswith(("http://", "https://")):
        fail(f"--server must be an http(s):// URL of a running `cacheclip serve`, got {args.server!r}")
    if args.server is None and (args.api_key or args.system):
        fail(f"{'--api-key' if args.api_key else '--system'} is for ingesting on a server: add --server URL")
    if args.system is not None and not args.system.strip():
        fail("--system is empty: give the text your system message has before the chunks")
    if args.chunk_size < 16:
        fail(f"--chunk-size must be >= 16 tokens, got {args.chunk_size}")
    if args.ray_workers < 1:
        fail(f"--ray-workers must be >= 1, got {args.ray_workers}")
    if args.handbook:
        from ..handbook import HANDBOOK

        args.paths = [*args.paths, str(HANDBOOK)]
    if not args.paths:
        fail("nothing to ingest: give files or folders, or --handbook for the bundled example")
    args.texts = checked_texts(args.paths)  # read once: the command uses these texts
    if args.server is not None:
        check_server(args.server)  # the server's own models answer: ours are not loaded
        return
    check_devices(args)
    check_models(args)


def check_delete(args: argparse.Namespace) -> None:
    if not args.server.startswith(("http://", "https://")):
        fail(f"--server must be an http(s):// URL of a running `cacheclip serve`, got {args.server!r}")
    if not args.ids and not args.file:
        fail("nothing to delete: give document ids, or --file for a file ingested with `ingest --server`")
    check_server(args.server)


def check_query(args: argparse.Namespace) -> None:
    """Everything a query can get wrong, before ~30 s of model loading."""
    if not args.question.strip():
        fail("the question is empty")
    _check_ratio(args.ratio)
    if args.top_k < 1:
        fail(f"--top-k must be >= 1, got {args.top_k}")
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    check_devices(args)
    if args.chunk_files is not None:
        if not args.chunk_files:
            fail("--chunk-files needs at least one file")
        for name in args.chunk_files:
            if not Path(name).is_file():
                fail(f"no such file: {name}")
        from .files import checked_texts

        args.texts = checked_texts(args.chunk_files, suffixes=None)
    check_models(args)  # what the user typed before what they left to the default (the index's place)
    if args.chunk_files is None and not (index_dir(args) / "docstore.json").exists():
        fail(f"no index at {index_dir(args)}: build one with `cacheclip ingest DOCS"
             f"{' --index ' + args.index if args.index else ''}`, or pass --chunk-files")


def store_path(args: argparse.Namespace) -> Path:
    return Path(args.store) if args.store else Path(EngineConfig.__dataclass_fields__["store_path"].default_factory())


def check_store(args: argparse.Namespace) -> None:
    """verify / evict / compact / inspect: an existing store, a budget that is a size."""
    path = store_path(args)
    if not (path / "data.mdb").is_file():
        fail(f"no store at {path}")  # never create an empty one under a mistyped path
    if args.command == "evict" and args.max_bytes < 0:
        fail(f"--max-bytes must be >= 0, got {args.max_bytes}")


def check_eval(args: argparse.Namespace) -> None:
    """The profile's settings, before the models load (the models themselves are checked as they load:
    a run's records say which were used)."""
    from ..evaluation.profiles import VARIANTS

    if args.variants:
        unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
        if unknown:
            fail(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.limit_minutes is not None and not args.limit_minutes >= 0:
        fail(f"--limit-minutes must be >= 0 (0 runs one sample), got {args.limit_minutes}")
    for name in ("ratios", "lengths", "samples"):
        value = getattr(args, name)
        try:
            numbers = [float(x) for x in value.split(",")] if value else []
        except ValueError:
            fail(f"--{name} takes comma-separated numbers, got {value!r}")
        if name == "ratios" and any(not 0 <= r <= 1 for r in numbers):
            fail(f"--ratios must each be in [0, 1], got {value}")
        if name != "ratios" and any(n < 1 or n != int(n) for n in numbers):
            fail(f"--{name} must be positive integers, got {value}")


def check_bench(args: argparse.Namespace) -> None:
    script = Path(__file__).resolve().parents[2] / "bench" / f"bench_{args.name}.py"
    if not script.exists():
        fail(f"no benchmark {script}: benchmarks live in the source checkout's bench/ folder")


def check_serve(args: argparse.Namespace) -> None:
    if not 0 < args.port < 65536:
        fail(f"--port must be in 1..65535, got {args.port}")
    if args.keys is not None:
        from ..serve.keys import load_keys

        if args.api_key:
            fail("--keys and --api-key: give the keys one way (the keys file can hold an admin key)")
        try:
            load_keys(args.keys)
        except ValueError as err:
            fail(str(err))
    if args.min_recompute_tokens < 0:
        fail(f"--min-recompute-tokens must be >= 0 (0: the ratio alone), got {args.min_recompute_tokens}")
    if args.replicas < 0:
        fail(f"--replicas must be >= 0, got {args.replicas}")
    if args.replicas and not args.shared_store:
        fail("--replicas needs --shared-store (redis://... or s3://bucket/prefix): the replicas share chunk caches "
             "and the texts they recognise through it")
    if args.max_prompt_chars is not None and args.max_prompt_chars < 1:
        fail(f"--max-prompt-chars must be >= 1, got {args.max_prompt_chars}")
    if not args.header_timeout_s > 0 or args.max_connections < 1:
        fail("--header-timeout-s must be > 0 and --max-connections >= 1")
    if args.max_connections_per_client < 0 or (args.max_queued_per_client or 0) < 0:
        fail("--max-connections-per-client and --max-queued-per-client must be >= 0 (0: no limit)")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key and args.keys is None:
        print(f"warning: serving on {args.host} without --api-key: anyone who reaches it can use the model",
              file=sys.stderr)
    if args.max_queue < 1:
        fail(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_batch < 1:
        fail(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.method not in METHODS:
        fail(f"--method must be one of {', '.join(METHODS)}")
    _check_ratio(args.ratio)
    check_devices(args)
    check_models(args)


# command -> (the check run first, with nothing heavy imported; "module:function" that does the work)
COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], None], str]] = {
    "demo": (check_demo, "demo:run"),
    "ingest": (check_ingest, "documents:ingest"),
    "delete": (check_delete, "documents:delete"),
    "query": (check_query, "documents:query"),
    "inspect": (check_store, "maintain:inspect"),
    "verify": (check_store, "maintain:maintain"),
    "evict": (check_store, "maintain:maintain"),
    "compact": (check_store, "maintain:maintain"),
    "eval": (check_eval, "evaluate:run"),
    "bench": (check_bench, "evaluate:bench"),
    "serve": (check_serve, "serving:run"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cacheclip", description=DESCRIPTION)
    p.add_argument("-v", "--verbose", action="store_true")
    sub = p.add_subparsers(dest="command", required=True)
    defaults = EngineConfig.__dataclass_fields__

    def with_models(sp: argparse.ArgumentParser) -> argparse.ArgumentParser:
        sp.add_argument("--primary", default=defaults["primary"].default,
                        help="embedded name, a local Hugging Face model folder, or a .gguf file")
        sp.add_argument("--aux", default=defaults["aux"].default, help="the selector model (same forms), or none")
        sp.add_argument("--device", default="cpu")
        sp.add_argument("--dtype", default="auto", choices=("auto", *DTYPE_NAMES),
                        help="auto: bfloat16 on CUDA and on CPUs with native bf16 (AVX-512 BF16, AMX), "
                        "else float32")
        sp.add_argument("--store-dtype", default="auto", choices=("auto", *STORE_DTYPE_NAMES),
                        help="how chunk caches are stored: auto = the model's dtype, float16 for a float32 model "
                        "on the CPU; "
                        "float8_e4m3fn = one byte an element with a scale per channel")
        sp.add_argument("--aux-device", default="cpu")
        sp.add_argument("--store", default=None, help="LMDB directory (default: user cache) or a redis:// URL")
        sp.add_argument("--shared-store", default=None, help="a tier shared by machines, behind the local --store: "
                        "redis://... or s3://bucket/prefix (S3-compatible; AWS_ENDPOINT_URL and the AWS credential "
                        "variables say where and who)")
        return sp

    demo = with_models(sub.add_parser("demo", help="ingest the bundled handbook and compare methods"))
    demo.add_argument("--methods", default=",".join(METHODS))
    demo.add_argument("--ratio", type=float, default=0.2)
    demo.add_argument("--questions", type=int, default=DEMO_QUESTION_COUNT)
    demo.add_argument("--max-new-tokens", type=int, default=16)
    add_selection(demo)

    ingest = with_models(sub.add_parser("ingest", help="files or folders (.md/.txt) -> FAISS index + KV store"))
    ingest.add_argument("paths", nargs="*", help="files or folders of .md/.txt")
    ingest.add_argument("--handbook", action="store_true", help="also the bundled example handbook (the README's data)")
    ingest.add_argument("--index", default=None, help="index directory (default: user cache)")
    ingest.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                        help="compute the chunks' KV on Ray workers (a local cluster, or the one at ADDRESS)")
    ingest.add_argument("--ray-workers", type=int, default=2)
    ingest.add_argument("--chunk-size", type=int, default=256,
                        help="split sections longer than this many tokens (default 256: MiniLM's window)")
    ingest.add_argument("--server", default=None, metavar="URL",
                        help="send the chunks to a running `cacheclip serve` (POST /v1/ingest) instead of a local "
                             "index and store")
    ingest.add_argument("--api-key", default=None, help="with --server: its API key")
    ingest.add_argument("--system", default=None, metavar="TEXT",
                        help="with --server: the exact text your app's system message has before the chunks it "
                             "pastes, blank line included (the caches are computed behind exactly that, so the "
                             "first request reuses them)")

    delete = sub.add_parser("delete", help="documents off a running `cacheclip serve`: by id, or a file's chunks")
    delete.add_argument("ids", nargs="*", help="the ids the documents were ingested under (/v1/ingest's `ids`)")
    delete.add_argument("--file", action="append", default=[], help="every chunk `ingest --server` sent from this file")
    delete.add_argument("--server", required=True, metavar="URL")
    delete.add_argument("--api-key", default=None)

    serving = with_models(sub.add_parser("serve", help="an OpenAI-compatible server that reuses stored chunks "
                                                         "found in ordinary prompts"))
    serving.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    serving.add_argument("--port", type=int, default=8000)
    serving.add_argument("--api-key", action="append", default=[], help="require this Bearer key (repeatable)")
    serving.add_argument("--keys", default=None, metavar="FILE",
                         help="tenants: a JSON file of key -> {\"tenant\": name, \"roles\": [\"ingest\"|\"admin\"]}; "
                              "each tenant's chunks are its own (instead of --api-key)")
    serving.add_argument("--model-name", default="cacheclip", help="the model name clients pass")
    serving.add_argument("--method", default="cacheclip", help="method for recognised prompts")
    serving.add_argument("--ratio", type=float, default=0.2)
    serving.add_argument("--min-recompute-tokens", type=int, default=256,
                         help="cacheclip recomputes at least this many chunk tokens (a shorter prompt runs as full)")
    add_selection(serving)
    serving.add_argument("--max-queue", type=int, default=8, help="requests waiting or running before 429")
    serving.add_argument("--max-batch", type=int, default=8,
                         help="running requests whose decode steps run as one forward (1: one at a time)")
    serving.add_argument("--max-body-mb", type=float, default=8.0)
    serving.add_argument("--max-prompt-chars", type=int, default=None,
                         help="refuse longer prompts before tokenizing (default: 16 per token of the model's context)")
    serving.add_argument("--header-timeout-s", type=float, default=10.0,
                         help="close a connection whose request headers take longer")
    serving.add_argument("--max-connections", type=int, default=256, help="open connections before 503")
    serving.add_argument("--max-connections-per-client", type=int, default=64,
                         help="open connections from one address before 503 (0: no limit; raise it behind a proxy)")
    serving.add_argument("--max-queued-per-client", type=int, default=None,
                         help="requests one API key, and one address, may have waiting or running before 429 "
                              "(default: half of --max-queue; 0: no limit)")
    serving.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    serving.add_argument("--replicas", type=int, default=0,
                         help="N > 0: N replicas on Ray Serve (a local Ray, or RAY_ADDRESS's cluster) behind the "
                              "chunk-affinity router; needs --shared-store (each replica's --store is a folder below it)")
    serving.add_argument("--router", default="affinity", choices=("affinity", "prefix", "pow2"),
                         help="with --replicas: chunk affinity, prompt-prefix affinity, or Serve's power of two choices")

    query = with_models(sub.add_parser("query", help="answer a question over the ingested index (or --chunk-files)"))
    query.add_argument("question")
    query.add_argument("--chunk-files", nargs="*", help="answer over these files (default: the ingested index)")
    query.add_argument("--index", default=None, help="index directory written by `ingest`")
    query.add_argument("--top-k", type=int, default=4)
    query.add_argument("--method", default="cacheclip", choices=METHODS)
    query.add_argument("--ratio", type=float, default=0.2)
    query.add_argument("--max-new-tokens", type=int, default=32)
    add_selection(query)

    evaluate = with_models(sub.add_parser("eval", help="RULER retrieval, fidelity and alignment evaluation"))
    evaluate.add_argument("--profile", default="quick", choices=EVAL_PROFILES)
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
    evaluate.add_argument("--format", default="deployed", choices=("deployed", "ruler"),
                          help="the prompts' layout: deployed (the engine's chat template, chunks behind its generic "
                               "system prompt, as served) or ruler (RULER's raw layout, its task preamble as the prefix)")
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--out", default="eval-results", help="run folder: records.jsonl is appended as samples "
                          "finish, and a rerun resumes it")

    bench = sub.add_parser("bench", help="run a benchmark script of a source checkout's bench/ folder (reuse, methods, "
                                         "kernel, deployed, ...); an installed wheel carries none")
    bench.add_argument("name")
    bench.add_argument("rest", nargs=argparse.REMAINDER)

    for name, text in (("verify", "check every entry's checksum; quarantine damaged ones"),
                       ("evict", "drop least-recently-used entries down to --max-bytes"),
                       ("compact", "rewrite the store file without free pages (no other process may use it)")):
        maintain = sub.add_parser(name, help=text)
        maintain.add_argument("--store", default=None)
        if name == "evict":
            maintain.add_argument("--max-bytes", type=int, required=True)

    inspect = sub.add_parser("inspect", help="store statistics: entries, bytes, models")
    inspect.add_argument("--store", default=None)
    return p


def engine_config(args: argparse.Namespace) -> EngineConfig:
    overrides = {"primary": args.primary, "aux": None if str(args.aux).lower() == "none" else args.aux,
                 "device": args.device, "aux_device": args.aux_device, "dtype": args.dtype,
                 "store_dtype": args.store_dtype}
    if args.store:
        overrides["store_path"] = args.store if is_redis_url(args.store) else Path(args.store)
    if getattr(args, "shared_store", None):
        overrides["shared_store"] = args.shared_store
    return EngineConfig(**overrides)
