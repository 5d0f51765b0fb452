"""ADED's LLM representative: a tri-gram matrix over token ids (ADED Eq. 1 and appendix Algorithm 2).

    P(w_i | w_{i-2}, w_{i-1}) = C(w_{i-2}, w_{i-1}, w_i) / C(w_{i-2}, w_{i-1})

counted over a corpus of token-id sequences; each context (w_{i-2}, w_{i-1}) keeps its top t
continuations (t = 12 in the paper's appendix F). C(w_{i-2}, w_{i-1}) counts the bigram where a
third token follows it, so each context's probabilities start as a distribution.

Adaptive updates (appendix Algorithm 2, "Adjust3Gram"): for every tri-gram of the last
``max_length`` tokens of the model's verified output, the stored probability is increased by
``increment`` up to ``max_prob`` (increment, cap), and a tri-gram not in the matrix is inserted
with probability ``increment`` (insert). The paper gives no values for increment and maxProb;
the defaults here (0.1, 1.0) are our choice. A context that grows past t continuations drops its
least likely one that was not just updated, so the matrix stays at t per context.

A pure data type: pipeline.engines.trigram saves and loads it (NumPy .npz).
"""

from __future__ import annotations

from collections import Counter


class TrigramMatrix:
    def __init__(self, top_t: int = 12):
        self.top_t = top_t
        self.table: dict[tuple[int, int], dict[int, float]] = {}
        """(w_{i-2}, w_{i-1}) -> {w_i: probability}."""

    @classmethod
    def from_sequences(cls, sequences, top_t: int = 12) -> TrigramMatrix:
        """Eq. 1 over token-id sequences (documents are not joined: no tri-gram spans two)."""
        tri: Counter = Counter()
        for seq in sequences:
            seq = list(seq)
            tri.update(zip(seq, seq[1:], seq[2:]))
        context: Counter = Counter()
        for (a, b, _), n in tri.items():
            context[(a, b)] += n
        matrix = cls(top_t)
        grouped: dict[tuple[int, int], list[tuple[int, float]]] = {}
        for (a, b, c), n in tri.items():
            grouped.setdefault((a, b), []).append((c, n / context[(a, b)]))
        for key, conts in grouped.items():
            conts.sort(key=lambda x: (-x[1], x[0]))
            matrix.table[key] = dict(conts[:top_t])
        return matrix

    def continuations(self, a: int, b: int) -> list[tuple[int, float]]:
        """The stored continuations of context (a, b), most probable first (ties: lower id first)."""
        conts = self.table.get((a, b))
        if not conts:
            return []
        return sorted(conts.items(), key=lambda x: (-x[1], x[0]))

    def probability(self, a: int, b: int, c: int) -> float:
        return self.table.get((a, b), {}).get(c, 0.0)

    def update(self, tokens: list[int], max_length: int, increment: float = 0.1, max_prob: float = 1.0) -> None:
        """Appendix Algorithm 2 over the last ``max_length`` tokens: increment (capped) or insert."""
        sub = list(tokens)[max(0, len(tokens) - max_length):]
        for a, b, c in zip(sub, sub[1:], sub[2:]):
            conts = self.table.setdefault((a, b), {})
            conts[c] = min(conts[c] + increment, max_prob) if c in conts else increment
            if len(conts) > self.top_t:
                drop = min((t for t in conts if t != c), key=lambda t: (conts[t], -t))
                del conts[drop]

    def __len__(self) -> int:
        return sum(len(v) for v in self.table.values())

    def copy(self) -> TrigramMatrix:
        other = TrigramMatrix(self.top_t)
        other.table = {k: dict(v) for k, v in self.table.items()}
        return other
