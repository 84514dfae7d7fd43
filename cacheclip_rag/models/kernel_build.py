"""Building a C++ kernel file on first use, with torch's extension builder, without hanging on a dead build.

torch's builder (`torch.utils.cpp_extension.load`: g++ and ninja, ~10-60 s here; cached under
`TORCH_EXTENSIONS_DIR`) serialises builds with a lock file in the build folder and waits for it without end; a
build killed mid-way leaves it behind (the server then hung at model load, logging nothing). `build` clears a
dead build's lock first and waits for a live one's a bounded time, and returns why a build did not happen
instead of raising: callers keep their torch paths. `cpu_kernels` (AVX-512 BF16) and `half_gemv` (AVX2, F16C)
build through it.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

# A lock older than STALE_LOCK_S is a dead build's, and is removed; a younger one is waited for until it goes or
# turns stale, at most LOCK_WAIT_S, after which the kernels are not used.
STALE_LOCK_S = 300.0
LOCK_WAIT_S = 330.0
SWITCHED_OFF = "CACHECLIP_CPU_KERNELS=0"  # the operator's switch for every kernel file


def switched_off() -> bool:
    """Whether the operator switched the CPU kernels off (`SWITCHED_OFF` in the environment)."""
    return os.environ.get("CACHECLIP_CPU_KERNELS", "1") == "0"


def put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the `ninja` package's binary sits in the environment's bin/,
    which is not on PATH when the interpreter is run by its full path."""
    try:
        import ninja
    except ImportError:
        return
    folder = getattr(ninja, "BIN_DIR", None)
    if folder and folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def build_lock(name: str) -> Path:
    """The lock file torch's builder keeps in extension `name`'s build folder while it builds."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(name, verbose=False)) / "lock"


def lock_cleared(lock: Path, *, stale_s: float = STALE_LOCK_S, wait_s: float = LOCK_WAIT_S,
                 poll_s: float = 1.0) -> bool:
    """Whether the build folder's `lock` is gone, or was a dead build's (older than `stale_s`, removed
    here); waits at most `wait_s` for a live build's lock to go."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            age = time.time() - lock.stat().st_mtime
        except FileNotFoundError:
            return True
        if age > stale_s:
            log.warning("removing %s, left %.0f s ago by a build that did not finish", lock, age)
            lock.unlink(missing_ok=True)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def build(name: str, source: Path, flags: list[str], lock: Path | None = None) -> str | None:
    """Build and load `source` as extension `name` (its ops registered with torch, no Python module) with
    `flags` and OpenMP's torch links; None where it loaded, else why not (in one line: no compiler, a live
    build's lock held too long, or the build's last error line). `lock`: the build folder's lock file (default
    `build_lock(name)`)."""
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        return "no C++ compiler on PATH"
    try:
        from torch.utils.cpp_extension import load

        put_ninja_on_path()
        lock = lock if lock is not None else build_lock(name)
        if not lock_cleared(lock):
            return f"another process has been building them for over {LOCK_WAIT_S:.0f} s ({lock})"
        load(name=name, sources=[str(source)], extra_cflags=flags, is_python_module=False, verbose=False)
    except Exception as error:  # noqa: BLE001 - any build failure leaves torch's paths in use
        text = str(error).strip()
        return f"the build failed: {text.splitlines()[-1] if text else repr(error)}"
    return None


class LazyKernels:
    """A kernel file built and loaded on the first `available()` call, once a process (thread-safe), or not,
    with the reason logged once: at WARNING where `lost(reason)` says the machine could have run them (a lost
    speed-up), else at INFO (the CPU cannot, or the operator switched them off). `why_not()` gives the reason
    not to try (None: try), `lock()` the build folder's lock file. `state` holds "ok", "reason" and "enabled"."""

    def __init__(self, name: str, source: Path, flags: list[str], *, why_not: Callable[[], str | None],
                 lost: Callable[[str], bool], lock: Callable[[], Path], logger: logging.Logger, fallback: str):
        self.name, self.source, self.flags = name, source, flags
        self.why_not, self.lost, self.lock, self.logger, self.fallback = why_not, lost, lock, logger, fallback
        self.state: dict[str, object] = {}
        self._mutex = threading.Lock()

    def available(self) -> bool:
        """Whether the kernels are built and loaded (building them on the first call)."""
        if "ok" in self.state:
            return bool(self.state["ok"])
        with self._mutex:
            if "ok" not in self.state:
                reason = self.why_not()
                if reason is None:
                    reason = build(self.name, self.source, self.flags, self.lock())
                if reason is not None:
                    self.logger.log(logging.WARNING if self.lost(reason) else logging.INFO,
                                    "%s not used (%s); %s", self.name, reason, self.fallback)
                self.state["ok"], self.state["reason"] = reason is None, reason
        return bool(self.state["ok"])

    def enabled(self) -> bool:
        """`available()` unless switched off in this process by `set_enabled(False)` (benchmarks compare both)."""
        return bool(self.state.get("enabled", True)) and self.available()

    def set_enabled(self, on: bool) -> None:
        """Use the kernels where they apply (True, the default) or keep torch's paths everywhere (False)."""
        self.state["enabled"] = bool(on)
