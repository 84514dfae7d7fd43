"""Cross-model KV cache transfer: a closed-form ridge map from one model's KV cache to another's.

When a deployment switches model (cascade, escalation, an upgraded primary), the new model would
re-prefill everything. Instead (Heo et al. 2026, `../shared/seeds/kv-transfer-post.txt`):

1. Calibrate: both models prefill the same texts; keys are stripped of RoPE (rotated back to
   position 0), so the map is position-free; tokens are aligned 1:1 for a shared tokenizer, else
   through character offsets (each target token takes the source token holding its last character).
2. Select layers: for each target layer, R² of every single source layer (on a selection subset);
   keep the top-k.
3. Fit: per target layer, ridge `W = (XᵀX + λI)⁻¹ XᵀY` from the chosen source layers' features
   (all KV heads concatenated, plus a bias) to the target layer's features. Each output column is
   its own ridge problem, so this equals one fit per target KV head; head counts and head dims may
   differ. XᵀX and XᵀY are accumulated in float64 over calibration texts (no activations held).
   λ is relative: λ · mean(diag XᵀX), so one setting fits every scale.
4. Optionally (`mlp_hidden > 0`), a small residual MLP per target layer learns what the linear map
   leaves (the post reports it recovers pairs where linear fails).
5. Validate: held-out R² per layer for keys and values, saved with the mapper; applying a mapper
   whose mean R² (of keys, or of values) is below the threshold is refused unless forced.
6. Apply: strip the source RoPE at the source positions, align, map, re-apply the target's RoPE at
   the target positions. The first position (BOS, the attention sink) is computed by the target.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from .align import tiled_spans
from .attention import use_cacheclip_attention
from .ingest import SHARED, chunk_key, chunk_unit, kv_layout, new_cache, prefix_cache
from .models import LoadedModel
from .recompute import forward_at
from .rope import rotate_keys
from .store import ChunkEntry

MAPPER_VERSION = 1


@dataclass(frozen=True)
class TransferConfig:
    top_k: int = 3  # source layers per target layer
    ridge: float = 1e-3  # relative: λ = ridge · mean(diag XᵀX)
    # gate: the held-out R² averaged over layers, for keys and for values, must reach this. Measured
    # here: a same-architecture pair that keeps NIAH accuracy had 0.97/0.95, a cross-family pair that
    # lost every needle 0.75/0.71 (bench/RESULTS.md), so 0.85 separates them.
    min_r2: float = 0.85
    select_texts: int = 4  # calibration texts used to rank source layers
    validation_fraction: float = 0.2
    mlp_hidden: int = 0  # > 0: add a residual MLP per target layer on top of the ridge map (for pairs it fails)
    mlp_steps: int = 300
    mlp_rows: int = 8192  # calibration rows kept in memory to train the MLPs

    def __post_init__(self) -> None:
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not self.ridge > 0:
            raise ValueError(f"ridge must be > 0, got {self.ridge}")
        if not 0 < self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")
        if self.mlp_hidden < 0 or self.mlp_steps < 1:
            raise ValueError(f"need mlp_hidden >= 0 and mlp_steps >= 1, got {self.mlp_hidden}, {self.mlp_steps}")


class MapperError(ValueError):
    """A mapper that must not be applied: below its validation gate, or made for another model pair."""


# ---- features --------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVText:
    """One model's cache of a text: keys with RoPE stripped and values, [L, T, KV*D], and char spans."""

    keys: torch.Tensor
    values: torch.Tensor
    offsets: tuple[tuple[int, int], ...]
    text_length: int


def prefill_kv(lm: LoadedModel, ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [L, KV, T, D] of a plain prefill of `ids` at positions 0..T-1."""
    use_cacheclip_attention(lm.model)
    cache = new_cache(lm, len(ids))
    forward_at(lm.model, cache, torch.tensor([list(ids)]), torch.arange(len(ids))[None])
    return cache.rows(0, len(ids))


def flat(kv: torch.Tensor) -> torch.Tensor:
    """[L, KV, T, D] -> [L, T, KV*D] float32."""
    layers, heads, tokens, dim = kv.shape
    return kv.float().permute(0, 2, 1, 3).reshape(layers, tokens, heads * dim)


def unflat(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[L, T, KV*D] -> [L, KV, T, D]."""
    layers, tokens, width = x.shape
    return x.reshape(layers, tokens, heads, width // heads).permute(0, 2, 1, 3).contiguous()


def strip_rope(lm: LoadedModel, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Keys [L, KV, T, D] cached at `positions` [T], rotated back to position 0."""
    return rotate_keys(lm.model, keys, -positions)


def apply_rope(lm: LoadedModel, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Position-free keys [L, KV, T, D] rotated to `positions` [T]."""
    return rotate_keys(lm.model, keys, positions)


def text_kv(lm: LoadedModel, text: str) -> KVText:
    """Prefill BOS (if the model uses one) + text; the text's rows, keys RoPE-stripped."""
    ids, offsets = lm.encode_with_offsets(text)
    prefix = lm.encode_prefix("")
    keys, values = prefill_kv(lm, [*prefix, *ids])
    start = len(prefix)
    positions = torch.arange(start, start + len(ids))
    keys = strip_rope(lm, keys[:, :, start:], positions)
    return KVText(flat(keys), flat(values[:, :, start:]), tuple(offsets), len(text))


def align(source_offsets: Sequence[tuple[int, int]], target_offsets: Sequence[tuple[int, int]],
          text_length: int) -> torch.Tensor:
    """For each target token, the index of the source token holding its last character: [T_target]."""
    if list(source_offsets) == list(target_offsets):
        return torch.arange(len(target_offsets))
    source = tiled_spans(source_offsets, text_length)
    target = tiled_spans(target_offsets, text_length)
    last_char = target[:, 1] - 1
    index = torch.searchsorted(source[:, 0].contiguous(), last_char, right=True) - 1
    return index.clamp(0, len(source_offsets) - 1)


def stacked(features: torch.Tensor, chosen: Sequence[int]) -> torch.Tensor:
    """The chosen layers' features [L, T, F] side by side: [T, len(chosen)*F]."""
    return torch.cat([features[s] for s in chosen], dim=-1)


def _with_bias(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, torch.ones(*x.shape[:-1], 1, dtype=x.dtype)], dim=-1)


# ---- fitting ---------------------------------------------------------------------------------


class RidgeAccumulator:
    """Streams XᵀX, XᵀY (float64) over batches; `solve` gives the ridge weights."""

    def __init__(self, in_features: int, out_features: int):
        self.xtx = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.xty = torch.zeros(in_features, out_features, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.double(), y.double()
        self.xtx += x.T @ x
        self.xty += x.T @ y
        self.rows += x.shape[0]

    def solve(self, ridge: float) -> torch.Tensor:
        if self.rows == 0:
            raise ValueError("no calibration rows accumulated")
        lam = ridge * float(self.xtx.diagonal().mean().clamp(min=1e-12))
        eye = torch.eye(self.xtx.shape[0], dtype=torch.float64)
        return torch.linalg.solve(self.xtx + lam * eye, self.xty).float()


def r_squared(prediction: torch.Tensor, target: torch.Tensor) -> float:
    """1 - SSE/SST over all entries, SST around each column's mean."""
    target = target.double()
    sse = (prediction.double() - target).pow(2).sum()
    sst = (target - target.mean(0)).pow(2).sum()
    return float(1 - sse / sst) if sst > 0 else float(sse == 0)


def fit_all_at_once(x: torch.Tensor, y: torch.Tensor, ridge: float) -> torch.Tensor:
    acc = RidgeAccumulator(x.shape[-1], y.shape[-1])
    acc.add(x, y)
    return acc.solve(ridge)


def select_layers(source: Sequence[KVText], target: Sequence[KVText], aligned: Sequence[torch.Tensor],
                  top_k: int, ridge: float) -> tuple[list[list[int]], torch.Tensor]:
    """Per target layer, the top-k source layers by single-layer R² (keys and values averaged).
    Returns the choice and the R² matrix [L_target, L_source]."""
    src_k = torch.cat([s.keys[:, idx] for s, idx in zip(source, aligned)], dim=1)  # [Ls, N, F]
    src_v = torch.cat([s.values[:, idx] for s, idx in zip(source, aligned)], dim=1)
    tgt_k = torch.cat([t.keys for t in target], dim=1)  # [Lt, N, F]
    tgt_v = torch.cat([t.values for t in target], dim=1)
    scores = torch.zeros(tgt_k.shape[0], src_k.shape[0])
    for s in range(src_k.shape[0]):
        xk, xv = _with_bias(src_k[s]), _with_bias(src_v[s])
        wk = fit_all_at_once(xk, tgt_k.permute(1, 0, 2).reshape(xk.shape[0], -1), ridge)
        wv = fit_all_at_once(xv, tgt_v.permute(1, 0, 2).reshape(xv.shape[0], -1), ridge)
        pk = (xk @ wk).reshape(xk.shape[0], tgt_k.shape[0], -1).permute(1, 0, 2)
        pv = (xv @ wv).reshape(xv.shape[0], tgt_v.shape[0], -1).permute(1, 0, 2)
        for t in range(tgt_k.shape[0]):
            scores[t, s] = (r_squared(pk[t], tgt_k[t]) + r_squared(pv[t], tgt_v[t])) / 2
    k = min(top_k, src_k.shape[0])
    return [sorted(scores[t].topk(k).indices.tolist()) for t in range(tgt_k.shape[0])], scores


def fit_mlp(x: torch.Tensor, y: torch.Tensor, hidden: int, steps: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A residual MLP y ≈ GELU(x W1 + b1) W2 + b2 (Adam, full-batch minibatches of 1024; inputs and
    outputs standardised inside the weights). W2 starts at zero, so an untrained MLP adds nothing."""
    g = torch.Generator().manual_seed(seed)
    mean, std = x.mean(0), x.std(0).clamp(min=1e-6)
    scale = y.std().clamp(min=1e-6)
    w1 = (torch.randn(x.shape[1], hidden, generator=g) / math.sqrt(x.shape[1])).requires_grad_()
    b1 = torch.zeros(hidden, requires_grad=True)
    w2 = torch.zeros(hidden, y.shape[1], requires_grad=True)
    b2 = torch.zeros(y.shape[1], requires_grad=True)
    opt = torch.optim.Adam([w1, b1, w2, b2], lr=3e-3)
    xs, ys = (x - mean) / std, y / scale
    with torch.enable_grad():
        for _ in range(steps):
            rows = torch.randint(0, x.shape[0], (min(1024, x.shape[0]),), generator=g)
            loss = (torch.nn.functional.gelu(xs[rows] @ w1 + b1) @ w2 + b2 - ys[rows]).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():  # fold the standardisation into the weights
        return {"w1": (w1 / std[:, None]).detach(), "b1": (b1 - (mean / std) @ w1).detach(),
                "w2": (w2 * scale).detach(), "b2": (b2 * scale).detach()}


def apply_mlp(mlp: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ mlp["w1"] + mlp["b1"]) @ mlp["w2"] + mlp["b2"]


# ---- the mapper ------------------------------------------------------------------------------


@dataclass
class Mapper:
    """Ridge maps per target layer for keys and values, with their provenance and validation."""

    source_fingerprint: str
    target_fingerprint: str
    source_layout: tuple[int, int, int]  # layers, kv heads, head dim
    target_layout: tuple[int, int, int]
    layers: list[list[int]]  # per target layer: chosen source layers
    key_weights: list[torch.Tensor]  # per target layer: [k*F_src + 1, F_tgt]
    value_weights: list[torch.Tensor]
    ridge: float
    min_r2: float
    validation: dict = field(default_factory=dict)  # {"key_r2": [...], "value_r2": [...], "rows": n}
    key_mlps: list[dict[str, torch.Tensor]] = field(default_factory=list)  # optional residual MLPs per layer
    value_mlps: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @property
    def gate_r2(self) -> float:
        """The lower of the mean held-out R² of keys and of values."""
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        return min(mean(self.validation["key_r2"]), mean(self.validation["value_r2"]))

    def check(self, source: LoadedModel, target: LoadedModel, force: bool = False) -> None:
        """Refuse a mapper made for another pair, or (unless forced) one below its validation gate."""
        if (self.source_fingerprint, self.target_fingerprint) != (source.fingerprint.digest, target.fingerprint.digest):
            raise MapperError(
                f"mapper was fitted for {self.source_fingerprint[:12]}->{self.target_fingerprint[:12]}, not for "
                f"{source.name} ({source.fingerprint.digest[:12]}) -> {target.name} ({target.fingerprint.digest[:12]})"
            )
        if not force and self.gate_r2 < self.min_r2:
            raise MapperError(
                f"mapper {source.name}->{target.name} failed its validation gate: mean held-out R² "
                f"{self.gate_r2:.3f} < {self.min_r2}; pass force=True to apply it anyway"
            )

    def map(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Source features [Ls, T, F_src] (keys RoPE-stripped) -> target features [Lt, T, F_tgt]."""
        return self._apply(keys, self.key_weights, self.key_mlps), self._apply(values, self.value_weights, self.value_mlps)

    def _apply(self, features: torch.Tensor, weights: list[torch.Tensor], mlps: list[dict]) -> torch.Tensor:
        # X @ W with X = [f_s1 | f_s2 | ... | 1] is b + sum_j f_sj @ W_j: no concatenated copy of X
        layers, tokens, width = len(self.layers), features.shape[1], weights[0].shape[1]
        out = torch.empty(layers, tokens, width, dtype=torch.float32)
        for t, (chosen, w) in enumerate(zip(self.layers, weights)):
            src = features.shape[2]
            out[t] = w[-1]
            for j, s in enumerate(chosen):
                out[t].addmm_(features[s], w[j * src : (j + 1) * src])
            if mlps:
                out[t] += apply_mlp(mlps[t], stacked(features, chosen))
        return out

    def save(self, path: str | Path) -> None:
        """`path`.safetensors (weights) and `path`.json (metadata)."""
        path = Path(path)
        tensors = {f"key.{i}": w.contiguous() for i, w in enumerate(self.key_weights)}
        tensors |= {f"value.{i}": w.contiguous() for i, w in enumerate(self.value_weights)}
        for kind, mlps in (("key", self.key_mlps), ("value", self.value_mlps)):
            tensors |= {f"mlp.{kind}.{i}.{n}": t.contiguous() for i, m in enumerate(mlps) for n, t in m.items()}
        save_file(tensors, str(path.with_suffix(".safetensors")))
        meta = {k: v for k, v in asdict(self).items() if k not in ("key_weights", "value_weights", "key_mlps", "value_mlps")}
        meta["mlp"] = bool(self.key_mlps)
        path.with_suffix(".json").write_text(json.dumps({"version": MAPPER_VERSION, **meta}, indent=1))

    @classmethod
    def load(cls, path: str | Path, source: LoadedModel | None = None, target: LoadedModel | None = None,
             force: bool = False) -> Mapper:
        """Load a mapper; with the models given, refuse it for another pair or below its gate."""
        path = Path(path)
        meta = json.loads(path.with_suffix(".json").read_text())
        if meta.pop("version", None) != MAPPER_VERSION:
            raise MapperError(f"{path} is not a version-{MAPPER_VERSION} mapper")
        tensors = load_file(str(path.with_suffix(".safetensors")))
        n = len(meta["layers"])
        has_mlp = meta.pop("mlp", False)
        mlps = {kind: [{w: tensors[f"mlp.{kind}.{i}.{w}"] for w in ("w1", "b1", "w2", "b2")} for i in range(n)]
                if has_mlp else [] for kind in ("key", "value")}
        mapper = cls(
            **{**meta, "source_layout": tuple(meta["source_layout"]), "target_layout": tuple(meta["target_layout"])},
            key_weights=[tensors[f"key.{i}"] for i in range(n)], value_weights=[tensors[f"value.{i}"] for i in range(n)],
            key_mlps=mlps["key"], value_mlps=mlps["value"],
        )
        if source is not None and target is not None:
            mapper.check(source, target, force)
        return mapper


def calibrate(source: LoadedModel, target: LoadedModel, texts: Sequence[str], config: TransferConfig = TransferConfig(),
              progress: bool = True) -> Mapper:
    """Fit and validate a source -> target mapper on `texts` (see the module doc)."""
    if len(texts) < 3:
        raise ValueError("calibration needs at least 3 texts (selection, fitting and validation)")
    n_valid = max(1, math.floor(len(texts) * config.validation_fraction))
    fit_texts, valid_texts = list(texts[:-n_valid]), list(texts[-n_valid:])
    bar = tqdm(total=len(texts), desc=f"calibrate {source.name}->{target.name}", unit="text", disable=not progress)

    def pair(text: str) -> tuple[KVText, KVText, torch.Tensor]:
        s, t = text_kv(source, text), text_kv(target, text)
        bar.update(1)
        return s, t, align(s.offsets, t.offsets, len(text))

    selection = [pair(t) for t in fit_texts[: config.select_texts]]
    layers, _ = select_layers([s for s, _, _ in selection], [t for _, t, _ in selection],
                              [a for _, _, a in selection], config.top_k, config.ridge)
    width_src = kv_layout(source)[1] * kv_layout(source)[2]
    width_tgt = kv_layout(target)[1] * kv_layout(target)[2]
    acc_k = [RidgeAccumulator(len(c) * width_src + 1, width_tgt) for c in layers]
    acc_v = [RidgeAccumulator(len(c) * width_src + 1, width_tgt) for c in layers]

    kept: list[tuple[torch.Tensor, ...]] = []  # rows kept for the MLPs: source k, v, target k, v
    kept_rows = 0

    def accumulate(s: KVText, t: KVText, index: torch.Tensor) -> None:
        nonlocal kept_rows
        if config.mlp_hidden and kept_rows < config.mlp_rows:
            kept.append((s.keys[:, index], s.values[:, index], t.keys, t.values))
            kept_rows += len(index)
        for layer, chosen in enumerate(layers):
            acc_k[layer].add(_with_bias(stacked(s.keys, chosen)[index]), t.keys[layer])
            acc_v[layer].add(_with_bias(stacked(s.values, chosen)[index]), t.values[layer])

    for s, t, index in selection:
        accumulate(s, t, index)
    for text in fit_texts[config.select_texts :]:
        accumulate(*pair(text))
    mapper = Mapper(
        source.fingerprint.digest, target.fingerprint.digest, kv_layout(source), kv_layout(target), layers,
        [a.solve(config.ridge) for a in acc_k], [a.solve(config.ridge) for a in acc_v], config.ridge, config.min_r2,
    )
    if config.mlp_hidden:
        sk, sv, tk, tv = (torch.cat(parts, dim=1) for parts in zip(*kept))
        linear_k, linear_v = mapper.map(sk, sv)
        for layer in range(len(layers)):  # each MLP learns what the ridge map leaves
            mapper.key_mlps.append(fit_mlp(stacked(sk, layers[layer]), tk[layer] - linear_k[layer], config.mlp_hidden,
                                           config.mlp_steps, seed=layer))
            mapper.value_mlps.append(fit_mlp(stacked(sv, layers[layer]), tv[layer] - linear_v[layer], config.mlp_hidden,
                                             config.mlp_steps, seed=1000 + layer))
    held_out = [pair(t) for t in valid_texts]
    bar.close()
    mapper.validation = validate(mapper, held_out)
    return mapper


def validate(mapper: Mapper, pairs: Sequence[tuple[KVText, KVText, torch.Tensor]]) -> dict:
    """Held-out R² per target layer for keys and values."""
    predicted_k, predicted_v, true_k, true_v = [], [], [], []
    for s, t, index in pairs:
        pk, pv = mapper.map(s.keys[:, index], s.values[:, index])
        predicted_k.append(pk), predicted_v.append(pv), true_k.append(t.keys), true_v.append(t.values)
    pk, pv = torch.cat(predicted_k, 1), torch.cat(predicted_v, 1)
    tk, tv = torch.cat(true_k, 1), torch.cat(true_v, 1)
    return {
        "key_r2": [r_squared(pk[i], tk[i]) for i in range(tk.shape[0])],
        "value_r2": [r_squared(pv[i], tv[i]) for i in range(tv.shape[0])],
        "rows": int(tk.shape[1]),
    }


# ---- applying --------------------------------------------------------------------------------


def transfer_kv(mapper: Mapper, source: LoadedModel, target: LoadedModel, keys: torch.Tensor, values: torch.Tensor,
                source_positions: torch.Tensor, source_offsets: Sequence[tuple[int, int]],
                target_offsets: Sequence[tuple[int, int]], target_positions: torch.Tensor, text_length: int,
                force: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """A source cache [Ls, KVs, Ts, Ds] of a text at `source_positions` -> the target's cache
    [Lt, KVt, Tt, Dt] of the same text at `target_positions`."""
    mapper.check(source, target, force)
    index = align(source_offsets, target_offsets, text_length)
    free = strip_rope(source, keys.to(torch.float32), source_positions)
    mk, mv = mapper.map(flat(free)[:, index], flat(values)[:, index])
    heads = mapper.target_layout[1]
    mapped_k = apply_rope(target, unflat(mk, heads), target_positions)
    return mapped_k.to(target.dtype), unflat(mv, heads).to(target.dtype)


# ---- uses: handing a conversation over, migrating a store ---------------------------------------


def same_tokenizer(a: LoadedModel, b: LoadedModel) -> bool:
    if a.tokenizer is b.tokenizer:
        return True
    return len(a.tokenizer) == len(b.tokenizer) and a.tokenizer.get_vocab() == b.tokenizer.get_vocab()


@dataclass
class Conversation:
    """A running conversation in one model: its text, tokens (with character spans) and KV cache.

    `add` appends text (computed by this model), `reply` decodes greedily, `hand_off` moves the whole
    conversation to another model through a mapper, without re-prefill: the target computes only its
    BOS row and the last token's row (for the next-token logits)."""

    lm: LoadedModel
    capacity: int
    text: str = ""
    ids: list[int] = field(default_factory=list)
    offsets: list[tuple[int, int]] = field(default_factory=list)
    cache: object = None
    logits: torch.Tensor | None = None

    @classmethod
    def start(cls, lm: LoadedModel, capacity: int = 4096) -> Conversation:
        use_cacheclip_attention(lm.model)
        conv = cls(lm, capacity)
        conv.cache = new_cache(lm, capacity)
        conv._run(lm.encode_prefix(""), 0)
        return conv

    @property
    def start_len(self) -> int:
        return len(self.lm.encode_prefix(""))

    @property
    def length(self) -> int:
        return self.start_len + len(self.ids)

    def _run(self, ids: Sequence[int], at: int) -> None:
        if not ids:
            return
        if at + len(ids) > self.capacity:
            raise ValueError(f"conversation of {at + len(ids)} tokens exceeds its capacity of {self.capacity}")
        self.logits = forward_at(self.lm.model, self.cache, torch.tensor([list(ids)]),
                                 torch.arange(at, at + len(ids))[None])[0, -1]

    def add(self, text: str) -> None:
        ids, offsets = self.lm.encode_with_offsets(text)
        at, shift = self.length, len(self.text)
        self._run(ids, at)
        self.ids += ids
        self.offsets += [(a + shift, b + shift) for a, b in offsets]
        self.text += text

    def reply(self, max_new_tokens: int = 32, stop: Sequence[str] = ("\n",)) -> str:
        """Greedy continuation, appended to the conversation."""
        produced: list[int] = []
        text = ""
        for _ in range(max_new_tokens):
            assert self.logits is not None
            token = int(self.logits.argmax())
            if token in self.lm.eos_token_ids:
                break
            self._run([token], self.length)
            produced.append(token)
            before, text = text, self.lm.tokenizer.decode(produced)
            self.ids.append(token)
            self.offsets.append((len(self.text) + len(before), len(self.text) + len(text)))
            if any(s in text for s in stop):
                break
        self.text += text
        return text

    def hand_off(self, target: LoadedModel, mapper: Mapper, force: bool = False) -> Conversation:
        """The same conversation in `target`, its cache mapped from this one's."""
        mapper.check(self.lm, target, force)
        nxt = Conversation.start(target, self.capacity)
        if same_tokenizer(self.lm, target):  # keep the very tokens (turn boundaries, generated ones)
            ids, offsets = list(self.ids), list(self.offsets)
        else:
            ids, offsets = target.encode_with_offsets(self.text)
        if not ids:
            return nxt
        keys, values = self.cache.rows(self.start_len, self.length)
        at = nxt.start_len
        mk, mv = transfer_kv(mapper, self.lm, target, keys, values, torch.arange(self.start_len, self.length),
                             self.offsets, offsets, torch.arange(at, at + len(ids)), len(self.text), force=True)
        nxt.cache.place(at, mk, mv)
        nxt.ids, nxt.offsets, nxt.text = list(ids), list(offsets), self.text
        nxt._run(ids[-1:], at + len(ids) - 1)  # the last row, exactly, for the next-token logits
        return nxt


@dataclass(frozen=True)
class MigrationReport:
    moved: int
    already_present: int
    missing: int  # no source entry for the text: computed by the target on first use
    weakest_key_r2: float
    weakest_value_r2: float
    seconds: float


def migrate(store, source: LoadedModel, target: LoadedModel, mapper: Mapper, texts: Sequence[str],
            system_prompt: str, force: bool = False, progress: bool = True) -> MigrationReport:
    """Write the target's shared-prefix chunk entries for `texts`, mapped from the source's stored ones.
    (Direct-variant entries are not migrated; the engine computes them on first use.)"""
    mapper.check(source, target, force)
    started = time.perf_counter()
    src_prefix = prefix_cache(source, store, system_prompt)
    tgt_prefix = prefix_cache(target, store, system_prompt)
    p_src, p_tgt = len(src_prefix.token_ids), len(tgt_prefix.token_ids)
    moved = present = missing = 0
    for text in tqdm(texts, desc=f"migrate {source.name}->{target.name}", unit="chunk", disable=not progress):
        target_key = chunk_key(target, tgt_prefix.token_ids, text, SHARED)
        if store.contains(target_key):
            present += 1
            continue
        entry = store.get(chunk_key(source, src_prefix.token_ids, text, SHARED), source.fingerprint.digest)
        if entry is None:
            missing += 1
            continue
        unit = chunk_unit(target, text)
        ids, offsets = target.encode_with_offsets(unit)
        keys, values = transfer_kv(
            mapper, source, target, entry.keys, entry.values, torch.arange(p_src, p_src + entry.num_tokens),
            entry.offsets, offsets, torch.arange(p_tgt, p_tgt + len(ids)), len(unit), force=True,
        )
        store.put(target_key, target.fingerprint.digest, ChunkEntry(keys, values, tuple(ids), tuple(offsets)))
        moved += 1
    return MigrationReport(moved, present, missing, min(mapper.validation["key_r2"]),
                           min(mapper.validation["value_r2"]), time.perf_counter() - started)
