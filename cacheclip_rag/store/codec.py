"""Payload bytes to tensors and back, at memory speed, without torch's thread pool on the CPU.

Every CPU copy here is numpy's (single-threaded memcpy or a cast loop), never a torch op: torch's
parallel copy uses OpenMP, whose pool hangs forever in a process forked after the parent used it
(libgomp is not fork-safe), so a forked reader would block on its first large entry. The copies are
memory-bound, so one thread loses little. A CUDA destination is filled through a pinned staging ring
and an asynchronous host-to-device copy; other devices take torch's plain copy.

`copy_into` decodes straight into any destination view (the blended cache's [L, KV, T, D] slot of
a chunk, strided), converting the stored dtype on the way, so a stored entry reaches the request in
one copy, with no tensor of its own in between.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch

from .errors import CorruptEntryError
from .staging import PinnedStaging

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}
FP8 = torch.float8_e4m3fn
_MAX_ABS = 1e5  # no real K/V element comes near this (fp16 tops out at 65504); a scaled payload does
_STAGING = PinnedStaging()


def raw_bytes(tensor: torch.Tensor) -> bytes:
    """A CPU tensor's bytes in row-major order (numpy does the gather and copy; see the module doc)."""
    return _bits(tensor).tobytes()


def _bits(tensor: torch.Tensor) -> np.ndarray:
    """A CPU tensor's bit patterns as an unsigned numpy view of the same memory (any strides; numpy has
    no bfloat16 or float8, and bits are bits)."""
    size = tensor.element_size()
    return tensor.view(INT_OF_SIZE[size]).numpy().view(_UINT_OF_SIZE[size])


def _stored_bits(raw: memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
    size = torch.tensor([], dtype=dtype).element_size()
    return np.frombuffer(raw, dtype=_UINT_OF_SIZE[size]).reshape(shape)


# torch's CPU kernels run a range below this many elements inline, never on the OpenMP pool (ATen's
# GRAIN_SIZE): dtype conversions are done in pieces of this size, with torch's vectorised cast loops
# (several times numpy's) and no thread pool, so they stay fork-safe
_SERIAL = 32768


def _convert_serially(src: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """dst = src (converted; times `scale` per channel for float8), in pieces torch runs inline."""
    layers, heads, tokens, dim = src.shape
    rows = max(1, _SERIAL // dim)
    for layer in range(layers):
        for head in range(heads):
            source, target = src[layer, head], dst[layer, head]  # [T, D], each contiguous
            if scale is None:
                for piece, out in zip(source.view(-1).split(rows * dim), target.view(-1).split(rows * dim)):
                    out.copy_(piece)
                continue
            factor = scale[layer, head]  # [1, D]
            for piece, out in zip(source.split(rows), target.split(rows)):
                out.copy_(piece.float().mul_(factor))


def _copy_cpu(raw: memoryview, shape: tuple[int, ...], stored: torch.dtype, dst: torch.Tensor, *,
              scale: memoryview | None) -> None:
    if stored == dst.dtype:
        np.copyto(_bits(dst), _stored_bits(raw, stored, shape))  # a memcpy
        return
    with warnings.catch_warnings():  # a read-only page: torch warns it is not writable; it is only read
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(raw, dtype=stored).view(shape) if len(raw) else torch.empty(shape, dtype=stored)
        factor = None if stored != FP8 else torch.frombuffer(scale, dtype=torch.float32).view(
            shape[0], shape[1], 1, shape[3])
    _convert_serially(source, dst, factor)


def copy_into(raw: memoryview, shape: tuple[int, ...], stored: torch.dtype, dst: torch.Tensor, *,
              scale: memoryview | None = None) -> None:
    """Decode elements [L, KV, T, D] stored as `stored` (float8: with their float32 scales per channel,
    `scale`) from `raw` into `dst`, a tensor or view of that shape in any dtype, device and strides.
    On CUDA the copy is asynchronous on the current stream (its staging slot is not reused before
    it finishes)."""
    if tuple(dst.shape) != tuple(shape):
        raise ValueError(f"destination {tuple(dst.shape)} does not fit an entry of shape {list(shape)}")
    if dst.device.type == "cpu":
        _copy_cpu(raw, shape, stored, dst, scale=scale)
        return
    if dst.device.type == "cuda":
        staged = _STAGING.stage(raw, stored, shape)
        source = staged.to(dst.device, non_blocking=True)
        _STAGING.release(staged)
        if stored == FP8:
            scales = _STAGING.stage(scale, torch.float32, (shape[0], shape[1], 1, shape[3]))
            factor = scales.to(dst.device, non_blocking=True)
            _STAGING.release(scales)
            source = source.float() * factor
        dst.copy_(source)
        return
    with warnings.catch_warnings():  # LMDB's read-only page: torch warns it is not writable; we only read it
        warnings.simplefilter("ignore", UserWarning)
        source = torch.frombuffer(raw, dtype=stored).view(shape)
        if stored == FP8:
            source = source.float() * torch.frombuffer(scale, dtype=torch.float32).view(
                shape[0], shape[1], 1, shape[3])
    dst.copy_(source)


def tensor_from_payload(raw: memoryview, shape: tuple[int, ...], stored: torch.dtype, *, dtype: torch.dtype,
                        device: torch.device | str, scale: memoryview | None = None, pin: bool = False) -> torch.Tensor:
    """A new tensor [L, KV, T, D] of `dtype` on `device` (pinned host memory when `pin`), decoded from
    `raw` in one copy."""
    device = torch.device(device)
    out = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin and device.type == "cpu")
    copy_into(raw, shape, stored, out, scale=scale)
    return out


# |x| <= _MAX_ABS as a bound on the magnitude bits (sign cleared) of each format: IEEE floats order
# like their bit patterns, and NaN and inf lie above every finite bound, so one integer max per
# block checks finiteness and magnitude, and max == 0 means all zeros
_MAGNITUDE = {torch.float32: (0x7FFFFFFF, int(np.array(_MAX_ABS, np.float32).view(np.uint32))),
              torch.float16: (0x7FFF, 0x7BFF),  # fp16's largest finite value is below _MAX_ABS
              torch.bfloat16: (0x7FFF, int(np.array(_MAX_ABS, np.float32).view(np.uint32)) >> 16),
              FP8: (0x7F, 0x7E)}  # e4m3fn: 0x7F / 0xFF are NaN, 0x7E is 448
_SCALE_LIMIT = int(np.array(_MAX_ABS / 448.0, np.float32).view(np.uint32))  # a code of 448 stays <= _MAX_ABS
_BLOCK = 1 << 22  # elements per pass of the scan: the temporary stays in cache


def _magnitude_max(bits: np.ndarray, mask: int) -> int:
    """max over the elements of (bits & mask), a block at a time."""
    flat, top = bits.reshape(-1), 0
    scratch = np.empty(min(_BLOCK, flat.size), dtype=flat.dtype)
    for at in range(0, flat.size, _BLOCK):
        part = flat[at : at + _BLOCK]
        out = scratch[: part.size]
        np.bitwise_and(part, mask, out=out)
        top = max(top, int(out.max()))
    return top


def check_values(keys: memoryview, values: memoryview, dtype: torch.dtype,
                 scales: tuple[memoryview, memoryview] | None = None) -> None:
    """Finite, of plausible magnitude (|x| <= 1e5), keys and values not all zero; float8 scales positive and
    bounded so that no decoded value passes 1e5. One scan of the stored bytes, single-threaded numpy."""
    mask, limit = _MAGNITUDE[dtype]
    size = torch.tensor([], dtype=dtype).element_size()
    for name, raw in (("keys", keys), ("values", values)):
        if not len(raw):
            continue
        top = _magnitude_max(np.frombuffer(raw, dtype=_UINT_OF_SIZE[size]), mask)
        if top > limit:
            raise CorruptEntryError(f"corrupted entry: {name} hold NaN, inf or values beyond {_MAX_ABS:g}")
        if top == 0:  # no chunk's keys or values are all zero: a zeroed page is
            raise CorruptEntryError(f"corrupted entry: {name} are all zero")
    for raw in scales or ():
        bits = np.frombuffer(raw, dtype=np.uint32)
        if bits.size and (int(bits.max()) > _SCALE_LIMIT or int(bits.min()) == 0):  # sign bit set: above the limit
            raise CorruptEntryError("corrupted entry: float8 scales are not positive and finite, or too large")


def copy_tensor(src: torch.Tensor, dst: torch.Tensor) -> None:
    """`dst.copy_(src)` that never enters torch's CPU thread pool (a CPU source is read as bytes)."""
    if src.device.type == "cpu":
        src = src if src.is_contiguous() else src.contiguous()  # entries are contiguous: no torch op here
        copy_into(memoryview(_bits(src)).cast("B"), tuple(src.shape), src.dtype, dst)
    else:
        dst.copy_(src, non_blocking=True)
