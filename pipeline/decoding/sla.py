"""Streaming Looking Ahead (SLA), Algorithm 2 of "Streaming Looking Ahead with Token-level
Self-reward" (Zhang et al., 2025), on a Reward Transformer that scores its own tokens.

Terms (section 4, 4.1):
- A node is an action of up to n tokens (``step_size``); its children are k (``search_width``)
  continuations sampled from it, each for n tokens unless EOS or the length cap comes first.
- The tree below the committed root s_0 is kept d (``search_depth``) levels deep: k^d leaves.
  Each leaf's value is R', the Reward Transformer's output at the leaf's last token (Alg. 2 line 4).
- Q backs up as the max over children (line 5): Q(s_0, a) = the best leaf below action a.
- a* = argmax_a Q(s_0, a) (line 7; ties go to the first child) is committed, streamed out, and
  its explored subtree is kept: its k^{d-1} leaves become the new tree's depth d-1, so the next
  step expands only them, all k^d new leaves at once as one batch, n tokens each. Every other
  branch is dropped from the batch and the KV cache.

The first step fills the tree level by level (d expansions); every later step costs one
expansion of n batched forward passes, which is the "streaming" reuse of the paper. Children
are sampled with the build's sampling parameters (temperature, top-k, top-p); with temperature 0
all k children coincide and SLA is greedy decoding. Candidates: each of a prompt's
``num_samples`` candidates is an independent search with its own seed (the row seed of that
sample), so the candidates differ through their sampled children; they share the prompt's
prefill. All searches of all prompts in a call decode together in one batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from pipeline.errors import ConfigError
from pipeline.decoding.domain import RowState, SearchOutput
from pipeline.decoding.sampling import SamplingParams, sample_next


@dataclass
class SLAParams:
    search_depth: int = 2
    """d: levels of lookahead below the committed root (the paper's default 2)."""
    search_width: int = 2
    """k: children sampled per expanded node (default 2)."""
    step_size: int = 10
    """n: tokens per action (node), the granularity of commits (default 10)."""

    def __post_init__(self):
        for key in ("search_depth", "search_width", "step_size"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"strategy.{key}: must be a positive integer, got {value!r}")


class TreeRows(Protocol):
    logits: torch.Tensor
    """[B, V] next-token logits of each row."""
    rewards: torch.Tensor
    """[B] R' at each row's last fed token."""


class SelfRewardingLM(Protocol):
    """A policy that scores its own prefixes in the same forward pass (a Reward Transformer)."""

    eos_ids: set[int]

    def prefill(self, prompts: list[list[int]]) -> TreeRows:
        """One row per prompt, prompt fed."""

    def feed(self, rows: TreeRows, tokens: torch.Tensor) -> None:
        """Append one token [B] to every row; updates logits and rewards."""

    def select(self, rows: TreeRows, index: list[int]) -> None:
        """Rows become rows[index] (drop, reorder, repeat)."""

    def decode(self, token_lists: list[list[int]]) -> list[str]:
        """Text of each token list."""


@dataclass
class _Leaf:
    search: int
    path: tuple[int, ...]
    """Child index at each level below the committed root."""
    tokens: list[int]
    """The whole response along this path (EOS excluded)."""
    reward: float
    finished: bool = False


@dataclass
class _Search:
    committed: int = 0
    """Tokens committed (streamed out) so far."""
    result: list[int] | None = None
    generated_tokens: int = 0
    steps: int = 0


@dataclass
class _Tree:
    model: SelfRewardingLM
    rows: TreeRows
    live: list[_Leaf]
    """Leaves still decoding, aligned with the model's batch rows."""
    done: list[_Leaf]
    """Leaves that ended (EOS or length cap): no cache row."""
    generators: list[torch.Generator]
    searches: list[_Search]
    sampling: SamplingParams
    params: SLAParams
    stats: dict = field(default_factory=lambda: {"expansions": 0, "sla_steps": 0})

    def expand(self) -> None:
        """Give every live leaf k children and decode them n tokens, all in one batch."""
        k, n = self.params.search_width, self.params.step_size
        self.model.select(self.rows, [i for i in range(len(self.live)) for _ in range(k)])
        self.live = [_Leaf(leaf.search, leaf.path + (c,), list(leaf.tokens), leaf.reward)
                     for leaf in self.live for c in range(k)]
        self.stats["expansions"] += 1
        cap = self.sampling.max_new_tokens
        for _ in range(n):
            if not self.live:
                return
            tokens = sample_next(self.rows.logits, self.sampling, [self.generators[l.search] for l in self.live])
            keep = []
            for i, (leaf, token) in enumerate(zip(self.live, tokens.tolist())):
                if token in self.model.eos_ids and not self.sampling.ignore_eos:
                    leaf.finished = True  # its reward stays R' at its last real token
                    self.done.append(leaf)
                else:
                    leaf.tokens.append(token)
                    self.searches[leaf.search].generated_tokens += 1
                    keep.append(i)
            if len(keep) != len(self.live):
                self.model.select(self.rows, keep)
                self.live = [self.live[i] for i in keep]
                tokens = tokens[keep]
            if not self.live:
                return
            self.model.feed(self.rows, tokens)
            for leaf, reward in zip(self.live, self.rows.rewards.tolist()):
                leaf.reward = reward
            capped = {i for i, leaf in enumerate(self.live) if len(leaf.tokens) >= cap}
            if capped:
                for i in sorted(capped):
                    self.live[i].finished = True
                    self.done.append(self.live[i])
                kept = [i for i in range(len(self.live)) if i not in capped]
                self.model.select(self.rows, kept)
                self.live = [self.live[i] for i in kept]

    def commit(self) -> None:
        """Alg. 2 lines 5-7 for every open search: back up max Q, commit a*, keep its subtree."""
        n, cap = self.params.step_size, self.sampling.max_new_tokens
        best: dict[int, tuple[float, int]] = {}
        for leaf in self.live + self.done:
            if not leaf.path:
                continue
            q, a = best.get(leaf.search, (-math.inf, math.inf))
            reward = leaf.reward if math.isfinite(leaf.reward) else -math.inf
            # Q(s_0, a) = max over the leaves below a; argmax over a, first child on ties.
            if reward > q or (reward == q and leaf.path[0] < a):
                best[leaf.search] = (reward, leaf.path[0])
        chosen = {s: a for s, (_, a) in best.items()}
        lost = [s for s, search in enumerate(self.searches) if search.result is None and s not in chosen]
        if lost:  # every open search keeps the subtree of its last commit: this is a bug, never a user error
            raise RuntimeError(f"SLA: open searches {lost[:5]} have no leaves left")
        subtree = [l for l in self.live + self.done if l.path and chosen.get(l.search) == l.path[0]]
        for s, search in enumerate(self.searches):
            if s not in chosen:
                continue
            below = [l for l in subtree if l.search == s]
            node = min(n, min(len(l.tokens) for l in below) - search.committed)
            search.committed += node
            search.steps += 1
            if node < n or search.committed >= cap:  # a* ended inside its n tokens: the response is done
                search.result = below[0].tokens[:search.committed]
        keep = [i for i, l in enumerate(self.live)
                if chosen.get(l.search) == (l.path[0] if l.path else None) and self.searches[l.search].result is None]
        self.model.select(self.rows, keep)
        self.live = [_Leaf(l.search, l.path[1:], l.tokens, l.reward) for l in (self.live[i] for i in keep)]
        self.done = [_Leaf(l.search, l.path[1:], l.tokens, l.reward, True) for l in self.done
                     if l.path and chosen.get(l.search) == l.path[0] and self.searches[l.search].result is None]
        self.stats["sla_steps"] += 1


def streaming_looking_ahead(model: SelfRewardingLM, prompts: list[list[int]], num_samples: int, seeds: list[int],
                            sampling: SamplingParams, params: SLAParams) -> list[SearchOutput]:
    """``num_samples`` independent searches per prompt (seeds: one per search, prompt-major);
    returns one SearchOutput per prompt with its committed responses as rows."""
    if len(seeds) != len(prompts) * num_samples:
        raise ValueError(f"need {len(prompts) * num_samples} seeds, got {len(seeds)}")
    rows = model.prefill(prompts)
    model.select(rows, [p for p in range(len(prompts)) for _ in range(num_samples)])
    generators = []
    for s in seeds:
        g = torch.Generator(device=rows.logits.device)
        g.manual_seed(s)
        generators.append(g)
    start = rows.rewards.tolist()
    tree = _Tree(model, rows, [_Leaf(s, (), [], start[s]) for s in range(len(seeds))], [], generators,
                 [_Search() for _ in seeds], sampling, params)
    for _ in range(params.search_depth):  # fill the lookahead tree: d levels below the root
        tree.expand()
    while any(s.result is None for s in tree.searches):
        tree.commit()
        if tree.live:
            tree.expand()
    texts = model.decode([s.result for s in tree.searches])
    outputs = []
    for p in range(len(prompts)):
        ids = range(p * num_samples, (p + 1) * num_samples)
        outputs.append(SearchOutput(
            rows=[RowState(row=i, token_ids=tree.searches[i].result, text=texts[i], finished=True) for i in ids],
            generated_tokens=sum(tree.searches[i].generated_tokens for i in ids),
            stats={"sla_commits": sum(tree.searches[i].steps for i in ids)},
        ))
    return outputs


class SLAHost(Protocol):
    def self_rewarding_lm(self) -> SelfRewardingLM:
        """The generator as a SelfRewardingLM; ValueError when it has no trained reward channel."""


def search(host: SLAHost, prompts: list[list[int]], num_samples: int, seeds: list[int], sampling: SamplingParams,
           params: SLAParams) -> list[SearchOutput]:
    """Model-side ``sla``: the generator's engine serves SelfRewardingLM
    (pipeline.engines.adapters.SelfRewardDecoder)."""
    return streaming_looking_ahead(host.self_rewarding_lm(), prompts, num_samples, seeds, sampling, params)
