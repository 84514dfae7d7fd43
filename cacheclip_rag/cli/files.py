"""The text files a command reads, found and checked with the standard library alone, so that a bad
file or an empty folder is refused before torch, transformers or LlamaIndex is imported."""

from __future__ import annotations

from pathlib import Path

TEXT_SUFFIXES = (".md", ".txt")


def text_files(paths: list[str], suffixes: tuple[str, ...] | None = TEXT_SUFFIXES) -> list[Path]:
    """The files under `paths`, each once, by resolved path: a folder's files with one of `suffixes`,
    recursively, hidden files and folders skipped; a file named directly, whatever its suffix."""
    found: dict[Path, None] = {}
    for path in map(Path, paths):
        if not path.exists():
            raise SystemExit(f"no such file or folder: {path}")
        if path.is_dir():
            for file in sorted(path.rglob("*")):
                hidden = any(part.startswith(".") for part in file.relative_to(path).parts)
                if file.is_file() and not hidden and (suffixes is None or file.suffix.lower() in suffixes):
                    found[file.resolve()] = None
        else:
            found[path.resolve()] = None
    return list(found)


def read_text(file: Path) -> str:
    """The file's text, strictly UTF-8; a file that is not, is binary or is empty stops here, named."""
    try:
        data = file.read_bytes()
    except OSError as err:
        raise SystemExit(f"{file}: cannot be read ({err.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SystemExit(f"{file}: not UTF-8 text (byte {err.start}); convert it or leave it out") from None
    if "\x00" in text:
        raise SystemExit(f"{file}: binary data (NUL bytes), not text")
    if not text.strip():
        raise SystemExit(f"{file}: empty")
    return text


def checked_texts(paths: list[str], suffixes: tuple[str, ...] | None = TEXT_SUFFIXES) -> dict[Path, str]:
    """Every file's text, or the first problem named; no file is skipped in silence."""
    texts = {file: read_text(file) for file in text_files(paths, suffixes)}
    if not texts:
        kinds = " or ".join(suffixes) if suffixes else "text"
        raise SystemExit(f"no {kinds} files in {', '.join(paths)}")
    return texts
