"""The mapper: its configuration and gate, calibration on a text set, held-out validation, saving and
loading, and applying it to a source cache."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm.auto import tqdm

from ..stages.load.ingest import kv_layout
from ..models.loading import LoadedModel
from .features import KVText, _with_bias, align, apply_rope, flat, stacked, strip_rope, text_kv, unflat
from .fit import RidgeAccumulator, apply_mlp, fit_mlp, r_squared, select_layers

MAPPER_VERSION = 1


@dataclass(frozen=True)
class TransferConfig:
    top_k: int = 3  # source layers per target layer
    ridge: float = 1e-3  # relative: λ = ridge · mean(diag XᵀX)
    # gate: the held-out R² averaged over layers, for keys and for values, must reach this. Measured
    # here (bench/RESULTS.md): a same-architecture pair that kept NIAH accuracy had 0.97/0.95; SmolLM2 ->
    # Gemma 3, which lost every needle, 0.75/0.71; the real Qwen2.5-Coder pair on 200 texts 0.79/0.70
    # (0.5B -> 1.5B, 0 of 12 needles) and 0.90/0.85 (1.5B -> 0.5B, 3 of 12 against re-prefill's 12).
    # 0.85 let the last through, so the gate sits between 0.85 and 0.95.
    min_r2: float = 0.90
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

    @property
    def passes_gate(self) -> bool:
        return self.gate_r2 >= self.min_r2

    def check(self, source: LoadedModel, target: LoadedModel, force: bool = False) -> None:
        """Refuse a mapper made for another pair, or (unless forced) one below its validation gate."""
        if (self.source_fingerprint, self.target_fingerprint) != (source.fingerprint.digest, target.fingerprint.digest):
            raise MapperError(
                f"mapper was fitted for {self.source_fingerprint[:12]}->{self.target_fingerprint[:12]}, not for "
                f"{source.name} ({source.fingerprint.digest[:12]}) -> {target.name} ({target.fingerprint.digest[:12]})"
            )
        if not force and not self.passes_gate:
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
                              [a for _, _, a in selection], top_k=config.top_k, ridge=config.ridge)
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
        source_fingerprint=source.fingerprint.digest, target_fingerprint=target.fingerprint.digest,
        source_layout=kv_layout(source), target_layout=kv_layout(target), layers=layers,
        key_weights=[a.solve(config.ridge) for a in acc_k], value_weights=[a.solve(config.ridge) for a in acc_v],
        ridge=config.ridge, min_r2=config.min_r2,
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


def transfer_kv(mapper: Mapper, source: LoadedModel, target: LoadedModel, *, keys: torch.Tensor, values: torch.Tensor,
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
