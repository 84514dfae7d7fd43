"""Mapping a token selection between two tokenizations of the same text through character offsets.

Each token owns the characters from its start up to the next token's start, so the spans tile the
text and no character is lost to offsets that skip whitespace or split a multi-byte character. A
target token is selected when its span overlaps the span of a selected source token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def beyond_text(offsets: Sequence[tuple[int, int]], text: str) -> torch.Tensor:
    """Bool [T]: the tokens that start after `text` ends (a chunk's separator, stored with it)."""
    return torch.tensor([start >= len(text) for start, _ in offsets], dtype=torch.bool)


def tiled_spans(offsets: Sequence[tuple[int, int]], text_length: int) -> torch.Tensor:
    """[T, 2] spans [start, stop) that tile [first start, text_length) with at least one char each."""
    if not offsets:
        return torch.zeros((0, 2), dtype=torch.long)
    starts = torch.tensor([o[0] for o in offsets], dtype=torch.long)
    starts = torch.cummax(starts, 0).values  # offsets are monotone; guard against odd tokenizers
    stops = torch.cat([starts[1:], torch.tensor([max(text_length, int(starts[-1]) + 1)])])
    stops = torch.maximum(stops, starts + 1)
    return torch.stack([starts, stops], dim=1)


def selected_characters(offsets: Sequence[tuple[int, int]], selected: torch.Tensor, text_length: int) -> torch.Tensor:
    """Bool [text_length + 1] marking the characters the selected tokens own."""
    spans = tiled_spans(offsets, text_length)
    marks = torch.zeros(text_length + 2, dtype=torch.long)
    chosen = spans[selected.bool()]
    marks.index_add_(0, chosen[:, 0].clamp(max=text_length + 1), torch.ones(len(chosen), dtype=torch.long))
    marks.index_add_(0, chosen[:, 1].clamp(max=text_length + 1), -torch.ones(len(chosen), dtype=torch.long))
    return marks.cumsum(0)[: text_length + 1] > 0


def map_selection(
    source_offsets: Sequence[tuple[int, int]],
    source_selected: torch.Tensor,
    target_offsets: Sequence[tuple[int, int]],
    text_length: int,
) -> torch.Tensor:
    """Bool [T_target]: target tokens overlapping any selected source token's characters."""
    if list(source_offsets) == list(target_offsets):
        return source_selected.bool().clone()  # same tokenizer: one to one
    chars = selected_characters(source_offsets, source_selected, text_length).long()
    prefix = torch.cat([torch.zeros(1, dtype=torch.long), chars.cumsum(0)])
    spans = tiled_spans(target_offsets, text_length).clamp(max=text_length + 1)
    return (prefix[spans[:, 1]] - prefix[spans[:, 0]]) > 0
