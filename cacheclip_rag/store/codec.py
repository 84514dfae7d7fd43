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
from functools import cache

import numpy as np
import torch

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


@cache
def _fp8_table() -> np.ndarray:
    """float32 value of each of the 256 e4m3fn codes: decoding is a numpy table lookup."""
    return torch.arange(256, dtype=torch.uint8).view(FP8).float().numpy()


def _as_float32(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """A block of stored bit patterns as float32 (a new array)."""
    if dtype == torch.float32:
        return bits.view(np.float32).copy()
    if dtype == torch.float16:
        return bits.view(np.float16).astype(np.float32)
    if dtype == torch.bfloat16:
        return np.left_shift(bits, 16, dtype=np.uint32).view(np.float32)
    raise TypeError(f"no float32 decode for {dtype}")


def _write_float32(block: np.ndarray, dst: torch.Tensor) -> None:
    """Store a float32 block into `dst` (a CPU view of the same shape), rounding to dst's dtype."""
    if dst.dtype == torch.float32:
        np.copyto(_bits(dst).view(np.float32), block)
    elif dst.dtype == torch.float16:
        np.copyto(_bits(dst).view(np.float16), block, casting="unsafe")
    elif dst.dtype == torch.bfloat16:  # round to nearest even on the bit pattern (values are finite)
        u = block.view(np.uint32)
        np.copyto(_bits(dst), ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16))
    else:
        raise TypeError(f"cannot decode into {dst.dtype}")


def _copy_cpu(raw: memoryview, shape: tuple[int, ...], stored: torch.dtype, dst: torch.Tensor,
              scale: memoryview | None) -> None:
    bits = _stored_bits(raw, stored, shape)
    if stored == dst.dtype:
        np.copyto(_bits(dst), bits)
    elif stored == torch.float16 and dst.dtype == torch.float32:
        np.copyto(_bits(dst).view(np.float32), bits.view(np.float16))
    elif stored == torch.bfloat16 and dst.dtype == torch.float32:
        np.left_shift(bits, 16, out=_bits(dst), dtype=np.uint32)
    elif stored == FP8:
        scales = np.frombuffer(scale, dtype=np.float32).reshape(shape[0], shape[1], 1, shape[3])
        table = _fp8_table()
        for layer in range(shape[0]):  # a layer at a time: the float32 temporary stays small
            block = table[bits[layer]] * scales[layer]
            _write_float32(block, dst[layer])
    else:  # any other pair of dtypes goes through float32, a layer at a time
        for layer in range(shape[0]):
            _write_float32(_as_float32(bits[layer], stored), dst[layer])


def copy_into(raw: memoryview, shape: tuple[int, ...], stored: torch.dtype, dst: torch.Tensor,
              scale: memoryview | None = None) -> None:
    """Decode elements [L, KV, T, D] stored as `stored` (float8: with their float32 scales per channel,
    `scale`) from `raw` into `dst`, a tensor or view of that shape in any dtype, device and strides.
    On CUDA the copy is asynchronous on the current stream (its staging slot is not reused before
    it finishes)."""
    if tuple(dst.shape) != tuple(shape):
        raise ValueError(f"destination {tuple(dst.shape)} does not fit an entry of shape {list(shape)}")
    if dst.device.type == "cpu":
        _copy_cpu(raw, shape, stored, dst, scale)
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


def tensor_from_payload(raw: memoryview, shape: tuple[int, ...], stored: torch.dtype, dtype: torch.dtype,
                        device: torch.device | str, scale: memoryview | None = None, pin: bool = False) -> torch.Tensor:
    """A new tensor [L, KV, T, D] of `dtype` on `device` (pinned host memory when `pin`), decoded from
    `raw` in one copy."""
    device = torch.device(device)
    out = torch.empty(shape, dtype=dtype, device=device, pin_memory=pin and device.type == "cpu")
    copy_into(raw, shape, stored, out, scale)
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
    """Finite, of plausible magnitude (|x| <= 1e5), keys not all zero; float8 scales positive and
    bounded so that no decoded value passes 1e5. One scan of the stored bytes, single-threaded numpy."""
    from .entry import CorruptEntryError  # the error type lives with the format

    mask, limit = _MAGNITUDE[dtype]
    size = torch.tensor([], dtype=dtype).element_size()
    for name, raw in (("keys", keys), ("values", values)):
        if not len(raw):
            continue
        top = _magnitude_max(np.frombuffer(raw, dtype=_UINT_OF_SIZE[size]), mask)
        if top > limit:
            raise CorruptEntryError(f"corrupted entry: {name} hold NaN, inf or values beyond {_MAX_ABS:g}")
        if name == "keys" and top == 0:
            raise CorruptEntryError("corrupted entry: keys are all zero")
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
