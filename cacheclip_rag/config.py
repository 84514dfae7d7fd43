"""The engine's configuration and the per-request options, each validated on construction."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path


DEFAULT_SYSTEM_PROMPT = (
    "You are a precise assistant. Answer the question using only the documents below. "
    "Reply with the answer alone."
)
# dtypes by name (resolved to torch's when a model loads: this module imports no torch, so the CLI can
# check its arguments at once): model weights and KV, and stored chunk caches
DTYPE_NAMES = ("float32", "bfloat16", "float16")
STORE_DTYPE_NAMES = ("float32", "float16", "bfloat16", "float8_e4m3fn")

METHODS = ("full", "direct", "shared_prefix", "ape", "cacheblend", "cacheclip", "oracle")

# APE (Yang et al., ICLR 2025): attention temperature and scaling factor on the parallel-encoded chunks
APE_TEMPERATURE = 0.9
APE_SCALE = 0.9
RECOMPUTE_LAYERS = ("all", "sliding", "global")  # Diagnostics.recompute_layers
# cacheclip's selectors (`RequestOptions.selection`): the question's attention over the reused cache (the
# default: it kept 0.96 of full's RULER 2K answers on the default primary where the paper's kept 0.85,
# bench/RESULTS.md), and the paper's aux-model attention. CacheBlend's deviation and the oracle are the
# selectors of the methods of those names.
SELECTIONS = ("question", "aux")
DEFAULT_SELECTION = "question"
SPREAD_RATIO = 0.5  # RequestOptions.spread_ratio's default
MIN_RECOMPUTE_TOKENS = 256  # RequestOptions.min_recompute_tokens's default


CACHE_ENV = "CACHECLIP_CACHE"


def default_cache_dir() -> Path:
    """The user cache (models converted once, the default store and index): $CACHECLIP_CACHE, else
    ~/.cache/cacheclip_rag. The one place the library reads the environment: the CLI and `EngineConfig`'s
    defaults call it, and pass the folder down."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "cacheclip_rag")


def check_dtype(value: object, names: tuple[str, ...] = DTYPE_NAMES) -> None:
    """"auto" or one of `names`, else a ValueError naming the choices (torch dtypes pass too)."""
    if type(value).__module__ == "torch":
        return
    if value != "auto" and value not in names:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(names)}, got {value!r}")


def is_redis_url(location: str) -> bool:
    return location.startswith(("redis://", "rediss://", "unix://"))


def is_s3_url(location: str) -> bool:
    return location.startswith(("s3://", "s3a://"))


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")


def _is_fraction(value: object) -> bool:
    """A number (not a bool, not NaN) in [0, 1]: a share of the chunk tokens."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0.0 <= value <= 1.0


def _require_str(name: str, value: object) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, got {type(value).__name__}")
    check_text(name, value)


def check_text(name: str, value: str) -> None:
    """Text that cannot be encoded as UTF-8 (a lone surrogate, e.g. from a bad decode) is refused here,
    by name, instead of failing deep inside a tokenizer."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name} is not valid Unicode text: {err.reason} at index {err.start} "
                         f"({value[err.start:err.end]!r})") from None


DEFAULT_AUX = "smollm2-135m"  # the paper's selector; optional: the default selection needs no aux


@dataclass(frozen=True)
class EngineConfig:
    """Which models, where the store lives, and the method's fixed parameters."""

    primary: str = "qwen2.5-coder-0.5b"
    aux: str | None = DEFAULT_AUX
    store_path: Path | str = None  # type: ignore[assignment]  # LMDB folder, or a redis URL (default: cache_dir / "store")
    # a tier shared by machines behind the local LMDB store at store_path: a redis URL, or s3://bucket/prefix (a cold
    # tier on S3-compatible object storage; AWS_ENDPOINT_URL and the AWS credential variables say where and who)
    shared_store: str | None = None
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    device: str = "cpu"
    aux_device: str = "cpu"
    window: int = 8
    threshold: int = 5
    ingest_batch_size: int = 4
    device_cache_bytes: int = 0  # > 0: keep hot chunk caches resident on `device` (LRU), e.g. 8 << 30 on a GPU
    # > 0: keep hot chunk caches decoded in host RAM in the model's dtype (LRU; pinned when CUDA is present,
    # where a request's chunks then load layer by layer beside the recompute), e.g. 32 << 30
    host_cache_bytes: int = 0
    # model weights and KV: "auto" (bf16 on CUDA and on CPUs with native bf16, else fp32), "float32", "bfloat16",
    # "float16"
    dtype: str = "auto"
    # stored chunk KV: "auto" = the model's dtype on CUDA and for 16-bit models, float16 for a float32 model on
    # the CPU (half the bytes; first-token KL against float32 storage measured in bench/RESULTS.md), or
    # "float32" / "bfloat16" / "float16", or
    # "float8_e4m3fn" (one byte an element plus a float32 scale per channel; read back as float32)
    store_dtype: str = "auto"
    aux_quantization: str | None = None  # "int8": the aux's selection pass runs int8 dynamic-quantized linears (CPU)
    cache_dir: Path | str = field(default_factory=default_cache_dir)  # embedded models converted once; the default store

    def __post_init__(self) -> None:
        if self.store_path is None:
            object.__setattr__(self, "store_path", Path(self.cache_dir) / "store")
        for name in ("window", "threshold", "ingest_batch_size", "device_cache_bytes", "host_cache_bytes"):
            _require_int(name, getattr(self, name))
        for name in ("primary", "system_prompt", "device", "aux_device"):
            _require_str(name, getattr(self, name))
        if self.shared_store is not None and is_redis_url(str(self.store_path)):
            raise ValueError("shared_store puts Redis behind a local LMDB store: store_path must then be a folder")
        if self.shared_store is not None and not (is_redis_url(self.shared_store) or is_s3_url(self.shared_store)):
            raise ValueError(f"shared_store is a redis:// or s3:// URL, got {self.shared_store!r}")
        if is_s3_url(str(self.store_path)):
            raise ValueError("an S3 bucket is a cold tier behind a local store: give it as shared_store, with "
                             "store_path a folder")
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 1 <= self.threshold <= self.window:
            raise ValueError(f"threshold must be in [1, window={self.window}], got {self.threshold}")
        check_dtype(self.dtype)  # a clear error for an unknown dtype, before any model loads
        check_dtype(self.store_dtype, STORE_DTYPE_NAMES)
        if self.aux_quantization not in (None, "int8"):
            raise ValueError(f"aux_quantization must be None or 'int8', got {self.aux_quantization!r}")
        if self.aux_quantization is not None and self.aux_device != "cpu":
            raise ValueError("aux_quantization='int8' is int8 dynamic quantization for the CPU: set aux_device='cpu'")
        for name in ("device_cache_bytes", "host_cache_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.ingest_batch_size < 1:
            raise ValueError(f"ingest_batch_size must be >= 1, got {self.ingest_batch_size}")
        if not self.system_prompt.strip():
            raise ValueError("system_prompt (the shared prefix) must not be empty")


@dataclass(frozen=True)
class Diagnostics:
    """Settings for experiments and measurement, not for users: ablations of the method as shipped, and how
    stage times are taken. The defaults are the method as shipped."""

    grouping: bool = True  # sliding-window grouping of the selected rows (False: plain top-k)
    shared_prefix: bool = True  # chunks computed behind the shared prefix (False: each alone)
    exact_budget: bool = True  # ratio = share of chunk tokens recomputed; False: the paper's nominal top-k
    # selection "aux": None, the paper's selection (separators rank last); k >= 0: each scored chunk's seam (its
    # separator tokens) and its first k tokens are recomputed first, out of the same budget (EPIC's observation)
    boundary_tokens: int | None = None
    # the layers whose recomputed chunk rows are written back ("sliding": the sliding-window layers only,
    # "global": the full-attention layers only); elsewhere the stored rows stay as loaded
    recompute_layers: str = "all"
    sync_timings: bool = False  # synchronise the GPU at stage boundaries, so each stage's time is its own
    # the spread budget's word trigger confirmed by the primary's question probe, where one ships for it
    # (`stages.select.question_kind`); False: the words alone, as before issue 67's probe
    question_probe: bool = True

    def __post_init__(self) -> None:
        for name in ("grouping", "shared_prefix", "exact_budget", "sync_timings", "question_probe"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.boundary_tokens is not None:
            _require_int("boundary_tokens", self.boundary_tokens)
            if self.boundary_tokens < 0:
                raise ValueError(f"boundary_tokens must be >= 0 (or None), got {self.boundary_tokens}")
        if self.recompute_layers not in RECOMPUTE_LAYERS:
            raise ValueError(f"recompute_layers must be one of {', '.join(RECOMPUTE_LAYERS)}, got {self.recompute_layers!r}")


DIAGNOSTICS = Diagnostics()


@dataclass(frozen=True)
class RequestOptions:
    """What one request asks for: method, recompute ratio, selection, decoding."""

    method: str = "cacheclip"
    ratio: float = 0.2
    # cacheclip's selector (SELECTIONS): "question", the question's own attention over the reused cache, or
    # "aux", the paper's aux-model attention. With "question", `aux_share` p in [0, 1) first spends p of the
    # budget by the aux's pick, recomputed before the question looks (ProphetKV's two stages; p of the budget
    # runs twice)
    selection: str = DEFAULT_SELECTION
    aux_share: float = 0.0
    # cacheclip recomputes at least this ratio when the question's subject is in two chunks or more (an answer
    # drawn from several chunks: `spread.answer_spread`); None: the ratio alone. At ratio 0.2 the lists such
    # questions ask for were kept in 0.74 of full's complete answers at 4K, at 0.5 in 0.93 (bench/RESULTS.md)
    spread_ratio: float | None = SPREAD_RATIO
    # cacheclip recomputes at least this many chunk tokens; a prompt with fewer runs as `full`; 0: the ratio
    # alone. Reuse saves a fraction of a second there (a 91-token prompt: 0.18 s against full's 0.21 s on 2 CPU
    # cores) and lost half the answers (bench/RESULTS.md, "Evaluated as deployed")
    min_recompute_tokens: int = MIN_RECOMPUTE_TOKENS
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    answer_prefix: str = ""
    prompt_stops: bool = True  # end at the prompt format's stop strings (False: only `stop` and the budget)
    system_prompt: str | None = None  # this request's shared prefix (default the engine's); chunks are cached behind each
    ape_temperature: float = APE_TEMPERATURE  # method "ape": chunk logits are divided by it (< 1 sharpens)
    ape_scale: float = APE_SCALE  # method "ape": the chunks' share of attention is raised to scale x temperature
    diagnostics: Diagnostics = DIAGNOSTICS  # ablations and timing (experiments only)

    def __post_init__(self) -> None:
        _require_int("max_new_tokens", self.max_new_tokens)
        _require_int("min_recompute_tokens", self.min_recompute_tokens)
        if self.min_recompute_tokens < 0:
            raise ValueError(f"min_recompute_tokens must be >= 0, got {self.min_recompute_tokens}")
        for name in ("temperature", "top_p", "ape_temperature", "ape_scale"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), (int, float)):
                raise TypeError(f"{name} must be a number, got {type(getattr(self, name)).__name__}")
        if self.seed is not None:
            _require_int("seed", self.seed)
            if not 0 <= self.seed < 1 << 63:
                raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        if isinstance(self.stop, str) or not isinstance(self.stop, (tuple, list)) or not all(
                isinstance(x, str) and x for x in self.stop):
            raise TypeError(f"stop must be a tuple of non-empty strings (e.g. stop=({self.stop!r},)), got {self.stop!r}")
        object.__setattr__(self, "stop", tuple(self.stop))
        _require_str("answer_prefix", self.answer_prefix)
        if self.system_prompt is not None:
            _require_str("system_prompt", self.system_prompt)
            if not self.system_prompt.strip():
                raise ValueError("system_prompt (the shared prefix) must not be empty; None uses the engine's")
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not _is_fraction(self.ratio):
            raise ValueError(f"recompute ratio must be a number in [0, 1], got {self.ratio!r}")
        if self.spread_ratio is not None and not _is_fraction(self.spread_ratio):
            raise ValueError(f"spread_ratio must be None or a number in [0, 1], got {self.spread_ratio!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("ape_temperature", "ape_scale"):
            if not 0.0 < getattr(self, name) <= 4.0:
                raise ValueError(f"{name} must be in (0, 4], got {getattr(self, name)}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if isinstance(self.aux_share, bool) or not isinstance(self.aux_share, (int, float)) \
                or not 0.0 <= self.aux_share < 1.0:
            raise ValueError(f"aux_share (the aux's share of the budget) must be a number in [0, 1), "
                             f"got {self.aux_share!r}")
        if self.aux_share and self.selection != "question":
            raise ValueError("aux_share is the aux's first stage of selection='question'")
        if not isinstance(self.diagnostics, Diagnostics):
            raise TypeError(f"diagnostics must be a Diagnostics, got {type(self.diagnostics).__name__}")
        if self.diagnostics.boundary_tokens is not None and self.selection != "aux":
            raise ValueError("boundary_tokens is an option of the paper's aux selection: set selection='aux' "
                             "with it (the default selection spends the whole budget by the question's attention)")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

