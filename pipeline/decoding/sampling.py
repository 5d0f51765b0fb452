"""Shared sampling math: per-row seeds, temperature / top-k / top-p sampling, and the
distributions speculative verification draws from (residuals, beam sampling's p_beam).

Every candidate row owns a random stream seeded from (base seed, prompt_id, sample index), so a
candidate's tokens do not depend on which other rows share its batch, which actor ran it, or how the
input was sharded. The HF engine's rows draw from ``RowStreams``: the uniform for a row's token i is
a counter-based hash of (row seed, i), computed for every row at once on the device, with no
per-row generator and no launch per row. The model-side searches (pipeline.decoding.aded, sla, dsbd)
keep one seeded ``torch.Generator`` per search row; ``sample_next`` takes either.
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
    ignore_eos: bool = False
    """Keep generating past EOS to exactly max_new_tokens (benchmarks: fixed lengths)."""


def row_seed(seed: int, prompt_id: str, sample: int) -> int:
    """A 63-bit seed for one candidate, stable across runs, machines and shardings."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{sample}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """The low 32 bits of x * constant for x in [0, 2**32) (int64): the constant is split in 16-bit
    halves so no intermediate product leaves int64's range (an overflowing product's wrap-around is
    not something every device promises)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (C. Wellons' "lowbias32": xor-shift, multiply, xor-shift,
    multiply, xor-shift; every output bit depends on every input bit), on int64 holding 32 bits."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def counter_uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """Uniforms in [0, 1), float32, one per row: a hash of the row's two 32-bit keys (keys [B, 2]
    int64) and its counter (counters [B] int64, below 2**32), a pure function of the three, so a row's
    i-th uniform is the same whatever rows share the call. The top 24 bits of the hash make the
    float, the resolution of ``torch.rand``'s float32."""
    x = _mix32((counters & MASK32) ^ keys[:, 0])
    x = _mix32(x ^ keys[:, 1])
    x = _mix32(x + 0x9E3779B9 & MASK32)  # a third round, offset by the golden ratio: no fixed point at 0
    return (x >> 8).to(torch.float32) * (1.0 / (1 << 24))


class RowStreams:
    """Per-row random streams for the HF engine's rows: row r's j-th draw is
    ``counter_uniforms(keys[r], j)``, where j counts the row's draws so far (one per sampled token,
    so j is the token's index in the response; speculative decoding's acceptance draws one per token
    as well, pipeline.decoding.aded.accept). Keys and counters live on the device; a draw is one batch
    of integer ops for all rows, not one generator launch per row, and reads nothing back."""

    def __init__(self, keys: torch.Tensor, counters: torch.Tensor):
        self.keys = keys  # [B, 2] int64: each row's seed as two 32-bit words
        self.counters = counters  # [B] int64: each row's draws so far

    @classmethod
    def seeded(cls, seeds: list[int], device: str | torch.device = "cpu") -> RowStreams:
        """Streams for rows with these 63-bit seeds (``row_seed``), each at its first draw."""
        keys = torch.tensor([[s & MASK32, (s >> 32) & MASK32] for s in seeds], dtype=torch.long).reshape(-1, 2)
        return cls(keys.to(device), torch.zeros(len(seeds), dtype=torch.long, device=device))

    def __len__(self) -> int:
        return len(self.counters)

    @property
    def device(self) -> torch.device:
        return self.counters.device

    def draw(self) -> torch.Tensor:
        """One uniform per row [B], float32 on the streams' device; every row's counter moves on."""
        u = counter_uniforms(self.keys, self.counters)
        self.counters.add_(1)
        return u

    def ahead(self, count: int) -> torch.Tensor:
        """Every row's next ``count`` uniforms [B, count] in one batch, without moving the counters
        (a row that uses j of them then moves by j: ``advance``). Speculative verification draws
        one per accepted token, so it takes a step's worth at once rather than one hash per token."""
        rows = len(self)
        counters = (self.counters[:, None] + torch.arange(count, device=self.device)).reshape(-1)
        return counter_uniforms(self.keys.repeat_interleave(count, 0), counters).view(rows, count)

    def advance(self, counts: list[int]) -> None:
        """Move row r's counter by ``counts[r]`` (the uniforms of ``ahead`` it used)."""
        self.counters.add_(torch.tensor(counts, dtype=torch.long, device=self.device))

    def select(self, index: torch.Tensor) -> RowStreams:
        """The streams of rows ``index`` [k] (long, on the device), in that order (a copy)."""
        return RowStreams(self.keys[index], self.counters[index])

    def row(self, i: int) -> RowStreams:
        """Row i's stream as a view: its draws move this object's counter for row i too."""
        return RowStreams(self.keys[i:i + 1], self.counters[i:i + 1])

    @staticmethod
    def cat(streams: list[RowStreams]) -> RowStreams:
        """The rows of several streams one after another (a copy: a draw from it moves none of theirs)."""
        if len(streams) == 1:
            return streams[0]
        return RowStreams(torch.cat([s.keys for s in streams]), torch.cat([s.counters for s in streams]))


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order of HF's logits warpers). logits: [B, V] float;
    with none of them to apply, ``logits`` itself comes back (callers never write to it)."""
    if params.temperature != 1.0:  # x / 1.0 is x: skipping saves a pass over [B, V] per step
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


def sample_next(logits: torch.Tensor, params: SamplingParams,
                streams: RowStreams | list[torch.Generator]) -> torch.Tensor:
    """Draw one token per row. logits: [B, V]; streams: the rows' RowStreams, or one seeded
    generator per row. Returns [B] int64.

    Inverse-CDF sampling: one uniform u_i from row i's own stream, then the first token whose
    cumulative probability exceeds u_i * total. One scalar draw per row is ~10x cheaper than a
    per-row torch.multinomial call, and the search is vectorized over the rows.

    On CPU the rows go through in blocks of about 4 MiB of logits: a block's probabilities stay in
    cache between the softmax and the cumulative sum, and no [B, V] temporary is allocated at each
    step (a fresh one of tens of MiB costs page faults every time). Rows are independent, so the
    tokens are those of one pass over the whole batch.
    """
    if params.temperature == 0:
        return logits.argmax(-1)
    if isinstance(streams, RowStreams):
        u = streams.draw()  # [B] in [0, 1)
    else:
        u = torch.stack([torch.rand((), generator=g, device=g.device) for g in streams])  # [B] in [0, 1)
    return sample_with(logits, params, u)


def sample_with(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """``sample_next`` with the rows' uniforms given (u [B] in [0, 1), e.g. from ``RowStreams.ahead``)."""
    if params.temperature == 0:
        return logits.argmax(-1)
    u = u.to(logits.device)
    block = max(1, (1 << 20) // logits.shape[-1]) if logits.device.type == "cpu" else len(logits)
    return torch.cat([_inverse_cdf_sample(logits[i:i + block], u[i:i + block], params)
                      for i in range(0, len(logits), block)])


@torch.no_grad()
def _inverse_cdf_sample(logits: torch.Tensor, u: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """``sample_next`` on rows logits [b, V] with their uniforms u [b] (without autograd: the
    cumulative sum overwrites the softmax's output)."""
    cdf = filter_logits(logits.float(), params).softmax(-1).cumsum_(-1)  # [b, V]
    # right=True: tokens with zero mass own an empty interval and are never drawn.
    tokens = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # [b]
    return tokens.clamp_(max=logits.shape[-1] - 1)


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


def beam_distribution(prefix_logp: torch.Tensor, next_logp: torch.Tensor, sampling: SamplingParams) -> torch.Tensor:
    """p_beam of Eq. 1: prefix_logp [W] (log p of each beam), next_logp [W, V] -> probs [W * V],
    flat index beam * V + token, with the warping T applied to the joint."""
    joint = (prefix_logp.to(next_logp.device)[:, None] + next_logp).reshape(1, -1).float()  # [1, W * V]
    if sampling.temperature == 0:
        return torch.nn.functional.one_hot(joint.argmax(-1), joint.shape[-1])[0].float()
    return filter_logits(joint, sampling).softmax(-1)[0]


def cut_response(tokens: list[int], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """A decoded sequence as a response: at most max_new_tokens, ending before its first EOS."""
    tokens = tokens[:max_new_tokens]
    for i, t in enumerate(tokens):
        if t in eos_ids:
            return tokens[:i]
    return tokens
