"""The engine's configuration and the per-request options, each validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .embedded import cache_dir

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
RECOMPUTE_LAYERS = ("all", "sliding", "global")  # RequestOptions.recompute_layers
# cacheclip's default selection: the question's attention over the reused cache (`requery=0`); None is the paper's
REQUERY_DEFAULT: float | None = 0.0


def check_dtype(value: object, names: tuple[str, ...] = DTYPE_NAMES) -> None:
    """"auto" or one of `names`, else a ValueError naming the choices (torch dtypes pass too)."""
    if type(value).__module__ == "torch":
        return
    if value != "auto" and value not in names:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(names)}, got {value!r}")


def is_redis_url(location: str) -> bool:
    return location.startswith(("redis://", "rediss://", "unix://"))


def _require_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")


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


@dataclass(frozen=True)
class EngineConfig:
    """Which models, where the store lives, and the method's fixed parameters."""

    primary: str = "qwen2.5-coder-0.5b"
    aux: str | None = "smollm2-135m"
    store_path: Path | str = field(default_factory=lambda: cache_dir() / "store")  # LMDB folder, or a redis URL
    shared_store: str | None = None  # a redis URL: a shared tier behind the local LMDB store at store_path
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
    dtype: str = "auto"  # model weights and KV: "auto" (bf16 on CUDA, fp32 on CPU), "float32", "bfloat16", "float16"
    # stored chunk KV: "auto" = the model's dtype on CUDA, float16 on the CPU (half the bytes; first-token
    # KL against float32 storage measured in bench/RESULTS.md), or "float32" / "bfloat16" / "float16", or
    # "float8_e4m3fn" (one byte an element plus a float32 scale per channel; read back as float32)
    store_dtype: str = "auto"
    aux_quantization: str | None = None  # "int8": the aux's selection pass runs int8 dynamic-quantized linears (CPU)

    def __post_init__(self) -> None:
        for name in ("window", "threshold", "ingest_batch_size", "device_cache_bytes", "host_cache_bytes"):
            _require_int(name, getattr(self, name))
        for name in ("primary", "system_prompt", "device", "aux_device"):
            _require_str(name, getattr(self, name))
        if self.shared_store is not None and is_redis_url(str(self.store_path)):
            raise ValueError("shared_store puts Redis behind a local LMDB store: store_path must then be a folder")
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

    @classmethod
    def embedded_default(cls, **overrides) -> EngineConfig:
        """Qwen2.5-Coder-0.5B-Instruct primary with SmolLM2-135M aux: cross-family, different tokenizers."""
        return cls(**overrides)

    @classmethod
    def gemma_base(cls, **overrides) -> EngineConfig:
        """Gemma 3 270M (base) primary with SmolLM2-135M aux: the pair the RULER records were measured on."""
        return cls(primary="gemma3-270m", **overrides)

    @classmethod
    def smollm2_only(cls, **overrides) -> EngineConfig:
        """SmolLM2-135M as primary and as its own aux (one tokenizer, fastest on a CPU)."""
        return cls(primary="smollm2-135m", aux="smollm2-135m", **overrides)


@dataclass(frozen=True)
class RequestOptions:
    """What one request asks for: method, recompute ratio, decoding."""

    method: str = "cacheclip"
    ratio: float = 0.2
    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    answer_prefix: str = ""
    grouping: bool = True
    shared_prefix: bool = True
    prompt_stops: bool = True  # end at the prompt format's stop strings (False: only `stop` and the budget)
    exact_budget: bool = True  # ratio = share of chunk tokens recomputed; False: the paper's nominal top-k
    sync_timings: bool = False  # synchronise the GPU at stage boundaries, so each stage's time is its own
    system_prompt: str | None = None  # this request's shared prefix (default the engine's); chunks are cached behind each
    ape_temperature: float = APE_TEMPERATURE  # method "ape": chunk logits are divided by it (< 1 sharpens)
    ape_scale: float = APE_SCALE  # method "ape": the chunks' share of attention is raised to scale x temperature
    # cacheclip: None, the paper's selection (separators rank last); k >= 0: each scored chunk's seam (its
    # separator tokens) and its first k tokens are recomputed first, out of the same budget (EPIC's observation)
    boundary_tokens: int | None = None
    # diagnostic: the layers whose recomputed chunk rows are written back ("sliding": the sliding-window
    # layers only, "global": the full-attention layers only); elsewhere the stored rows stay as loaded
    recompute_layers: str = "all"
    # cacheclip's selection. p in [0, 1): query-driven (ProphetKV's idea, `requery`): the aux picks p of the
    # budget, which is recomputed; the question's attention over that partly corrected cache picks the rest;
    # the union is recomputed in one pass (p of the budget twice). The default 0 is the question's attention
    # over the reused cache alone: it keeps 0.96 of full's RULER 2K answers on the default primary where the
    # paper's keeps 0.85 (bench/RESULTS.md). None: the paper's one-stage aux selection (for reproduction).
    requery: float | None = REQUERY_DEFAULT

    def __post_init__(self) -> None:
        _require_int("max_new_tokens", self.max_new_tokens)
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
        if isinstance(self.ratio, bool) or not isinstance(self.ratio, (int, float)) or math.isnan(self.ratio) \
                or not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"recompute ratio must be a number in [0, 1], got {self.ratio!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for name in ("ape_temperature", "ape_scale"):
            if not 0.0 < getattr(self, name) <= 4.0:
                raise ValueError(f"{name} must be in (0, 4], got {getattr(self, name)}")
        if self.boundary_tokens is not None:
            _require_int("boundary_tokens", self.boundary_tokens)
            if self.boundary_tokens < 0:
                raise ValueError(f"boundary_tokens must be >= 0 (or None), got {self.boundary_tokens}")
        if self.requery is not None:
            if isinstance(self.requery, bool) or not isinstance(self.requery, (int, float)) \
                    or not 0.0 <= self.requery < 1.0:
                raise ValueError(f"requery (the aux's share of the budget) must be a number in [0, 1) or None, "
                                 f"got {self.requery!r}")
            if self.boundary_tokens is not None:
                raise ValueError("boundary_tokens is an option of the paper's aux selection: set requery=None with it "
                                 "(the default selection, requery=0, spends the whole budget by the question's attention)")
        if self.recompute_layers not in RECOMPUTE_LAYERS:
            raise ValueError(f"recompute_layers must be one of {', '.join(RECOMPUTE_LAYERS)}, got {self.recompute_layers!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
