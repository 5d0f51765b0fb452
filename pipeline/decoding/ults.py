"""ULTS: Uncertainty-guided Likelihood-Tree Search (Grosse et al., "Uncertainty-Guided
Optimization on Large Language Model Search Trees"), a Bayesian take on beam search.

Terms (paper sections 3.1-3.5):
- c_i = (c_i1, ..., c_ib): the model's softmax over the b children of node x_i. The prior p(c)
  is a symmetric Dirichlet(alpha) (section 3.1) or the empirical prior Unif(C) over softmax
  vectors C collected by running the model on sample contexts.
- Delta_i: the best likelihood still to come below x_i, Delta = max_j c_ij * Delta_j, Delta = 1
  at a leaf. v_{x_i} = c_{x0 -> x_i} * Delta_i is the node's optimal value.
- Algorithm 1 (``fit_level_beliefs``): bottom-up, sample max_j c_nj * Delta_nj with
  Delta_nj ~ B_{r-1}, and fit one Beta distribution B_r per number r of remaining tokens. The fit
  is the 2-parameter Beta(a, b) on [0, 1], where the authors' code fits 4 parameters
  (a, b, loc, scale). Delta is a product of probabilities, so its support is known to be [0, 1];
  a free loc/scale lets the MLE put support above 1 (a value above any possible likelihood) or
  cut off the lower tail, and the 4-parameter Beta MLE is ill-posed (the likelihood is unbounded
  when a or b < 1 and loc/scale touch the data), which is exactly the regime of peaked LLM
  softmaxes. The model-side search keeps its fits per engine.
- Posterior (section 3.3): the path likelihood c_{x0->x} is observed, so samples of v_x are
  log c_{x0->x} + log Delta with Delta ~ B_{remaining}. Everything is kept in log space.
- Algorithm 2: selection descends from the root to the child that is most often the argmax of
  the children's posterior samples (Eq. 1); with ``acquisition="descendant"`` (the paper's
  default) a child's samples are those of its best descendant (Eq. 2) and the backup copies the
  best child's samples up the path; with ``acquisition="posterior"`` the backup is the
  element-wise max of the children's samples. Expansion takes the top-k children from one model
  call. The search stops when P(c* < v_root) <= epsilon, c* being the best leaf seen so far
  (section 3.4), or when k_max leaves have been reached; at most k_max nodes are expanded per
  level (section 3.5: once a level has k_max expansions, its other open nodes and those above it
  are dropped, as in the authors' code).

Beyond the authors' code (which expands one node per model call and re-runs the whole prefix):
several trees (prompts) advance in lockstep and their selected nodes are expanded in one batched
forward pass; ``expansions_per_step`` > 1 also selects several distinct nodes per tree per step
(each next descent skips the nodes already picked). The expander keeps each expanded node's KV
entries and reuses them along paths (pipeline.engines.adapters.PathCacheExpander), so an expansion feeds one
token, not the prefix. A leaf is a node at the depth cap or one whose token is EOS. The score of
a sequence is its total log-likelihood, or (``score="mean"``) the length-normalised one.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pipeline.errors import ConfigError
from pipeline.decoding.protocols import RowState, SearchOutput
from pipeline.decoding.sampling import SamplingParams

# -- priors and Algorithm 1 ------------------------------------------------------------------


TOP_CHILDREN = 512
"""Algorithm 1 keeps the largest TOP_CHILDREN probabilities of each prior draw: a child whose c_j
is below the best product c_i * Delta_i found among them cannot be the max (c_j * Delta_j <= c_j)."""


@dataclass(frozen=True)
class DirichletPrior:
    """p(c) = Dir(alpha, ..., alpha) over ``branching`` children (section 3.1)."""

    alpha: float
    branching: int

    @property
    def key(self) -> str:
        return f"dirichlet:{self.alpha}:{self.branching}"

    def sample_sorted(self, n: int, rng: np.random.Generator, top: int = TOP_CHILDREN) -> np.ndarray:
        """n draws, each sorted descending and cut to its ``top`` largest entries: [n, min(top, b)].

        c = G / sum(G), G_j ~ Gamma(alpha), drawn in log space as log Gamma(alpha + 1) + log(U) / alpha
        (Marsaglia-Tsang boosting), since for the small alphas LLMs need Gamma(alpha) underflows."""
        out = []
        for start in range(0, n, 64):
            rows = min(64, n - start)
            log_g = (np.log(rng.standard_gamma(self.alpha + 1, size=(rows, self.branching)))
                     + np.log(rng.uniform(size=(rows, self.branching))) / self.alpha)  # [rows, b]
            log_c = log_g - np.logaddexp.reduce(log_g, axis=1, keepdims=True)
            head = -np.sort(-log_c, axis=1)[:, :top] if self.branching > top else -np.sort(-log_c, axis=1)
            out.append(np.exp(head))
        return np.concatenate(out)


@dataclass(frozen=True, eq=False)
class EmpiricalPrior:
    """p(c) = Unif(C), C a set of softmax vectors collected from the model (section 3.1)."""

    probs: np.ndarray
    """[M, V] softmax vectors (rows sum to 1)."""

    @property
    def branching(self) -> int:
        return int(self.probs.shape[1])

    @property
    def key(self) -> str:
        digest = hashlib.sha256(np.ascontiguousarray(self.probs, dtype=np.float32).tobytes()).hexdigest()[:16]
        return f"empirical:{self.probs.shape[0]}:{self.branching}:{digest}"

    def sample_sorted(self, n: int, rng: np.random.Generator, top: int = TOP_CHILDREN) -> np.ndarray:
        rows = self.probs[rng.integers(0, self.probs.shape[0], size=n)].astype(np.float64)
        return -np.sort(-rows, axis=1)[:, :top]


Prior = DirichletPrior | EmpiricalPrior


@dataclass
class LevelBeliefs:
    """Beta(a_r, b_r) beliefs over Delta for a node with r tokens still to come (r = 1..depth)."""

    params: np.ndarray
    """[depth + 1, 2]; row r holds (a_r, b_r); row 0 is unused (Delta = 1 at a leaf)."""
    pool_size: int = 1 << 16
    """log Delta draws are taken from a pool of this many Beta draws per level, made once: numpy's
    Beta sampler is slow for the small shape parameters peaked softmaxes give."""
    _pools: dict = field(default_factory=dict, repr=False)

    @property
    def depth(self) -> int:
        return self.params.shape[0] - 1

    def sample_log_delta(self, remaining: int, size, rng: np.random.Generator) -> np.ndarray:
        """log Delta samples for a node with ``remaining`` tokens to go, of shape ``size``."""
        if remaining <= 0:
            return np.zeros(size, dtype=np.float32)
        level = min(remaining, self.depth)
        pool = self._pools.get(level)
        if pool is None:
            a, b = self.params[level]
            draws = np.random.default_rng(level).beta(a, b, size=self.pool_size)
            pool = self._pools[level] = np.log(np.clip(draws, 1e-300, 1.0)).astype(np.float32)
        return pool[rng.integers(0, self.pool_size, size=size)]


def _max_weighted(c_sorted: np.ndarray, sample_delta, head: int = 64) -> np.ndarray:
    """max_j c_j * Delta_j per row of c_sorted [n, m] (descending), Delta_j iid from
    ``sample_delta(shape)``. Only the ``head`` largest c_j get a draw unless more could change the
    max: c_j * Delta_j <= c_j, so once c_(head+1) is below the row's best product the rest cannot
    win (exact, and since the Deltas are iid, which columns get draws does not change the law)."""
    if c_sorted.shape[1] <= head:
        return (c_sorted * sample_delta(c_sorted.shape)).max(1)
    best = (c_sorted[:, :head] * sample_delta((c_sorted.shape[0], head))).max(1)
    unsure = c_sorted[:, head] > best
    if unsure.any():
        tail = c_sorted[unsure, head:]
        best[unsure] = np.maximum(best[unsure], (tail * sample_delta(tail.shape)).max(1))
    return best


def _fit_beta(x: np.ndarray) -> tuple[float, float]:
    """2-parameter Beta MLE on [0, 1]: Newton's method on the likelihood equations
    psi(a) - psi(a + b) = mean log x, psi(b) - psi(a + b) = mean log(1 - x), from a
    method-of-moments start (the same optimum as scipy.stats.beta.fit(x, floc=0, fscale=1), faster)."""
    from scipy.special import digamma, polygamma

    x = np.clip(x, 1e-12, 1 - 1e-12)
    mean, var = float(x.mean()), float(x.var())
    if var < 1e-14:  # all samples equal: a very tight Beta around the mean
        return mean * 1e8, (1 - mean) * 1e8
    common = max(mean * (1 - mean) / var - 1, 1e-3)
    theta = np.log([mean * common, (1 - mean) * common])  # Newton in log space keeps a, b > 0
    s = np.array([np.log(x).mean(), np.log1p(-x).mean()])
    for _ in range(100):
        a, b = np.exp(theta)
        grad = np.array([digamma(a) - digamma(a + b), digamma(b) - digamma(a + b)]) - s
        t_ab = polygamma(1, a + b)
        jac = np.array([[polygamma(1, a) - t_ab, -t_ab], [-t_ab, polygamma(1, b) - t_ab]]) * np.array([a, b])
        step = np.linalg.solve(jac, grad)
        theta = theta - np.clip(step, -1.0, 1.0)
        if np.abs(step).max() < 1e-10:
            break
    a, b = np.exp(theta)
    return float(a), float(b)


def fit_level_beliefs(prior: Prior, depth: int, num_samples: int = 1000, seed: int = 0) -> LevelBeliefs:
    """Algorithm 1: Beta beliefs B_r over Delta for r = 1..depth remaining tokens, fitted bottom-up.

    r = 1 (a node whose children are leaves): Delta = max_j c_j. r > 1: Delta = max_j c_j * Delta_j,
    Delta_j ~ B_{r-1}. Cost O(branching * num_samples + depth * num_samples * TOP_CHILDREN); the model-side
    search keeps the result per engine (one fit per (prior, depth, num_samples))."""
    rng = np.random.default_rng(seed)
    params = np.ones((depth + 1, 2))
    # One set of N prior draws serves every level (fresh Delta draws each time), as the authors'
    # code does for the empirical prior; drawing a b-dimensional Dirichlet per level costs far more.
    c = prior.sample_sorted(num_samples, rng)  # [N, m] descending
    for r in range(1, depth + 1):
        if r == 1:
            delta = c[:, 0]
        else:
            a, b = params[r - 1]
            delta = _max_weighted(c, lambda shape, a=a, b=b: rng.beta(a, b, size=shape))
        params[r] = _fit_beta(delta)
    return LevelBeliefs(params)


# -- the search tree (Algorithm 2) -----------------------------------------------------------

UNEXPANDED, EXPANDED, LEAF, REACHED, DROPPED = range(5)


class LikelihoodTree:
    """One prompt's ULTS tree. Node 0 is the root (the prompt); node ids grow as nodes are added.

    ``samples[n]`` holds N posterior samples of the score of n's best completion: for an
    unexpanded node, its path log-likelihood plus log Delta draws (section 3.3); for a leaf, its
    score; for an expanded node, the backup of its children (Eq. 2 or the max)."""

    def __init__(self, beliefs: LevelBeliefs, max_depth: int, epsilon: float, k_max: int | None,
                 num_samples: int = 1000, acquisition: str = "descendant", score: str = "total",
                 selection: str = "recursive", min_leaves: int = 1, seed: int = 0):
        self.beliefs, self.max_depth, self.epsilon = beliefs, max_depth, epsilon
        self.k_max = k_max if k_max else math.inf
        self.n, self.acquisition, self.score, self.selection = num_samples, acquisition, score, selection
        self.min_leaves = min_leaves
        self.rng = np.random.default_rng(seed)
        self.parent, self.token, self.depth, self.logp = [-1], [-1], [0], [0.0]
        self.children: list[list[int]] = [[]]
        self.state = [UNEXPANDED]
        self.open = [True]
        self.samples = [self._value(0.0, 0, terminal=False)]
        self.open_samples = [self.samples[0]]
        self.open_counts: dict[int, np.ndarray] = {}
        self.expanded_per_level: dict[int, int] = {}
        self.expansions = 0
        self.reached = 0
        self.best_leaf, self.best_score = -1, -math.inf
        self.leaves: list[int] = []

    # scores --------------------------------------------------------------------------------
    def _value(self, logp: float, depth: int, terminal: bool, log_delta: np.ndarray | None = None) -> np.ndarray:
        """Posterior samples of a node's score (section 3.3): its path log-likelihood plus log Delta draws."""
        if terminal:
            total = np.full(self.n, logp, dtype=np.float32)
            final_len = depth
        else:
            if log_delta is None:
                log_delta = self.beliefs.sample_log_delta(self.max_depth - depth, self.n, self.rng)
            total = logp + log_delta
            final_len = self.max_depth
        return total / max(final_len, 1) if self.score == "mean" else total

    def leaf_score(self, node: int) -> float:
        return self.logp[node] / max(self.depth[node], 1) if self.score == "mean" else self.logp[node]

    # bookkeeping ---------------------------------------------------------------------------
    def _refresh_open(self, node: int) -> None:
        """Recompute 'has something to select below' for ``node`` and its ancestors."""
        while node >= 0:
            state = self.state[node]
            if state == EXPANDED:
                self.open[node] = any(self.open[c] for c in self.children[node])
            else:
                self.open[node] = state in (UNEXPANDED, LEAF)
            node = self.parent[node]

    def _counts(self, node: int, samples: list[np.ndarray]) -> np.ndarray:
        """Eq. 1 for each child of ``node``: how many posterior samples it is the best child in."""
        kids = self.children[node]
        stacked = np.stack([samples[c] for c in kids], axis=1)  # [N, C]
        return np.bincount(stacked.argmax(1), minlength=len(kids))

    def _backup(self, node: int) -> bool:
        """Both sample sets of an expanded node from its children: ``samples`` (the belief over the
        best completion, used for termination) and ``open_samples`` (the same over nodes that can
        still be selected: a reached leaf is known, so selection looks for what may beat it).
        The open counts are kept for the next selection (they only change through a backup)."""
        kids = self.children[node]
        old = (self.samples[node], self.open_samples[node])
        open_counts = self._counts(node, self.open_samples)
        self.open_counts[node] = open_counts
        if self.acquisition == "descendant":  # Eq. 2: the best child's samples, no further max
            same = all(self.samples[c] is self.open_samples[c] for c in kids)
            counts = open_counts if same else self._counts(node, self.samples)
            self.samples[node] = self.samples[kids[int(counts.argmax())]]
            self.open_samples[node] = self.open_samples[kids[int(open_counts.argmax())]]
            return self.samples[node] is not old[0] or self.open_samples[node] is not old[1]
        self.samples[node] = np.max(np.stack([self.samples[c] for c in kids]), axis=0)
        self.open_samples[node] = np.max(np.stack([self.open_samples[c] for c in kids]), axis=0)
        return True

    def _backup_path(self, node: int) -> None:
        """Back up from ``node`` to the root; with Eq. 2 the samples are shared arrays, so the climb
        stops at the first node whose best child did not change (nothing above it can change)."""
        while node >= 0 and self._backup(node):
            node = self.parent[node]

    # Algorithm 2 ----------------------------------------------------------------------------
    @property
    def root_samples(self) -> np.ndarray:
        if self.selection == "boundary":
            frontier = [i for i, s in enumerate(self.state) if s in (UNEXPANDED, LEAF, REACHED)]
            return np.max(np.stack([self.samples[i] for i in frontier]), axis=0)
        return self.samples[0]

    def termination_probability(self) -> float:
        """P̂(c* < v_root) = fraction of root samples above the best leaf score so far."""
        if self.best_leaf < 0:
            return 1.0
        # compare in the samples' float32: a leaf's own samples are its score rounded to float32
        return float(np.mean(np.float32(self.best_score) < self.root_samples))

    def done(self) -> bool:
        if not self.open[0]:
            return True
        if self.reached >= self.k_max:
            return True
        return len(self.leaves) >= self.min_leaves and self.termination_probability() <= self.epsilon

    def select(self, count: int = 1) -> list[int]:
        """Up to ``count`` distinct unexpanded nodes to expand next. A leaf that wins the selection
        is 'reached' (no model call) and counts towards the k_max leaves."""
        picked: list[int] = []
        while len(picked) < count and not self.done():
            node = self._select_one()
            if self.state[node] == LEAF:
                self.state[node] = REACHED
                self.reached += 1
                self.open_samples[node] = np.full(self.n, -np.inf, dtype=np.float32)
                self._refresh_open(node)
                self._backup_path(self.parent[node])
                continue
            picked.append(node)
            self.open[node] = False  # not again in this step
            self._refresh_open(self.parent[node])
        for node in picked:  # expandable again until expand() is called
            self.open[node] = True
            self._refresh_open(node)
        return picked

    def _select_one(self) -> int:
        if self.selection == "boundary":  # the toy setting: Eq. 1 over the whole boundary at once
            frontier = [i for i, s in enumerate(self.state) if s in (UNEXPANDED, LEAF) and self.open[i]]
            stacked = np.stack([self.open_samples[i] for i in frontier])
            return frontier[int(np.bincount(stacked.argmax(0), minlength=len(frontier)).argmax())]
        node = 0
        while self.state[node] == EXPANDED:
            kids = self.children[node]
            counts = np.where([self.open[c] for c in kids], self.open_counts[node], -1)
            node = kids[int(counts.argmax())]
        return node

    def expand(self, node: int, tokens: list[int], logprobs: list[float], eos_ids: set[int] = frozenset()) -> None:
        """Add the top-k children (token ids and their log-probabilities) of ``node``; back up."""
        level = self.depth[node]
        self.expansions += 1
        self.state[node] = EXPANDED
        depth = level + 1
        remaining = self.max_depth - depth
        log_delta = self.beliefs.sample_log_delta(remaining, (len(tokens), self.n), self.rng)  # [k, N]
        for j, (tok, lp) in enumerate(zip(tokens, logprobs)):
            child = len(self.parent)
            logp = self.logp[node] + float(lp)
            terminal = depth >= self.max_depth or tok in eos_ids
            self.parent.append(node)
            self.token.append(int(tok))
            self.depth.append(depth)
            self.logp.append(logp)
            self.children.append([])
            self.children[node].append(child)
            self.state.append(LEAF if terminal else UNEXPANDED)
            self.open.append(True)
            self.samples.append(self._value(logp, depth, terminal, log_delta[j]))
            self.open_samples.append(self.samples[-1])
            if terminal:
                self.leaves.append(child)
                if self.leaf_score(child) > self.best_score:
                    self.best_leaf, self.best_score = child, self.leaf_score(child)
        self.expanded_per_level[level] = self.expanded_per_level.get(level, 0) + 1
        if self.expanded_per_level[level] >= self.k_max:
            self._drop_levels(level)
        else:
            self._backup_path(node)
            self._refresh_open(node)

    def _drop_levels(self, level: int) -> None:
        """k_max nodes expanded at ``level``: unexpanded nodes at that level and above are dropped
        (section 3.5), and the beliefs are rebuilt bottom-up."""
        for i, s in enumerate(self.state):
            if s == UNEXPANDED and self.depth[i] <= level:
                self.state[i] = DROPPED
                self.open[i] = False
                self.samples[i] = self.open_samples[i] = np.full(self.n, -np.inf, dtype=np.float32)
        for i in sorted((i for i in range(len(self.state)) if self.depth[i] <= level), key=lambda i: -self.depth[i]):
            if self.state[i] == EXPANDED:
                self._backup(i)
                self.open[i] = any(self.open[c] for c in self.children[i])

    def path(self, node: int) -> list[int]:
        tokens = []
        while node > 0:
            tokens.append(self.token[node])
            node = self.parent[node]
        return tokens[::-1]

    def ranked_leaves(self) -> list[int]:
        return sorted(self.leaves, key=lambda n: (-self.leaf_score(n), n))


# -- the model, seen as an expander ------------------------------------------------------------


class NodeExpander(Protocol):
    """Gives the children's log-probabilities of tree nodes; pipeline.engines.adapters.PathCacheExpander
    implements it over an HF model with KV reuse along paths, the toy benchmark over a stored tree."""

    def roots(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill: next-token log-probabilities after each prompt, [P, V]. Tree t = prompt t."""

    def expand(self, items: list[tuple[int, int, int, int]]) -> torch.Tensor:
        """items: (tree, node, parent, token) with node's parent already expanded (or the root 0).
        Returns next-token log-probabilities after each node's path, [B, V], in one forward pass."""

    def release(self, tree: int) -> None:
        """Forget a finished tree's cached state."""


def _top_k(logprobs: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
    top = torch.topk(logprobs.float(), min(k, logprobs.shape[-1]), dim=-1)
    return top.indices.tolist(), top.values.tolist()


@dataclass
class SearchResult:
    leaves: list[tuple[list[int], float, float]]
    """(token ids, total log-likelihood, score), best score first; EOS is not in the token ids."""
    expansions: int
    forward_passes: int
    stats: dict = field(default_factory=dict)


def ults_search(expander: NodeExpander, prompts: list[list[int]], beliefs: LevelBeliefs, max_depth: int,
                branching: int, epsilon: float = 0.1, k_max: int | None = 5, eos_ids: set[int] = frozenset(),
                num_samples: int = 1000, acquisition: str = "descendant", score: str = "total",
                selection: str = "recursive", expansions_per_step: int = 1, min_leaves: int = 1,
                seeds: list[int] | None = None) -> list[SearchResult]:
    """Algorithm 2 for several prompts in lockstep: each step every unfinished tree selects up to
    ``expansions_per_step`` nodes and all of them are expanded in one forward pass."""
    seeds = seeds or list(range(len(prompts)))
    trees = [LikelihoodTree(beliefs, max_depth, epsilon, k_max, num_samples, acquisition, score, selection,
                            min_leaves, seed) for seed in seeds]
    forward = [1] * len(trees)
    root_logprobs = expander.roots(prompts)  # the root expansions, one prefill for all prompts
    ids, vals = _top_k(root_logprobs, branching)
    for t, tree in enumerate(trees):
        tree.select(1)
        tree.expand(0, ids[t], vals[t], eos_ids)
    while True:
        items, owners = [], []
        for t, tree in enumerate(trees):
            if tree.done():
                continue
            for node in tree.select(expansions_per_step):
                items.append((t, node, tree.parent[node], tree.token[node]))
                owners.append(t)
        if not items:
            break
        ids, vals = _top_k(expander.expand(items), branching)
        for (t, node, _, _), i, v in zip(items, ids, vals):
            trees[t].expand(node, i, v, eos_ids)
        for t in set(owners):
            forward[t] += 1
    results = []
    for t, tree in enumerate(trees):
        expander.release(t)
        leaves = [(tree.path(n), tree.logp[n], tree.leaf_score(n)) for n in tree.ranked_leaves()]
        leaves = [(p[:-1] if p and p[-1] in eos_ids else p, lp, s) for p, lp, s in leaves]
        results.append(SearchResult(leaves, tree.expansions, forward[t],
                                    {"termination_probability": tree.termination_probability(),
                                     "leaves_reached": tree.reached, "nodes": len(tree.parent)}))
    return results


def beam_search(expander: NodeExpander, prompts: list[list[int]], max_depth: int, beam_width: int,
                eos_ids: set[int] = frozenset(), score: str = "total") -> list[SearchResult]:
    """Standard beam search over the same expander (the baseline). At each level the children of
    the live beams are ranked by total log-likelihood; going down that list, a leaf (EOS or the
    depth cap) is finished and any other child joins the next beam, until beam_width are live."""

    def leaf(tokens, logp, eos):
        length = len(tokens) + int(eos)
        return tokens, logp, (logp / max(length, 1) if score == "mean" else logp)

    finished: list[list[tuple]] = [[] for _ in prompts]
    next_id = [1] * len(prompts)
    expansions, forward = [1] * len(prompts), [1] * len(prompts)

    def advance(t, rows, parents):
        cands = []
        for (node, tokens, logp), row in zip(parents, rows):
            top = torch.topk(row.float(), min(beam_width, row.shape[-1]))
            cands += [(logp + lp, tokens, node, tok) for tok, lp in zip(top.indices.tolist(), top.values.tolist())]
        cands.sort(key=lambda c: -c[0])
        live, leaves = [], 0
        for logp, tokens, parent, tok in cands:
            if len(live) >= beam_width or leaves >= beam_width:
                break
            if tok in eos_ids or len(tokens) + 1 >= max_depth:
                eos = tok in eos_ids
                finished[t].append(leaf(tokens if eos else tokens + [tok], logp, eos))
                leaves += 1
            else:
                live.append((next_id[t], parent, tok, logp, tokens + [tok]))
                next_id[t] += 1
        return live

    root_logprobs = expander.roots(prompts)
    beams = [advance(t, [root_logprobs[t]], [(0, [], 0.0)]) for t in range(len(prompts))]
    while any(beams):
        items = [(t, node, parent, tok) for t, live in enumerate(beams) for node, parent, tok, _, _ in live]
        logprobs = expander.expand(items)
        row, new_beams = 0, []
        for t, live in enumerate(beams):
            if live:
                expansions[t] += len(live)
                forward[t] += 1
            new_beams.append(advance(t, logprobs[row:row + len(live)],
                                     [(node, tokens, logp) for node, _, _, logp, tokens in live]))
            row += len(live)
        beams = new_beams
    results = []
    for t in range(len(prompts)):
        expander.release(t)
        ranked = sorted(finished[t], key=lambda r: -r[2])
        results.append(SearchResult(ranked, expansions[t], forward[t]))
    return results


# -- the build strategy (model-side) -------------------------------------------------------------


@dataclass
class ULTSParams:
    prior: str = "dirichlet"
    """dirichlet: symmetric Dirichlet(alpha) over the vocabulary; empirical: softmax vectors
    collected by greedy decoding from the first prompts the generator sees (section 3.1)."""
    alpha: float = 1e-4
    """Dirichlet concentration (the paper's LLM experiments use 1e-4)."""
    empirical_samples: int = 256
    """Softmax vectors collected for the empirical prior."""
    epsilon: float = 0.1
    """Stop once P(c* < v_root) <= epsilon."""
    k_max: int = 5
    """At most k_max expansions per level, and stop after k_max leaves are reached."""
    branching: int = 5
    """Top-k children per expansion (raised to num_samples so there are enough leaves)."""
    belief_samples: int = 1000
    """N: posterior samples per node and prior samples per level in Algorithm 1."""
    acquisition: str = "descendant"
    """descendant: Eq. 2 (best descendant's samples, the paper's default); posterior: Eq. 1 with max backup."""
    score: str = "total"
    """total log-likelihood, or mean: length-normalised."""
    expansions_per_step: int = 1
    """Nodes each prompt's tree expands per batched forward pass."""

    def __post_init__(self):
        if self.prior not in ("dirichlet", "empirical"):
            raise ConfigError(f"strategy.prior: expected dirichlet or empirical, got {self.prior!r}")
        if self.acquisition not in ("descendant", "posterior"):
            raise ConfigError(f"strategy.acquisition: expected descendant or posterior, got {self.acquisition!r}")
        if self.score not in ("total", "mean"):
            raise ConfigError(f"strategy.score: expected total or mean, got {self.score!r}")
        if not self.alpha > 0:
            raise ConfigError(f"strategy.alpha: must be > 0, got {self.alpha}")
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"strategy.epsilon: must be in (0, 1), got {self.epsilon}")
        for key in ("k_max", "branching", "belief_samples", "expansions_per_step", "empirical_samples"):
            if getattr(self, key) < 1:
                raise ConfigError(f"strategy.{key}: must be >= 1, got {getattr(self, key)}")


def collect_softmax(expander: NodeExpander, prompts: list[list[int]], count: int, depth: int) -> np.ndarray:
    """The empirical prior's C: softmax vectors along greedy completions of ``prompts`` [count, V]."""
    vectors = []
    logprobs = expander.roots(prompts)
    paths = [(t, 0) for t in range(len(prompts))]
    node_id = 1
    for _ in range(depth):
        vectors.append(logprobs.float().exp().cpu().numpy())
        if sum(len(v) for v in vectors) >= count:
            break
        tokens = logprobs.argmax(-1).tolist()
        items = [(t, node_id + i, parent, tok) for i, ((t, parent), tok) in enumerate(zip(paths, tokens))]
        paths = [(t, node_id + i) for i, (t, _) in enumerate(paths)]
        node_id += len(paths)
        logprobs = expander.expand(items)
    for t in range(len(prompts)):
        expander.release(t)
    return np.concatenate(vectors)[:count]


class ULTSHost(Protocol):
    """What ULTS's model-side search needs of the generator's engine
    (pipeline.engines.adapters.HFSearchHost)."""

    eos_ids: set[int]
    vocab_size: int

    def node_expander(self) -> NodeExpander: ...

    def remember(self, key: tuple, make):
        """Per-engine state: ``make()`` the first time ``key`` is asked for, the same object after."""

    def decode(self, token_lists: list[list[int]]) -> list[str]: ...


def make_prior(params: ULTSParams, host: ULTSHost, expander: NodeExpander, prompts: list[list[int]],
               max_depth: int) -> Prior:
    """The Dirichlet prior, or the engine's empirical prior (collected once, from the first prompts
    it is asked for)."""
    if params.prior == "dirichlet":
        return DirichletPrior(params.alpha, host.vocab_size)
    per_prompt = math.ceil(params.empirical_samples / len(prompts))
    return host.remember(("ults-empirical-prior", params.empirical_samples), lambda: EmpiricalPrior(
        collect_softmax(expander, prompts, params.empirical_samples, min(max_depth, per_prompt))))


def search(host: ULTSHost, prompts: list[list[int]], num_samples: int, seeds: list[int],
           sampling: SamplingParams, params: ULTSParams) -> list[SearchOutput]:
    """Model-side ``ults``: one ULTS tree per prompt; the num_samples best leaves (distinct sequences)
    are the candidates. ULTS maximises likelihood, so of the sampling settings only max_new_tokens
    (the depth) and ignore_eos apply; the seeds only drive the posterior samples."""
    expander = host.node_expander()
    eos = set() if sampling.ignore_eos else set(host.eos_ids)
    depth = sampling.max_new_tokens
    prior = make_prior(params, host, expander, prompts, depth)
    beliefs = host.remember(("ults-beliefs", prior.key, depth, params.belief_samples),
                            lambda: fit_level_beliefs(prior, depth, params.belief_samples, seed=0))
    results = ults_search(expander, prompts, beliefs, depth, max(params.branching, num_samples),
                          params.epsilon, params.k_max, eos, params.belief_samples, params.acquisition, params.score,
                          expansions_per_step=params.expansions_per_step, min_leaves=num_samples,
                          seeds=[seeds[i * num_samples] for i in range(len(prompts))])
    outputs = []
    for i, res in enumerate(results):
        leaves = res.leaves[:num_samples]
        if len(leaves) < num_samples:
            raise RuntimeError(f"ults: prompt {i} ended with {len(leaves)} leaves, need {num_samples}")
        texts = host.decode([tokens for tokens, _, _ in leaves])
        rows = [RowState(row=i * num_samples + s, token_ids=tokens, text=text, finished=True)
                for s, ((tokens, _, _), text) in enumerate(zip(leaves, texts))]
        outputs.append(SearchOutput(rows=rows, generated_tokens=res.expansions, stats={
            "expansions": res.expansions, "forward_passes": res.forward_passes,
            "best_loglik": leaves[0][1]}))
    return outputs
