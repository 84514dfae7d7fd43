"""Splitting documents into chunks: by markdown section, or by token count with overlap."""

from __future__ import annotations

import re

from transformers import PreTrainedTokenizerBase


def split_sections(markdown: str) -> list[str]:
    """One chunk per `## ` section (heading included); text before the first section is a chunk of its
    own, so nothing is dropped."""
    parts = re.split(r"(?m)^(?=## )", markdown)
    return [p.strip() for p in parts if p.strip()]


def split_tokens(text: str, tokenizer: PreTrainedTokenizerBase, size: int = 1000, overlap: int = 50) -> list[str]:
    """Chunks of `size` tokens overlapping by `overlap` (the paper's 1000/50), cut at token boundaries."""
    if size <= overlap or overlap < 0:
        raise ValueError(f"need size > overlap >= 0, got size={size}, overlap={overlap}")
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    if not offsets:
        return []
    chunks, start = [], 0
    while start < len(offsets):
        stop = min(start + size, len(offsets))
        begin = offsets[start][0]
        end = offsets[stop][0] if stop < len(offsets) else len(text)
        chunks.append(text[begin:end])
        if stop == len(offsets):
            break
        start = stop - overlap
    return [c for c in chunks if c.strip()]
