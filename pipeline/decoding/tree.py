"""A token tree: the candidate continuations of one row that tree attention verifies in one
forward pass (SpecInfer's topology-aware mask; see pipeline.engines.tree). Shared by speculative
decoding, DSBD's draft forests and ADED's merged drafts. A pure data type."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenTree:
    """Candidate nodes of one row: ``tokens[i]`` continues ``parents[i]`` (-1 = the committed context)."""

    tokens: list[int]
    parents: list[int]

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        for i, p in enumerate(self.parents):
            if not -1 <= p < i:
                raise ValueError(f"tree node {i}: parent {p} must be -1 or an earlier node")

    @classmethod
    def chain(cls, tokens: list[int]) -> TokenTree:
        """A single branch: each token continues the previous one."""
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def depths(self) -> list[int]:
        """Depth of each node; root-level nodes have depth 0."""
        out: list[int] = []
        for p in self.parents:
            out.append(0 if p < 0 else out[p] + 1)
        return out

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root level down to ``node`` (inclusive); [] for node -1."""
        path = []
        while node >= 0:
            path.append(node)
            node = self.parents[node]
        return path[::-1]
