"""Speculative sampling (Leviathan, Kalman and Matias 2023, Algorithm 1; DSBD section 2.2).

Terms: the draft model proposed tokens x_1..x_gamma, x_i drawn from q_i = q(.|prefix, x_<i); the
target scored the same positions in one forward pass, giving p_1..p_{gamma+1}. Draft token x_i is
accepted with probability min(1, p_i(x_i) / q_i(x_i)); the first rejected one is replaced by a
sample from the residual norm(max(0, p_i - q_i)); when all gamma are accepted a bonus token is
drawn from p_{gamma+1}. Every emitted token is then distributed exactly as under the target.

The functions are pure over tensors; the uniforms come from the caller's seeded generators.

``SpeculativeDecoding`` (``models.speculative``) is the engines' speculative decoding of the rows a
build keeps decoding (the candidates that survive speculative rejection's last decision token, or
Best-of-N's rows): vLLM's ``ngram`` method on the vLLM backend, and on the HF engine the same
proposer (``prompt_lookup``) with ADED's exact sampling acceptance (pipeline.decoding.aded.accept).
Both keep each row's output distribution that of plain sampling, so rejection decisions and the
Best-of-N choice mean what they meant without it; only the cost changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.errors import ConfigError

from pipeline.decoding.sampling import beam_distribution, cut_response, inverse_cdf, residual_distribution
from pipeline.decoding.tree import TokenTree


@dataclass
class SpeculativeDecoding:
    """``models.speculative``: speculative decoding inside the generator engine (both backends)."""

    num_speculative_tokens: int = 0
    """k: draft tokens proposed per row and step; 0 turns speculative decoding off."""
    method: str = "ngram"
    """The proposer: ngram (prompt lookup, vLLM's ``ngram`` method; no draft model needed)."""
    prompt_lookup_min: int = 2
    """Shortest suffix n-gram of a row's context that may match earlier in it."""
    prompt_lookup_max: int = 4
    """Longest suffix n-gram tried (the longest match wins)."""
    max_rows: int = 16
    """Speculate only while the decoding batch has at most this many live rows: verifying k + 1
    tokens per row pays where a step's cost is reading the weights (few rows), not where it is
    compute (many rows, as before speculative rejection's first decision token). vLLM: its
    ``num_speculative_tokens_per_batch_size`` schedule; HF engine: the rows of the session being
    finished (an extend to the length cap)."""

    def __post_init__(self):
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "max_rows"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "num_speculative_tokens" else 1):
                raise ConfigError(f"models.speculative.{key}: expected a {'non-negative' if key == 'num_speculative_tokens' else 'positive'} int, got {value!r}")
        if self.method != "ngram":
            raise ConfigError(f"models.speculative.method: expected ngram, got {self.method!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"models.speculative.prompt_lookup_min: {self.prompt_lookup_min} is more than "
                              f"prompt_lookup_max {self.prompt_lookup_max}")

    @property
    def enabled(self) -> bool:
        return self.num_speculative_tokens > 0

    def vllm_config(self, max_num_seqs: int = 1024) -> dict:
        """vLLM's ``speculative_config``: its ngram proposer, k tokens while at most ``max_rows``
        requests decode, none above (``max_num_seqs``: the engine's most requests in a step)."""
        schedule = [(1, self.max_rows, self.num_speculative_tokens)]
        if self.max_rows < max_num_seqs:
            schedule.append((self.max_rows + 1, max_num_seqs, 0))
        return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max,
                "num_speculative_tokens_per_batch_size": schedule}


def prompt_lookup(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt-lookup drafting (vLLM's ``ngram`` proposer, v1/spec_decode/ngram_proposer.py): the
    longest suffix of ``context`` of min_n..max_n tokens that also occurs earlier in it (its
    earliest occurrence, as vLLM takes), and up to ``k`` tokens that followed that occurrence;
    no match (or k <= 0): none."""
    if k <= 0 or len(context) <= min_n:
        return []
    last = context[-1]
    ends = [j for j in range(len(context) - 1) if context[j] == last]  # earlier places the suffix may end
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[-n:]
        for end in ends:
            start = end - n + 1
            if start >= 0 and context[start:end + 1] == suffix:
                return context[end + 1:end + 1 + k]
    return []


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
        if any(t in eos_ids for t in tokens[len(tokens) - n - 1:]):
            break  # the response ended: nothing after its EOS is kept, so nothing more is decoded
    return cut_response(tokens, sampling.max_new_tokens, eos_ids)
