"""Speculative sampling (Leviathan, Kalman and Matias 2023, Algorithm 1; DSBD section 2.2).

Terms: the draft model proposed tokens x_1..x_gamma, x_i drawn from q_i = q(.|prefix, x_<i); the
target scored the same positions in one forward pass, giving p_1..p_{gamma+1}. Draft token x_i is
accepted with probability min(1, p_i(x_i) / q_i(x_i)); the first rejected one is replaced by a
sample from the residual norm(max(0, p_i - q_i)); when all gamma are accepted a bonus token is
drawn from p_{gamma+1}. Every emitted token is then distributed exactly as under the target.

The functions are pure over tensors; the uniforms come from the caller's seeded generators.
"""

from __future__ import annotations

import torch

from pipeline.decoding.sampling import beam_distribution, cut_response, inverse_cdf, residual_distribution
from pipeline.decoding.tree import TokenTree


def speculative_sampling(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_tokens: torch.Tensor,
                         accept_u: torch.Tensor, resample_u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al.'s acceptance rule, batched.

    target_probs [B, gamma + 1, V]: p at each draft position plus the bonus position.
    draft_probs [B, gamma, V]: q that each draft token was drawn from.
    draft_tokens [B, gamma]; accept_u [B, gamma] and resample_u [B]: uniforms in [0, 1).
    Returns (num_accepted [B] in 0..gamma, next_token [B]): the row emits
    draft_tokens[:num_accepted] followed by next_token.
    """
    batch, gamma = draft_tokens.shape
    p_tok = target_probs[:, :gamma].gather(-1, draft_tokens[..., None])[..., 0]  # [B, gamma]
    q_tok = draft_probs.gather(-1, draft_tokens[..., None])[..., 0]  # [B, gamma]
    accepted = accept_u * q_tok < p_tok  # u < p/q without dividing by a zero q
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # [B] leading accepted tokens
    rows = torch.arange(batch, device=draft_tokens.device)
    p_next = target_probs[rows, num_accepted]  # [B, V]
    q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, num_accepted]  # [B, V]
    # All accepted: q_next is 0, so the residual is p_{gamma+1} itself (the bonus token).
    next_token = inverse_cdf(residual_distribution(p_next, q_next), resample_u)
    return num_accepted, next_token


def speculative_decode(target, drafter, prompt: list[int], num_draft_tokens: int, sampling, seed: int,
                       eos_ids: set[int] = frozenset(), stats=None) -> list[int]:
    """Speculative decoding of one sequence: the drafter proposes ``num_draft_tokens`` (gamma)
    tokens (a Drafter with one context and width 1), the target scores them in one pass (a
    pipeline.decoding.dsbd.ForestTarget, the chain as a tree), ``speculative_sampling`` keeps a
    prefix and adds one token, and the cache is cut to the accepted prefix. ``stats`` is a
    pipeline.decoding.dsbd.DecodeStats."""
    g = torch.Generator().manual_seed(seed)
    target.open(prompt)
    tokens: list[int] = []
    pending = prompt[-1]
    while len(tokens) < sampling.max_new_tokens:
        gamma = min(num_draft_tokens, sampling.max_new_tokens - len(tokens))
        layers = drafter.draft([prompt + tokens], [0.0], 1, gamma, sampling,
                               int(torch.randint(0, 2**62, (), generator=g)))
        drafts = [layer.tokens[0] for layer in layers]
        logp = target.verify([TokenTree.chain([pending] + drafts)])[0]  # [gamma + 1, V]
        device = logp.device
        q = torch.stack([layer.q_beam.float() for layer in layers]).to(device)  # [gamma, V] (one parent per layer)
        p = torch.stack([beam_distribution(torch.zeros(1), row[None], sampling) for row in logp])  # warped
        n, nxt = speculative_sampling(p[None], q[None], torch.tensor([drafts], device=device),
                                      torch.rand((1, gamma), generator=g).to(device), torch.rand(1, generator=g).to(device))
        n = int(n)
        target.commit([(0, list(range(n + 1)))])  # the old pending token and the accepted drafts
        tokens += drafts[:n] + [int(nxt)]
        pending = tokens[-1]
        if stats is not None:
            stats.target_forwards += 1
            stats.iterations += 1
            stats.drafted += gamma
            stats.steps += n + 1
            stats.beam_steps += n + 1
    return cut_response(tokens, sampling.max_new_tokens, eos_ids)
