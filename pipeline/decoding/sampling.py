"""Shared sampling math: per-row seeds and temperature / top-k / top-p sampling.

Every candidate row owns a ``torch.Generator`` seeded from (base seed, prompt_id, sample index),
so a candidate's tokens do not depend on which other rows share its batch, which actor ran it,
or how the input was sharded.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    """Length cap of each response in generated tokens."""
    temperature: float = 1.0
    """Softmax temperature; 0 is greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens before sampling (0 disables)."""
    top_p: float = 1.0
    """Keep the smallest set of tokens whose mass reaches top_p (1.0 disables)."""


def row_seed(seed: int, prompt_id: str, sample: int) -> int:
    """A 63-bit seed for one candidate, stable across runs, machines and shardings."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order of HF's logits warpers). logits: [B, V] float."""
    logits = logits / params.temperature
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k, dim=-1).values[:, -1:]  # [B, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # [B, V]
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p; the first token always stays.
        drop_sorted = (cumulative - sorted_logits.softmax(-1)) >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next(logits: torch.Tensor, params: SamplingParams, generators: list[torch.Generator]) -> torch.Tensor:
    """Draw one token per row. logits: [B, V]; generators: one per row. Returns [B] int64."""
    if params.temperature == 0:
        return logits.argmax(-1)
    probs = filter_logits(logits.float(), params).softmax(-1)  # [B, V]
    if probs.device.type != "cpu":
        probs = probs.cpu()
    # One draw per row from that row's own generator: reproducible whatever the batch holds.
    tokens = [torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generators)]
    return torch.cat(tokens).to(logits.device)
