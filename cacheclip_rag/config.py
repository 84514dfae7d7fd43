"""The engine's configuration and the per-request options, each validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from .models import DEFAULT_SYSTEM_PROMPT, cache_dir

METHODS = ("full", "direct", "shared_prefix", "cacheblend", "cacheclip", "oracle")


@dataclass(frozen=True)
class EngineConfig:
    """Which models, where the store lives, and the method's fixed parameters."""

    primary: str = "gemma3-270m"
    aux: str | None = "smollm2-135m"
    store_path: Path = field(default_factory=lambda: cache_dir() / "store")
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    device: str = "cpu"
    aux_device: str = "cpu"
    window: int = 8
    threshold: int = 5
    ingest_batch_size: int = 4
    device_cache_bytes: int = 0  # > 0: keep hot chunk caches resident on `device` (LRU), e.g. 8 << 30 on a GPU

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window must be >= 1, got {self.window}")
        if not 1 <= self.threshold <= self.window:
            raise ValueError(f"threshold must be in [1, window={self.window}], got {self.threshold}")
        if self.device_cache_bytes < 0:
            raise ValueError(f"device_cache_bytes must be >= 0, got {self.device_cache_bytes}")
        if self.ingest_batch_size < 1:
            raise ValueError(f"ingest_batch_size must be >= 1, got {self.ingest_batch_size}")
        if not self.system_prompt.strip():
            raise ValueError("system_prompt (the shared prefix) must not be empty")

    @classmethod
    def embedded_default(cls, **overrides) -> EngineConfig:
        """Gemma 3 270M primary with SmolLM2-135M aux: cross-family, different tokenizers."""
        return cls(**overrides)

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
    sync_timings: bool = False  # synchronise the GPU at stage boundaries, so each stage's time is its own

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not isinstance(self.ratio, (int, float)) or math.isnan(self.ratio) or not 0.0 <= self.ratio <= 1.0:
            raise ValueError(f"recompute ratio must be a number in [0, 1], got {self.ratio!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if math.isnan(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
