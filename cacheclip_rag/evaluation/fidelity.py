"""How closely a reuse method follows full attention on the same prompt."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def first_token_kl(full_logits: torch.Tensor, method_logits: torch.Tensor) -> float:
    """KL(full || method) of the first answer token's distributions, in nats. Logits: [V]."""
    if full_logits.shape != method_logits.shape:
        raise ValueError(f"logit shapes differ: {tuple(full_logits.shape)} vs {tuple(method_logits.shape)}")
    log_p = torch.log_softmax(full_logits.double(), dim=-1)
    log_q = torch.log_softmax(method_logits.double(), dim=-1)
    return float((log_p.exp() * (log_p - log_q)).sum().clamp(min=0.0))


def greedy_agreement(full_tokens: Sequence[int], method_tokens: Sequence[int], limit: int = 32) -> float:
    """Fraction of the first `limit` greedy answer tokens of `full` that the method reproduces at the
    same position; a token the method did not produce (it stopped earlier) counts as a mismatch."""
    reference = list(full_tokens)[:limit]
    if not reference:
        return float(len(method_tokens) == 0)
    produced = list(method_tokens)[: len(reference)]
    return sum(a == b for a, b in zip(reference, produced)) / len(reference)


def teacher_forced_fidelity(full_rows: torch.Tensor, method_rows: torch.Tensor, tokens: Sequence[int]) -> tuple[float, float]:
    """Along `full`'s own greedy answer `tokens` (both models forced to read it): the mean per-step
    KL(full || method) in nats and the share of steps where the method's top-1 token is full's token.
    Rows: [T, V] next-token logits, row t predicting tokens[t]."""
    if full_rows.shape != method_rows.shape or full_rows.shape[0] != len(tokens):
        raise ValueError(f"rows {tuple(full_rows.shape)} and {tuple(method_rows.shape)} for {len(tokens)} tokens")
    log_p = torch.log_softmax(full_rows.double(), dim=-1)
    log_q = torch.log_softmax(method_rows.double(), dim=-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).clamp(min=0.0)
    top1 = (method_rows.argmax(-1).cpu() == torch.tensor(list(tokens))).double()
    return float(kl.mean()), float(top1.mean())


def sequence_log_likelihood(rows: torch.Tensor, tokens: Sequence[int]) -> float:
    """log p(tokens) in nats under teacher forcing: rows [T, V], row t predicting tokens[t]."""
    if rows.shape[0] != len(tokens):
        raise ValueError(f"{rows.shape[0]} rows for {len(tokens)} tokens")
    log_q = torch.log_softmax(rows.double(), dim=-1)
    return float(log_q[torch.arange(len(tokens)), torch.tensor(list(tokens))].sum())
