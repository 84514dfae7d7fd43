"""Layer-wise loading (CacheBlend's pipeline): a request's chunk caches go host -> GPU one layer at a
time on a side stream, each layer re-rotated on the device as it lands, and the recompute of layer l
waits only for layer l's copies. Loading then hides behind compute instead of preceding it.

The ordering lives here, over a small `LayerStream` (run work, mark a layer done, wait for a layer):
`CudaLayerStream` is the real one; the CPU tests drive the same code with a stream that runs work at
once and logs the order.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from .ingest import FormattedPrefix, Loaded, read_or_compute
from ...models.loading import LoadedModel
from .rope import rotate_keys_
from ...store import ChunkEntry, Slot
from ...store.tiers import HostTier


class LayerStream(Protocol):
    def run(self, work: Callable[[], None]) -> None: ...  # queue work behind what was queued before
    def record(self, layer: int) -> None: ...  # layer's rows are complete once the work queued so far is
    def wait(self, layer: int) -> None: ...  # the compute that follows sees layer's rows complete


class CudaLayerStream:
    """A side CUDA stream and one event per layer."""

    def __init__(self, device: torch.device, layers: int):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.stream.wait_stream(torch.cuda.current_stream(device))  # the cache was zeroed on the compute stream
        self.events = [torch.cuda.Event() for _ in range(layers)]

    def run(self, work: Callable[[], None]) -> None:
        with torch.cuda.stream(self.stream):
            work()

    def record(self, layer: int) -> None:
        self.events[layer].record(self.stream)

    def wait(self, layer: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.events[layer])


def cuda_layer_stream(lm: LoadedModel) -> LayerStream | None:
    """The engine's default: layer-wise loading when the primary runs on CUDA."""
    if lm.device.type != "cuda":
        return None
    return CudaLayerStream(lm.device, lm.config.num_hidden_layers)


def copy_layerwise(stream: LayerStream, sources: Sequence[ChunkEntry], slots: Sequence[Slot], *,
                   rotate: Callable[[int], None], layers: int) -> None:
    """Queue, layer by layer, every chunk's K/V copy into its slot, then `rotate(layer)`, then mark the
    layer done. Sources are host tensors (pinned on CUDA: the copies are asynchronous DMA)."""
    for layer in range(layers):
        def work(layer: int = layer) -> None:
            for source, (keys, values) in zip(sources, slots):
                keys[layer].copy_(source.keys[layer], non_blocking=True)
                values[layer].copy_(source.values[layer], non_blocking=True)
            rotate(layer)

        stream.run(work)
        stream.record(layer)


def load_layerwise(lm: LoadedModel, tier: HostTier, *, texts: Sequence[str], token_ids: Sequence[Sequence[int]],
                   slots: Sequence[Slot], deltas: Sequence[int], variant: str, system_prompt: str | FormattedPrefix,
                   stream: LayerStream, batch_size: int = 4, store_dtype: torch.dtype | None = None,
                   bare: Sequence[bool] | None = None) -> Loaded:
    """`ingest.load_into` for a GPU cache behind a host tier, through `stream`: entries gathered in host
    memory first (held, read, or computed), then queued layer by layer with their re-rotation by
    `deltas[i]`. The caller makes the recompute wait for each layer (`BlendedCache.wait_for_layer`)."""
    dtype = slots[0][0].dtype if slots else lm.dtype
    shapes = [tuple(s[0].shape) for s in slots]
    prefix, keys, sources, views = read_or_compute(
        lm, tier, texts, lambda keys: tier.host_entries(keys, lm.fingerprint.digest, shapes, dtype), variant=variant,
        system_prompt=system_prompt, batch_size=batch_size, store_dtype=store_dtype, bare=bare, token_ids=token_ids)
    read = tuple(e is not None for e in sources)
    sources = [views[k].decode("cpu", dtype, pin=tier.pin) if e is None else e for k, e in zip(keys, sources)]

    rotations: dict = {}  # cos, sin per (layer type, delta): computed once per request, not per layer

    def rotate(layer: int) -> None:
        for (slot_keys, _), delta in zip(slots, deltas):
            rotate_keys_(lm.model, slot_keys, delta, layers=[layer], rotations=rotations)

    copy_layerwise(stream, sources, slots, rotate=rotate, layers=lm.config.num_hidden_layers)
    return Loaded(prefix, read)
