"""Attention masks by position, and the attention function the engine registers with transformers.

Every forward the engine runs writes its rows at explicit positions of a full-length cache
(`cache.BlendedCache`), so the mask is built here from those positions: a query at position p sees
keys at positions <= p (and > p - window on sliding-window layers). transformers' own mask builders
assume contiguous queries and are bypassed by passing these masks in.

The registered attention function "cacheclip" is sdpa, except when a probe is attached to a layer
(last-layer attention capture for token selection), a faster kernel is plugged in for CUDA, or, on the
CPU, the rows are many and masked by position: then blocks of rows attend over only the keys each block
can see (`blocked_attention`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ...models import cpu_kernels
from .blocked_attention import RowBlock, blocked_attention
from ...models.loading import layer_types, text_config

ATTENTION_NAME = "cacheclip"

# A kernel for scattered query rows on CUDA: (query, key, value, query_positions, scaling=, softcap=,
# sliding_window=, validate=) -> output [B, T, H, D], with query_positions int32 and checked once per
# forward (validate=False); the engine sets it on CUDA when Triton is present.
SelectedRowsKernel = Callable[..., torch.Tensor]


@dataclass
class AttentionProbe:
    """Collects the attention probabilities of one layer during a forward: [B, H, Tq, Tk]; with `rows`
    (bool [Tq]), only their mean over heads and those query rows, [B, Tk] (a probe on every layer of a
    long prompt would otherwise hold H x Tq x Tk floats per layer)."""

    weights: torch.Tensor | None = None
    rows: torch.Tensor | None = None

    def record(self, probs: torch.Tensor) -> None:
        if self.rows is None:
            self.weights = probs
        else:
            self.weights = probs[:, :, self.rows.to(probs.device)].float().mean(dim=(1, 2))


@dataclass(frozen=True)
class ChunkScaling:
    """APE's query-time attention over parallel-encoded chunks (Yang et al., ICLR 2025).

    Keys in cache rows [start, stop) are the chunks. A query's logits on them are divided by
    `temperature`, and the chunks' total weight exp(LSE_chunks) becomes exp(scale * temperature *
    LSE_chunks(x / temperature)) against the unchanged weight of every other key (prefix, question,
    answer): the two-block combination of APE's reference kernel, written as one softmax over
    logits offset by (scale * temperature - 1) * LSE_chunks.
    """

    start: int
    stop: int
    temperature: float
    scale: float
    row_positions: torch.Tensor | None = None  # position of every cache row (chunks overlap), for the masks


@dataclass(frozen=True)
class RaggedBatch:
    """Several requests in one forward, each over its own cache (`batching.forward_rows`): their rows are
    packed into one sequence, request b's at `segments[b]` = [start, stop); its keys and values come as
    list items, and `masks[b]` is its `position_masks` result; `kinds[l]` is layer l's type."""

    segments: list[tuple[int, int]]
    masks: list[torch.Tensor | dict[str, torch.Tensor | None] | None]
    kinds: list[str]

    def mask(self, b: int, layer: int) -> torch.Tensor | None:
        mask = self.masks[b]
        return mask.get(self.kinds[layer]) if isinstance(mask, dict) else mask


@dataclass
class ForwardContext:
    """Per-forward information the attention function needs beyond what transformers passes."""

    query_positions: torch.Tensor  # [B, Tq] absolute positions of the query rows
    kernel: SelectedRowsKernel | None = None
    probes: dict[int, AttentionProbe] = field(default_factory=dict)
    chunk_scaling: ChunkScaling | None = None
    ragged: RaggedBatch | None = None
    row_blocks: tuple[RowBlock, ...] | None = None  # CPU: attend by blocks of rows (`blocked_attention`)
    # the masks are the default ones by `query_positions` (one sequence): a row sees keys 0..its position
    masks_by_position: bool = False


def _by_kv_head(rows: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[B, H, T, X] -> [B, KV, G*T, X]: the G query heads that read one KV head (head h reads h // G, as
    `repeat_kv` pairs them), stacked as rows."""
    b, h, t, x = rows.shape
    return rows.reshape(b, kv_heads, (h // kv_heads) * t, x)


def _scores(query, key, mask, *, scaling, softcap) -> torch.Tensor:
    """float32 attention logits [B, H, Tq, Tk], softcapped and masked. Each KV head's query heads run as
    one float32 `mm` against its keys, which are never repeated per query head: the question pass probes
    every layer, and copying a 4K cache's keys to 14 heads (then to float32) cost more than the products."""
    b, h, tq, _ = query.shape
    kv, tk = key.shape[1], key.shape[2]
    grouped = _by_kv_head(query.float(), kv)
    scores = torch.empty(b, kv, grouped.shape[2], tk, dtype=torch.float32, device=query.device)
    for i in range(b):
        for j in range(kv):
            torch.mm(grouped[i, j], key[i, j].float().t(), out=scores[i, j])
    scores = scores.view(b, h, tq, tk).mul_(scaling)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores + mask.float()
    return scores


def _attend(probs: torch.Tensor, value: torch.Tensor, heads: int) -> torch.Tensor:
    """probs [B, H, Tq, Tk] over values [B, KV, Tk, D] -> [B, Tq, H, D], each KV head's values read once
    for its query heads (one `mm` over the cache's rows, no repeated copy)."""
    b, _, tq, _ = probs.shape
    kv, d = value.shape[1], value.shape[3]
    grouped = _by_kv_head(probs.to(value.dtype), kv)
    out = torch.empty(b, kv, grouped.shape[2], d, dtype=value.dtype, device=value.device)
    for i in range(b):
        for j in range(kv):
            torch.mm(grouped[i, j], value[i, j], out=out[i, j])
    return out.view(b, heads, tq, d).transpose(1, 2).contiguous()


def _eager_with_weights(module, query, key, value, mask, *, scaling, softcap):
    probs = torch.softmax(_scores(query, key, mask, scaling=scaling, softcap=softcap), dim=-1)
    return _attend(probs, value, query.shape[1]), probs


def one_row_attention(query, key, value, mask, *, scaling, softcap) -> torch.Tensor:
    """Attention [B, 1, H, D] of one query row [B, H, 1, D] (a decode step) over keys/values [B, KV, N, D]:
    for each sequence and KV head, its query heads as one `mm` against the unrepeated keys (a transposed
    operand, not a copy), softmax in float32. On the CPU this took 0.3 ms a layer against sdpa's 5.0 ms for
    one row over 4K rows (bench/RESULTS.md, issue 50): sdpa copies the keys once per query head
    (`repeat_kv`) and runs its blocked kernel for a single row. A batched `matmul` over the cache's slice
    (strided: the cache holds room to grow) copied the keys and values every layer, 2-4x slower here.
    Without a mask or softcap, a bf16 row of one sequence goes to `cpu_kernels.one_row_attention` where
    it is built (2-4x faster again at 2K-4K, bench/RESULTS.md)."""
    if mask is None and softcap is None and cpu_kernels.attention_applies(query, key, value):
        return cpu_kernels.one_row_attention(query, key, value, scaling)
    batch, heads, _, dim = query.shape
    kv_heads, rows = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)  # head h reads KV head h // group
    if mask is not None:  # [B, 1, 1, N], additive or boolean (allowed)
        mask = mask[..., :rows].reshape(mask.shape[0], rows)
    out = torch.empty(batch, kv_heads, heads // kv_heads, dim, dtype=value.dtype, device=value.device)
    for b in range(batch):
        for h in range(kv_heads):
            scores = torch.mm(grouped[b, h], key[b, h].t()).float().mul_(scaling)  # [group, N]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            if mask is not None:
                row = mask[b if mask.shape[0] > 1 else 0]
                scores = scores.masked_fill(~row, float("-inf")) if row.dtype == torch.bool else scores + row.float()
            torch.mm(torch.softmax(scores, dim=-1).to(value.dtype), value[b, h], out=out[b, h])
    return out.reshape(batch, 1, heads, dim)


def dense_attention(module, query, key, value, mask, *, scaling, softcap, **kwargs) -> torch.Tensor:
    """[B, Tq, H, D] by the fastest exact path for the shape: one CPU query row by `one_row_attention`, a
    bf16 causal prefill on the CPU by `cpu_kernels.positioned_attention` where it is built (not on CPUs with
    AMX, where torch's flash path is faster: `torch_attention_is_faster`), a softcap eagerly (sdpa has none),
    everything else by sdpa (its causal path when `mask` is None)."""
    if query.shape[2] == 1 and query.device.type == "cpu":
        return one_row_attention(query, key, value, mask, scaling=scaling, softcap=softcap)
    rows, keys = query.shape[2], key.shape[2]
    if (mask is None and softcap is None and rows == keys and getattr(module, "is_causal", True)
            and kwargs.get("sliding_window") is None and cpu_kernels.positioned_used(query, key, value)):
        # sdpa's causal path (no mask, as many keys as rows) by the CPU kernel: row t sees keys 0..t
        return cpu_kernels.positioned_attention(query, torch.arange(rows), key, value, scaling)
    if softcap is not None:
        return _eager_with_weights(module, query, key, value, mask, scaling=scaling, softcap=softcap)[0]
    return sdpa_attention_forward(module, query, key, value, mask, scaling=scaling, **kwargs)[0]


def chunk_scaled_attention(query, key, value, mask, *, scaling, softcap, chunks: ChunkScaling) -> torch.Tensor:
    """Attention [B, Tq, H, D] with APE's temperature and scale on the chunk rows (see `ChunkScaling`)."""
    scores = _scores(query, key, mask, scaling=scaling, softcap=softcap)
    start, stop = chunks.start, min(chunks.stop, scores.shape[-1])
    inside = scores[..., start:stop] / chunks.temperature
    lse = torch.logsumexp(inside, dim=-1, keepdim=True)
    lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))  # no chunk row visible (window)
    inside = inside + (chunks.scale * chunks.temperature - 1.0) * lse
    scores = torch.cat([scores[..., :start], inside, scores[..., stop:]], dim=-1)
    return _attend(torch.softmax(scores, dim=-1), value, query.shape[1])


def ragged_attention(module, query, keys, values, *, batch: RaggedBatch, positions: torch.Tensor, scaling, softcap,
                     **kwargs) -> torch.Tensor:
    """query [1, H, sum T, D] (the requests' rows packed) at `positions` [sum T], keys/values one [1, KV, N_b, D]
    per request -> [1, sum T, H, D]: each request's segment attends over its own cache. A segment of several
    rows goes to `cpu_kernels.positioned_attention` where it applies and torch's path is not faster (AMX):
    each request's mask is by these positions (`batching.forward_rows`), which the kernel reads itself."""
    by_position = softcap is None and kwargs.get("sliding_window") is None
    outs = []
    for b, (start, stop) in enumerate(batch.segments):
        rows = query[:, :, start:stop]
        if by_position and stop - start > 1 and cpu_kernels.positioned_used(rows, keys[b], values[b]):
            outs.append(cpu_kernels.positioned_attention(rows, positions[start:stop], keys[b], values[b], scaling))
        else:
            outs.append(dense_attention(module, rows, keys[b], values[b], batch.mask(b, module.layer_idx),
                                        scaling=scaling, softcap=softcap, **kwargs))
    return torch.cat(outs, dim=1)


# The forward context is per thread: aux selection runs in a worker thread while the main thread
# may run the primary (the same module object when a model is its own aux).
_active = threading.local()


def cacheclip_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """`dense_attention`, eager-with-weights for probed layers, or the selected-rows kernel when one is plugged in
    (the engine plugs it in on CUDA; tests plug it in under the Triton interpreter)."""
    context: ForwardContext | None = getattr(_active, "context", None)
    scaling = module.head_dim**-0.5 if scaling is None else scaling
    softcap = kwargs.get("softcap")
    if context is not None:
        if context.ragged is not None:
            return ragged_attention(module, query, key, value, batch=context.ragged, positions=context.query_positions[0],
                                    scaling=scaling, softcap=softcap, **kwargs), None
        probe = context.probes.get(module.layer_idx)
        if probe is not None:
            out, probs = _eager_with_weights(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap)
            probe.record(probs)
            return out, None
        if context.chunk_scaling is not None:
            return chunk_scaled_attention(query, key, value, attention_mask, scaling=scaling, softcap=softcap,
                                          chunks=context.chunk_scaling), None
        if context.kernel is not None:
            out = context.kernel(
                query, key, value, context.query_positions,
                scaling=scaling, softcap=softcap, sliding_window=kwargs.get("sliding_window"),
            )
            return out, None
        if (context.masks_by_position and attention_mask is not None and softcap is None
                and kwargs.get("sliding_window") is None and query.shape[2] == context.query_positions.shape[-1]
                and cpu_kernels.positioned_used(query, key, value)):
            # the default masks by position: each row sees keys 0..its position, which the kernel reads itself
            return cpu_kernels.positioned_attention(query, context.query_positions[0], key, value, scaling), None
        blocks = context.row_blocks
        if blocks is not None and attention_mask is not None and softcap is None and query.shape[2] == blocks[-1].stop:
            return blocked_attention(query, key, value, attention_mask, blocks, scaling=scaling,
                                     sliding_window=kwargs.get("sliding_window")), None
    return dense_attention(module, query, key, value, attention_mask, scaling=scaling, softcap=softcap,
                           dropout=dropout, **kwargs), None


def cacheclip_mask(*args, **kwargs):
    """transformers' sdpa mask, except under a kernel that masks by position itself: then no mask is
    built at all (a [Tq, N] mask at 16K tokens is hundreds of MB that nothing would read)."""
    context: ForwardContext | None = getattr(_active, "context", None)
    if context is not None and context.ragged is not None:  # each request's own mask is in the context
        return None
    if context is not None and context.kernel is not None and not context.probes and context.chunk_scaling is None:
        return None
    return sdpa_mask(*args, **kwargs)


AttentionInterface.register(ATTENTION_NAME, cacheclip_attention)
AttentionMaskInterface.register(ATTENTION_NAME, cacheclip_mask)


def use_cacheclip_attention(model: PreTrainedModel) -> None:
    """Route the model's attention through `cacheclip_attention` (idempotent)."""
    if model.config._attn_implementation != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)


@contextmanager
def forward_context(context: ForwardContext) -> Iterator[ForwardContext]:
    """Make `context` visible to the attention function for one forward in this thread."""
    previous = getattr(_active, "context", None)
    _active.context = context
    try:
        yield context
    finally:
        _active.context = previous


def position_masks(
    model: PreTrainedModel, query_positions: torch.Tensor, kv_length: int, dtype: torch.dtype, *,
    query_slots: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
) -> torch.Tensor | dict[str, torch.Tensor | None] | None:
    """Additive masks [B, 1, Tq, kv_length] for queries at `query_positions` [B, Tq].

    A query sees the cache rows up to its own; a sliding-window layer also needs the key within the
    window of the query's position. Rows are positions unless `query_slots` [B, Tq] (the queries'
    rows) and `key_positions` [>= kv_length] (each row's position) say otherwise, as under APE, whose
    chunks share positions. Returns a dict keyed by layer type when the model has `layer_types`
    (Gemma 3, Qwen2), else one tensor. A full-attention mask is None when the queries are exactly
    rows 0..kv_length-1 at their own positions, so sdpa can take its causal fast path, or one query on
    row kv_length-1, which sees every row.
    """
    config = text_config(model)
    device = query_positions.device
    kv_idx = torch.arange(kv_length, device=device)
    q = query_positions[:, None, :, None]  # [B, 1, Tq, 1]
    q_row = q if query_slots is None else query_slots.to(device)[:, None, :, None]
    key_pos = kv_idx if key_positions is None else key_positions.to(device)[:kv_length]
    tq = query_positions.shape[-1]
    # no full-attention mask when it would allow everything: the queries are rows 0..kv_length-1 (sdpa's
    # causal path) or one query on the last row (a decode step)
    contiguous = query_slots is None and key_positions is None and tq in (kv_length, 1) and bool(
        (query_positions == kv_idx[kv_length - tq:]).all()
    )
    neg = torch.finfo(dtype).min

    def additive(allowed: torch.Tensor) -> torch.Tensor:
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, neg)

    full = None if contiguous else additive(kv_idx <= q_row)
    types = set(layer_types(model))
    if not hasattr(config, "layer_types") or config.layer_types is None:
        return full
    masks: dict[str, torch.Tensor | None] = {"full_attention": full}
    if "sliding_attention" in types:
        window = config.sliding_window
        masks["sliding_attention"] = additive((kv_idx <= q_row) & (key_pos > q - window))
    return masks
