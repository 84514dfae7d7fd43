"""The closed-form fit: ridge statistics accumulated in float64, R², source-layer selection, and the
optional residual MLP."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .features import KVText, _with_bias

# ---- fitting ---------------------------------------------------------------------------------


class RidgeAccumulator:
    """Streams XᵀX, XᵀY over batches, each batch's products in float32 (a few hundred rows: short sums),
    summed in float64 (~5x faster than float64 products for a 3,073-feature all-layer map); `solve` gives
    the ridge weights."""

    def __init__(self, in_features: int, out_features: int):
        self.xtx = torch.zeros(in_features, in_features, dtype=torch.float64)
        self.xty = torch.zeros(in_features, out_features, dtype=torch.float64)
        self.rows = 0

    def add(self, x: torch.Tensor, y: torch.Tensor) -> None:
        x, y = x.float(), y.float()
        self.xtx += (x.T @ x).double()
        self.xty += (x.T @ y).double()
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


def select_layers(source: Sequence[KVText], target: Sequence[KVText], aligned: Sequence[torch.Tensor], *,
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
