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


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim. Where p <= q everywhere (no residual mass: the
    rejection that would lead here has probability 0) it returns p, so the result is always a
    distribution."""
    r = (p - q).clamp_(min=0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp(min=torch.finfo(r.dtype).tiny), p)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index per row of ``probs`` [..., V] from uniforms ``u`` [...] in [0, 1)."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None].to(cdf.dtype), right=True)[..., 0]
    return idx.clamp_(max=probs.shape[-1] - 1)


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
