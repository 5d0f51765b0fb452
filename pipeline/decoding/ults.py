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
  softmaxes.
- Posterior (section 3.3): the path likelihood c_{x0->x} is observed, so samples of v_x are
  log c_{x0->x} + log Delta with Delta ~ B_{remaining}. Everything is kept in log space.
- Algorithm 2: selection descends from the root to the child that is most often the argmax of
  the children's posterior samples (Eq. 1); with ``acquisition="descendant"`` (the paper's
  default) a child's samples are those of its best descendant (Eq. 2) and the backup copies the
  best child's samples up the path; with ``acquisition="posterior"`` the backup is the
  element-wise max of the children's samples. Expansion takes the top-k children from one model
  call. At most k_max nodes are expanded per level (section 3.5: once a level has k_max
  expansions, its other open nodes and those above it are dropped, as in the authors' code), which
  also bounds a search to 1 + k_max * depth expansions.

Candidates: the model-side search wants the n = num_samples most likely distinct responses, not
only the best one, so two things go beyond the paper, which returns one sequence:
- Distinct responses. Every EOS token ends the response at its parent, so of a node's EOS
  children only the most likely one becomes a leaf (with several EOS ids, [.., a, eos1] and
  [.., a, eos2] are one response, and its likelihood is that of its more likely ending); the
  expansion takes the top-k children counting all EOS tokens as one, so leaves have distinct
  token ids once EOS is stripped. Two token sequences can still spell one text (a word split
  differently, byte pieces), so the tree keys each leaf's response (``response_key``: the token
  ids, or the decoded text in the model-side search) and keeps the best-scoring leaf of each
  response as its candidate; the other leaves are spares.
- Termination for n candidates. Section 3.4 stops once P(c* < v_x0*) <= epsilon, c* being the
  best leaf seen so far; here c* is replaced by c_(n), the n-th best candidate, and v_x0* by the
  belief over the best value still selectable (the open samples, which leave out the leaves
  already reached), so the search stops once nothing unexplored is likely to beat the n-th
  candidate. For n = 1 with the max backup this is the paper's test exactly (a reached leaf is at
  most c*, so it cannot lift a sample above c*). The k_max-leaves stop of section 3.5 applies too,
  and both wait until the tree holds n candidates. A tree stops short of n only when nothing is
  left to select: with token-id responses that needs a vocabulary with fewer than n distinct
  continuations (the deepest expanded node's children are all leaves then, and there are
  branching >= n of them otherwise); with text responses, spares fill the candidates up.

Beyond the authors' code (which expands one node per model call and re-runs the whole prefix):
several trees (prompts) advance in lockstep and their selected nodes are expanded in one batched
forward pass; ``expansions_per_step`` > 1 also selects several distinct nodes per tree per step
(each next descent skips the nodes already picked). The expander keeps each expanded node's KV
entries and reuses them along paths (pipeline.engines.adapters.PathCacheExpander), so an expansion feeds one
token, not the prefix. A leaf is a node at the depth cap or one whose token is EOS. The score of
a sequence is its total log-likelihood, or (``score="mean"``) the length-normalised one.

Reproducible candidates: what a prompt gets is a function of the prompt (and the run's seed)
alone. The Dirichlet prior's beliefs depend only on the configuration, so the engine keeps one
fit; the empirical prior is collected and fitted per prompt from the prompt's own rollouts
(``collect_softmax``), with that prompt's seed, and nothing of it is kept between batches.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field, replace
from typing import Callable, Hashable, Protocol, Sequence

import numpy as np
import torch

from pipeline.errors import ConfigError
from pipeline.decoding.domain import RowState, SearchOutput
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
    """[M, m] softmax vectors (m = V, rows sum to 1), or only the m largest entries of each, sorted
    descending (what ``collect_softmax`` keeps): Algorithm 1 reads no more than the TOP_CHILDREN
    largest entries of a draw, and does not care where in the vocabulary they are."""

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


def fit_level_beliefs(prior: Prior, depth: int, num_samples: int = 1000,
                      seed: int | Sequence[int] = 0) -> LevelBeliefs:
    """Algorithm 1: Beta beliefs B_r over Delta for r = 1..depth remaining tokens, fitted bottom-up.

    r = 1 (a node whose children are leaves): Delta = max_j c_j. r > 1: Delta = max_j c_j * Delta_j,
    Delta_j ~ B_{r-1}. Cost O(branching * num_samples + depth * num_samples * TOP_CHILDREN) (in
    practice about depth * 64 * num_samples Beta draws): the model-side search keeps one Dirichlet fit
    per engine and fits an empirical prior once per prompt (``level_beliefs``). A pure function of its
    arguments (``seed`` seeds numpy's generator)."""
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


# -- the method's parameters -------------------------------------------------------------------


@dataclass
class ULTSParams:
    prior: str = "dirichlet"
    """dirichlet: symmetric Dirichlet(alpha) over the vocabulary; empirical: Unif(C), C the softmax
    vectors along rollouts of each prompt itself (section 3.1; ``collect_softmax``), fitted per prompt."""
    alpha: float = 1e-4
    """Dirichlet concentration (the paper's LLM experiments use 1e-4)."""
    empirical_samples: int = 256
    """|C|: softmax vectors collected per prompt for the empirical prior."""
    epsilon: float = 0.1
    """Stop once P(c_(n) < v) <= epsilon: c_(n) the n-th best leaf (n = num_samples), v the best value
    still selectable (section 3.4, where n = 1)."""
    k_max: int | None = 5
    """At most k_max expansions per level, and stop after k_max leaves are reached once there are
    num_samples leaves (section 3.5); None: no cap (the toy experiment of section 5.1)."""
    branching: int = 5
    """Top-k children per expansion, all EOS tokens counting as one (raised to num_samples so there
    are enough leaves)."""
    belief_samples: int = 1000
    """N: posterior samples per node and prior samples per level in Algorithm 1."""
    acquisition: str = "descendant"
    """descendant: Eq. 2 (best descendant's samples, the paper's default); posterior: Eq. 1 with max backup."""
    score: str = "total"
    """total log-likelihood, or mean: length-normalised."""
    expansions_per_step: int = 1
    """Nodes each prompt's tree expands per batched forward pass."""
    selection: str = "recursive"
    """recursive: descend from the root to the child that maximises Eq. 1, until an unexpanded node
    (Algorithm 2); boundary: Eq. 1 over the whole boundary at once (the toy setting of section 5.1,
    whose trees are small)."""

    def __post_init__(self):
        if self.prior not in ("dirichlet", "empirical"):
            raise ConfigError(f"strategy.prior: expected dirichlet or empirical, got {self.prior!r}")
        if self.acquisition not in ("descendant", "posterior"):
            raise ConfigError(f"strategy.acquisition: expected descendant or posterior, got {self.acquisition!r}")
        if self.score not in ("total", "mean"):
            raise ConfigError(f"strategy.score: expected total or mean, got {self.score!r}")
        if self.selection not in ("recursive", "boundary"):
            raise ConfigError(f"strategy.selection: expected recursive or boundary, got {self.selection!r}")
        if not self.alpha > 0:
            raise ConfigError(f"strategy.alpha: must be > 0, got {self.alpha}")
        if not 0 < self.epsilon < 1:
            raise ConfigError(f"strategy.epsilon: must be in (0, 1), got {self.epsilon}")
        for key in ("k_max", "branching", "belief_samples", "expansions_per_step", "empirical_samples"):
            value = getattr(self, key)
            if key == "k_max" and value is None:  # no cap
                continue
            if value < 1:
                raise ConfigError(f"strategy.{key}: must be >= 1, got {value}")


# -- the search tree (Algorithm 2) -----------------------------------------------------------

UNEXPANDED, EXPANDED, LEAF, REACHED, DROPPED = range(5)
"""A node's state: on the boundary L; expanded; a leaf (depth cap or EOS) not yet selected; a leaf
that won a selection (known, no model call, counts towards k_max); dropped by the k_max cap."""


@dataclass(slots=True, eq=False)
class SearchNode:
    """One node x_i of a LikelihoodTree."""

    id: int
    """Creation order; node 0 is the root x_0 (the prompt). The expander keys its cache by it."""
    parent: SearchNode | None
    token: int
    """The token x_i appends to its parent's path (-1 at the root)."""
    depth: int
    """level(x_i): tokens on the path from the root."""
    logp: float
    """log c_{x0 -> x_i}: the path log-likelihood, observed (section 3.3)."""
    state: int
    samples: np.ndarray
    """[N] posterior samples of the score of the node's best completion: for an unexpanded node, its
    path log-likelihood plus log Delta draws (section 3.3); for a leaf, its score; for an expanded
    node, the backup of its children (Eq. 2 or the max). Termination reads these."""
    open_samples: np.ndarray
    """[N] the same over what can still be selected (a reached leaf is known: -inf), which selection
    reads, since it looks for what may beat the leaves already reached."""
    children: list[SearchNode] = field(default_factory=list)
    open: bool = True
    """Something below (or the node itself) can still be selected."""
    open_counts: np.ndarray | None = None
    """[len(children)] Eq. 1 over open_samples per child, kept by the last backup for selection."""


class LikelihoodTree:
    """One prompt's ULTS tree (Algorithm 2): ``select`` (Eq. 1), ``expand`` (top-k children with
    posterior samples, section 3.3; one leaf per distinct response), ``backup`` (Eq. 2 or the max),
    and the termination test ``done`` (section 3.4 for the min_leaves-th best leaf, with the k_max
    caps of section 3.5)."""

    def __init__(self, beliefs: LevelBeliefs, max_depth: int, params: ULTSParams, min_leaves: int = 1, seed: int = 0,
                 response_key: Callable[[list[int]], Hashable] | None = None):
        self.beliefs, self.max_depth, self.epsilon = beliefs, max_depth, params.epsilon
        self.k_max = math.inf if params.k_max is None else params.k_max
        self.n, self.acquisition, self.score = params.belief_samples, params.acquisition, params.score
        self.selection, self.branching = params.selection, params.branching
        self.min_leaves = min_leaves
        """n: the search wants this many distinct responses."""
        self.response_key = response_key or tuple
        """A leaf's response (its tokens without EOS) -> what makes two responses the same: the token
        ids by default; the model-side search passes the decoded text."""
        self.rng = np.random.default_rng(seed)
        root_samples = self._posterior_samples(0.0, 0, terminal=False)
        self.root = SearchNode(0, None, -1, 0, 0.0, UNEXPANDED, root_samples, root_samples)
        self.nodes: list[SearchNode] = [self.root]
        self.expanded_per_level: dict[int, int] = {}
        self.expansions = 0
        self.reached = 0
        self.best_leaf: SearchNode | None = None
        self.best_score = -math.inf
        self.leaves: list[SearchNode] = []
        """Every leaf found (distinct token ids, see ``distinct_children``)."""
        self.responses: dict[Hashable, SearchNode] = {}
        """response_key -> the best-scoring leaf that gives that response: the candidates."""
        self.top_scores: list[float] = []
        """The min_leaves best candidate scores, descending: c* = top_scores[0], c_(n) = top_scores[-1]."""

    # scores --------------------------------------------------------------------------------
    def _posterior_samples(self, logp: float, depth: int, terminal: bool,
                           log_delta: np.ndarray | None = None) -> np.ndarray:
        """Section 3.3: samples of v_x given the observed c_{x0 -> x}, i.e. log c_{x0 -> x} plus log Delta
        draws from B_{remaining} (a leaf: its score, no draws). [N]"""
        if terminal:
            total = np.full(self.n, logp, dtype=np.float32)
            final_len = depth
        else:
            if log_delta is None:
                log_delta = self.beliefs.sample_log_delta(self.max_depth - depth, self.n, self.rng)
            total = logp + log_delta
            final_len = self.max_depth
        return total / max(final_len, 1) if self.score == "mean" else total

    def leaf_score(self, node: SearchNode) -> float:
        """A leaf's score, the c of section 3.4: its log-likelihood (score="mean": per token)."""
        return node.logp / max(node.depth, 1) if self.score == "mean" else node.logp

    # selection (Eq. 1) -----------------------------------------------------------------------
    def select(self, count: int = 1) -> list[SearchNode]:
        """Selection: up to ``count`` distinct unexpanded nodes to expand next, each found by Eq. 1
        (a next one skips those already picked). A leaf that wins is reached instead (no model call)."""
        picked: list[SearchNode] = []
        while len(picked) < count and not self.done():
            node = self._select_on_boundary() if self.selection == "boundary" else self._descend()
            if node.state == LEAF:
                self._reach(node)
                continue
            picked.append(node)
            node.open = False  # not again in this step
            self._refresh_open(node.parent)
        for node in picked:  # expandable again until expand() is called
            node.open = True
            self._refresh_open(node)
        return picked

    def _descend(self) -> SearchNode:
        """Algorithm 2's select(x_0): from the root, the open child that is most often the best (Eq. 1,
        counts kept by the backup), until an unexpanded node or a leaf."""
        node = self.root
        while node.state == EXPANDED:
            counts = np.where([c.open for c in node.children], node.open_counts, -1)
            node = node.children[int(counts.argmax())]
        return node

    def _select_on_boundary(self) -> SearchNode:
        """The toy setting (section 5.1): Eq. 1 over every open node of the boundary at once."""
        frontier = [x for x in self.nodes if x.state in (UNEXPANDED, LEAF) and x.open]
        stacked = np.stack([x.open_samples for x in frontier])  # [F, N]
        return frontier[int(np.bincount(stacked.argmax(0), minlength=len(frontier)).argmax())]

    def _reach(self, leaf: SearchNode) -> None:
        """A leaf won the selection: it is known now, so it counts towards the k_max leaves (section 3.5)
        and leaves the open samples, which look for what may still beat it."""
        leaf.state = REACHED
        self.reached += 1
        leaf.open_samples = np.full(self.n, -np.inf, dtype=np.float32)
        self._refresh_open(leaf)
        self.backup(leaf.parent)

    def _refresh_open(self, node: SearchNode | None) -> None:
        """Recompute 'has something to select below' for ``node`` and its ancestors."""
        while node is not None:
            if node.state == EXPANDED:
                node.open = any(c.open for c in node.children)
            else:
                node.open = node.state in (UNEXPANDED, LEAF)
            node = node.parent

    # expansion (section 3.3) -----------------------------------------------------------------
    def expand(self, node: SearchNode, tokens: list[int], logprobs: list[float],
               eos_ids: set[int] = frozenset()) -> None:
        """Expansion: add the top-k children of ``node`` (candidate token ids and their
        log-probabilities, k = branching, see ``distinct_children``), each with N posterior samples
        (section 3.3); update the best leaves c*, c_(n); then back up, or drop the level once it has
        k_max expansions (section 3.5)."""
        level = node.depth
        self.expansions += 1
        node.state = EXPANDED
        depth = level + 1
        tokens, logprobs = distinct_children(tokens, logprobs, eos_ids, self.branching)
        log_delta = self.beliefs.sample_log_delta(self.max_depth - depth, (len(tokens), self.n), self.rng)  # [k, N]
        for j, (tok, lp) in enumerate(zip(tokens, logprobs)):
            logp = node.logp + float(lp)
            terminal = depth >= self.max_depth or tok in eos_ids
            samples = self._posterior_samples(logp, depth, terminal, log_delta[j])
            child = SearchNode(len(self.nodes), node, int(tok), depth, logp, LEAF if terminal else UNEXPANDED,
                               samples, samples)
            self.nodes.append(child)
            node.children.append(child)
            if terminal:
                self._add_leaf(child, eos=tok in eos_ids)
        self.expanded_per_level[level] = self.expanded_per_level.get(level, 0) + 1
        if self.expanded_per_level[level] >= self.k_max:
            self._drop_level(level)
        else:
            self.backup(node)
            self._refresh_open(node)

    def _add_leaf(self, leaf: SearchNode, eos: bool) -> None:
        """A new leaf: update c*, and the candidates and their min_leaves best scores. A leaf whose
        response an earlier leaf gives already (the same text from other tokens) replaces it as the
        candidate if it scores higher, and is a spare otherwise."""
        score = self.leaf_score(leaf)
        self.leaves.append(leaf)
        if score > self.best_score:
            self.best_leaf, self.best_score = leaf, score
        tokens = self.path(leaf)
        key = self.response_key(tokens[:-1] if eos else tokens)
        twin = self.responses.get(key)
        if twin is not None and self.leaf_score(twin) >= score:
            return
        self.responses[key] = leaf
        if twin is not None:  # a better leaf for a known response: rare, so recount
            self.top_scores = sorted((self.leaf_score(x) for x in self.responses.values()), reverse=True)
        elif len(self.top_scores) < self.min_leaves or score > self.top_scores[-1]:
            self.top_scores.append(score)
            self.top_scores.sort(reverse=True)
        del self.top_scores[self.min_leaves:]

    def _drop_level(self, level: int) -> None:
        """Section 3.5: k_max nodes expanded at ``level``, so its other unexpanded nodes and those above
        it are dropped (as in the authors' code), and the samples are rebuilt bottom-up."""
        for x in self.nodes:
            if x.state == UNEXPANDED and x.depth <= level:
                x.state = DROPPED
                x.open = False
                # a fresh array each: Eq. 2's backup tells a changed best child by identity
                x.samples = x.open_samples = np.full(self.n, -np.inf, dtype=np.float32)
        for x in sorted((x for x in self.nodes if x.depth <= level), key=lambda x: -x.depth):
            if x.state == EXPANDED:
                self._backup_node(x)
                x.open = any(c.open for c in x.children)

    # backup (Eq. 2 or the max) ---------------------------------------------------------------
    def backup(self, node: SearchNode | None) -> None:
        """Backup: from ``node`` to the root. With Eq. 2 the samples are shared arrays, so the climb
        stops at the first node whose best child did not change (nothing above it can change)."""
        while node is not None and self._backup_node(node):
            node = node.parent

    def _backup_node(self, node: SearchNode) -> bool:
        """Both sample sets of an expanded node from its children: ``samples`` (the belief over the
        best completion, for termination) and ``open_samples`` (the same over what can still be
        selected). descendant: the samples of the child that Eq. 1 ranks best (Eq. 2); posterior: the
        element-wise max, as in Algorithm 1. Keeps the open counts for selection. True if changed."""
        kids = node.children
        old_samples, old_open = node.samples, node.open_samples
        open_counts = _best_child_counts([c.open_samples for c in kids])
        node.open_counts = open_counts
        if self.acquisition == "descendant":  # Eq. 2: the best child's samples, no further max
            same = all(c.samples is c.open_samples for c in kids)
            counts = open_counts if same else _best_child_counts([c.samples for c in kids])
            node.samples = kids[int(counts.argmax())].samples
            node.open_samples = kids[int(open_counts.argmax())].open_samples
            return node.samples is not old_samples or node.open_samples is not old_open
        node.samples = np.max(np.stack([c.samples for c in kids]), axis=0)
        node.open_samples = np.max(np.stack([c.open_samples for c in kids]), axis=0)
        return True

    # termination (sections 3.4-3.5) ----------------------------------------------------------
    @property
    def open_root_samples(self) -> np.ndarray:
        """Samples of the best value still selectable: the root's open samples (Eq. 2 or the max over
        what can still be selected), or with boundary selection the max over the open boundary. [N]"""
        if self.selection == "boundary":
            frontier = [x.open_samples for x in self.nodes if x.state in (UNEXPANDED, LEAF)]
            return np.max(np.stack(frontier), axis=0) if frontier else np.full(self.n, -np.inf, dtype=np.float32)
        return self.root.open_samples

    def termination_probability(self) -> float:
        """P̂(c_(n) < v) = fraction of the samples of the best value still selectable that lie above
        the n-th best candidate's score, n = min_leaves (section 3.4's P̂(c* < v_x0*) for n
        candidates; 1 while there are fewer than n candidates). A reached leaf is known, so it is
        left out of v: for n = 1 it is at most c* and could not lift a sample above it anyway, and
        for n > 1 a reached leaf among the n best must not count as something that may still beat
        c_(n)."""
        if len(self.top_scores) < self.min_leaves:
            return 1.0
        # compare in the samples' float32: a leaf's own samples are its score rounded to float32
        return float(np.mean(np.float32(self.top_scores[-1]) < self.open_root_samples))

    def done(self) -> bool:
        """Termination. Once the tree holds min_leaves candidates (distinct responses): k_max leaves
        reached (section 3.5) or P̂(c_(n) < v) <= epsilon (section 3.4). Before that the search goes
        on, even past k_max reached leaves, since it owes min_leaves candidates; it is bounded all the
        same by the k_max expansions per level. Also done when nothing is left to select: the tree is
        exhausted, holding every leaf the top-k expansions and the k_max caps allow. With token-id
        responses that is fewer than min_leaves only for a vocabulary with fewer than min_leaves
        distinct continuations; with text responses the leaves may also give fewer distinct texts
        (``ranked_leaves`` then fills up with spares)."""
        if not self.root.open:
            return True
        if len(self.responses) < self.min_leaves:
            return False
        return self.reached >= self.k_max or self.termination_probability() <= self.epsilon

    # the answer ------------------------------------------------------------------------------
    def path(self, node: SearchNode) -> list[int]:
        """The tokens from the root to ``node``."""
        tokens = []
        while node.parent is not None:
            tokens.append(node.token)
            node = node.parent
        return tokens[::-1]

    def ranked_leaves(self) -> list[SearchNode]:
        """Every leaf found: the candidates (one leaf per response), best score first (ties: the earlier
        node), Algorithm 2's x* and the runners-up; then the spares (leaves whose response a candidate
        gives already), best first."""
        rank = lambda x: (-self.leaf_score(x), x.id)  # noqa: E731
        candidates = {x.id for x in self.responses.values()}
        return (sorted(self.responses.values(), key=rank)
                + sorted((x for x in self.leaves if x.id not in candidates), key=rank))


def _best_child_counts(children_samples: list[np.ndarray]) -> np.ndarray:
    """Eq. 1 (times N) for each child: in how many of the N posterior samples it is the best child."""
    stacked = np.stack(children_samples, axis=1)  # [N, C]
    return np.bincount(stacked.argmax(1), minlength=len(children_samples))


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


def distinct_children(tokens: list[int], logprobs: list[float], eos_ids: set[int],
                      k: int) -> tuple[list[int], list[float]]:
    """The k most likely children of a node as distinct responses, most likely first. Every EOS token
    ends the response at the parent, so only the most likely EOS child is kept (ties: the earlier):
    [.., a, eos1] and [.., a, eos2] are one candidate once EOS is stripped. Expansion (section 3.3)
    asks the model for k + |eos_ids| - 1 candidates so that k remain."""
    order = sorted(range(len(tokens)), key=lambda j: -logprobs[j])  # stable: ties keep the model's order
    kept, eos_kept = [], False
    for j in order:
        if tokens[j] in eos_ids:
            if eos_kept:
                continue
            eos_kept = True
        kept.append(j)
        if len(kept) == k:
            break
    return [tokens[j] for j in kept], [logprobs[j] for j in kept]


@dataclass
class SearchResult:
    leaves: list[tuple[list[int], float, float]]
    """(token ids, total log-likelihood, score): the candidates (distinct responses) best score first,
    then the spares (``LikelihoodTree.ranked_leaves``); EOS is not in the token ids, and no two leaves
    have the same token ids."""
    expansions: int
    forward_passes: int
    stats: dict = field(default_factory=dict)


def ults_search(expander: NodeExpander, prompts: list[list[int]], beliefs: LevelBeliefs | list[LevelBeliefs],
                max_depth: int, params: ULTSParams, eos_ids: set[int] = frozenset(), min_leaves: int = 1,
                seeds: list[int] | None = None,
                response_key: Callable[[list[int]], Hashable] | None = None) -> list[SearchResult]:
    """Algorithm 2 for several prompts in lockstep: each step every unfinished tree selects up to
    ``params.expansions_per_step`` nodes and all of them are expanded in one forward pass.

    ``beliefs``: Algorithm 1's, shared or one per prompt. A tree goes on until it holds ``min_leaves``
    distinct responses (``response_key``: what makes two responses the same, token ids by default)
    and its termination test passes (``LikelihoodTree.done``); if the tree is exhausted first, its
    result holds every leaf it has, possibly fewer than min_leaves. ``seeds`` (one per prompt) drive
    the posterior samples."""
    seeds = seeds or list(range(len(prompts)))
    per_tree = beliefs if isinstance(beliefs, list) else [beliefs] * len(prompts)
    trees = [LikelihoodTree(bel, max_depth, params, min_leaves, seed, response_key)
             for bel, seed in zip(per_tree, seeds)]
    forward = [1] * len(trees)
    width = params.branching + max(len(eos_ids) - 1, 0)  # all EOS tokens count as one child (distinct_children)
    ids, vals = _top_k(expander.roots(prompts), width)  # the root expansions, one prefill for all prompts
    for tree, tokens, logprobs in zip(trees, ids, vals):
        tree.expand(tree.root, tokens, logprobs, eos_ids)
    while True:
        picked = [(t, node) for t, tree in enumerate(trees) if not tree.done()
                  for node in tree.select(params.expansions_per_step)]
        if not picked:
            break
        ids, vals = _top_k(expander.expand([(t, node.id, node.parent.id, node.token) for t, node in picked]),
                           width)
        for (t, node), tokens, logprobs in zip(picked, ids, vals):
            trees[t].expand(node, tokens, logprobs, eos_ids)
        for t in {t for t, _ in picked}:
            forward[t] += 1
    results = []
    for t, tree in enumerate(trees):
        expander.release(t)
        results.append(_search_result(tree, forward[t], eos_ids))
    return results


def _search_result(tree: LikelihoodTree, forward_passes: int, eos_ids: set[int]) -> SearchResult:
    """The tree's leaves (``ranked_leaves``: candidates, then spares), each without its EOS."""
    leaves = []
    for leaf in tree.ranked_leaves():
        tokens = tree.path(leaf)
        if tokens and tokens[-1] in eos_ids:
            tokens = tokens[:-1]
        leaves.append((tokens, leaf.logp, tree.leaf_score(leaf)))
    return SearchResult(leaves, tree.expansions, forward_passes,
                        {"termination_probability": tree.termination_probability(),
                         "leaves_reached": tree.reached, "nodes": len(tree.nodes)})


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


def collect_softmax(expander: NodeExpander, prompts: list[list[int]], count: int, depth: int,
                    seeds: list[int], eos_ids: set[int] = frozenset()) -> tuple[list[np.ndarray], list[int]]:
    """The empirical prior's C for each prompt (section 3.1), from rollouts of that prompt itself:
    ``count`` softmax vectors per prompt, each kept as its TOP_CHILDREN largest entries sorted
    descending (all Algorithm 1 reads), so [count, min(TOP_CHILDREN, V)] per prompt; and the tokens
    each prompt's rollouts fed the model.

    C is the model's softmax along a greedy completion of the context, as in the authors' public
    code (examples/sample_llm_outputs.py, over their data sets' texts). A prompt has one greedy path
    of at most ``depth`` tokens, so when ``count`` needs more, the prompt runs ceil(count / depth)
    rollouts side by side: the first greedy, the others sampled from the model with the prompt's
    seed; a rollout that emits EOS starts again from the prompt, sampled.

    Each prompt's rollouts have forward passes of their own, not shared with other prompts: a batched
    forward pass moves the last float bits of a row's logits with the batch's shape, and Algorithm 1
    turns such bits into other Beta fits and other Beta draws, so a shared pass would make a prompt's
    prior depend on its batch. ceil(count / rollouts) - 1 <= depth - 1 passes per prompt after the
    prefill."""
    per_prompt = [_rollout_softmax(expander, prompt, count, depth, seed, eos_ids)
                  for prompt, seed in zip(prompts, seeds)]
    return [c for c, _ in per_prompt], [fed for _, fed in per_prompt]


def _rollout_softmax(expander: NodeExpander, prompt: list[int], count: int, depth: int, seed: int,
                     eos_ids: set[int]) -> tuple[np.ndarray, int]:
    """One prompt's C [count, m] and the tokens its rollouts fed (``collect_softmax``); tree 0 of the expander."""
    rollouts = math.ceil(count / max(depth, 1))
    steps = math.ceil(count / rollouts)
    rng = np.random.default_rng([seed, 1])
    root = expander.roots([prompt]).float()[0]  # [V]
    vocab = root.shape[-1]
    nodes, greedy = [0] * rollouts, [r == 0 for r in range(rollouts)]  # each rollout's last node (0: the prompt)
    logprobs = root.expand(rollouts, vocab)  # [R, V]
    vectors, fed, next_id = [], 0, 1
    for step in range(steps):
        vectors.append(torch.topk(logprobs, min(TOP_CHILDREN, vocab), dim=-1).values.exp().cpu().numpy())  # [R, m]
        if step == steps - 1:
            break
        u = torch.tensor(rng.random(rollouts), dtype=torch.float64, device=logprobs.device)  # [R]
        cdf = logprobs.double().exp().cumsum(-1)  # [R, V]
        sampled = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).squeeze(1).clamp_max(vocab - 1).tolist()
        chosen = [g if is_greedy else s for g, s, is_greedy in zip(logprobs.argmax(-1).tolist(), sampled, greedy)]
        items = []
        for r, token in enumerate(chosen):
            if token in eos_ids:  # starts again from the prompt, sampled
                nodes[r], greedy[r] = 0, False
            else:
                items.append((0, next_id, nodes[r], token))
                nodes[r], next_id = next_id, next_id + 1
        out = iter(expander.expand(items).float()) if items else iter(())  # [len(items), V]
        logprobs = torch.stack([root if node == 0 else next(out) for node in nodes])
        fed += len(items)
    expander.release(0)
    return np.concatenate(vectors)[:count], fed


class ULTSHost(Protocol):
    """What ULTS's model-side search needs of the generator's engine
    (pipeline.engines.adapters.HFSearchHost)."""

    eos_ids: set[int]
    vocab_size: int

    def node_expander(self) -> NodeExpander: ...

    def remember(self, key: tuple, make):
        """Per-engine state: ``make()`` the first time ``key`` is asked for, the same object after."""

    def decode(self, token_lists: list[list[int]]) -> list[str]: ...


def level_beliefs(params: ULTSParams, host: ULTSHost, expander: NodeExpander, prompts: list[list[int]],
                  max_depth: int, seeds: list[int], eos_ids: set[int]) -> tuple[list[LevelBeliefs], list[int]]:
    """Algorithm 1's beliefs for each prompt, and the tokens each prompt's prior cost.

    Dirichlet: a function of (alpha, V, depth, N) alone, so the engine fits it once and keeps it (no
    tokens). Empirical: C from the prompt's own rollouts (``collect_softmax``) and a fit seeded with
    the prompt's seed, made for this call and not kept, so a prompt's beliefs, and with them its
    candidates, do not depend on which prompts share its batch or came before it. The cost is the
    rollouts' tokens and one Algorithm 1 fit (``fit_level_beliefs``) per prompt."""
    if params.prior == "dirichlet":
        prior = DirichletPrior(params.alpha, host.vocab_size)
        shared = host.remember(("ults-beliefs", prior.key, max_depth, params.belief_samples),
                               lambda: fit_level_beliefs(prior, max_depth, params.belief_samples, seed=0))
        return [shared] * len(prompts), [0] * len(prompts)
    collected, fed = collect_softmax(expander, prompts, params.empirical_samples, max_depth, seeds, eos_ids)
    return [fit_level_beliefs(EmpiricalPrior(c), max_depth, params.belief_samples, seed=[seed, 2])
            for c, seed in zip(collected, seeds)], fed


def search(host: ULTSHost, prompts: list[list[int]], num_samples: int, seeds: list[int],
           sampling: SamplingParams, params: ULTSParams) -> list[SearchOutput]:
    """Model-side ``ults``: one ULTS tree per prompt; its num_samples best leaves, distinct responses
    (decoded texts: two token sequences can spell one text, and the pairs are made of texts), are the
    candidates; should the tree end with fewer distinct texts, the best spares (other token ids, a
    text already taken) fill up. ULTS maximises likelihood, so of the sampling settings only
    max_new_tokens (the depth) and ignore_eos apply; each prompt's first seed drives its
    posterior samples (and its empirical prior's rollouts and fit), so a prompt's candidates do not
    depend on its batch. A prompt's cost (generated_tokens) is its expansions plus its prior's
    rollout tokens. RuntimeError only when a tree is exhausted with fewer than num_samples leaves:
    the vocabulary has fewer than num_samples distinct continuations (see ``LikelihoodTree.done``)."""
    expander = host.node_expander()
    eos = set() if sampling.ignore_eos else set(host.eos_ids)
    depth = sampling.max_new_tokens
    prompt_seeds = [seeds[i * num_samples] for i in range(len(prompts))]
    beliefs, prior_tokens = level_beliefs(params, host, expander, prompts, depth, prompt_seeds, eos)
    wide_enough = replace(params, branching=max(params.branching, num_samples))  # num_samples leaves at least
    results = ults_search(expander, prompts, beliefs, depth, wide_enough, eos, min_leaves=num_samples,
                          seeds=prompt_seeds, response_key=lambda tokens: host.decode([tokens])[0])
    outputs = []
    for i, res in enumerate(results):
        leaves = res.leaves[:num_samples]
        if len(leaves) < num_samples:
            raise RuntimeError(f"ults: prompt {i} has only {len(leaves)} distinct responses of at most {depth} "
                               f"tokens under top-{wide_enough.branching} expansion, need num_samples={num_samples}")
        texts = host.decode([tokens for tokens, _, _ in leaves])
        rows = [RowState(row=i * num_samples + s, token_ids=tokens, text=text, finished=True)
                for s, ((tokens, _, _), text) in enumerate(zip(leaves, texts))]
        outputs.append(SearchOutput(rows=rows, generated_tokens=res.expansions + prior_tokens[i], stats={
            "expansions": res.expansions, "forward_passes": res.forward_passes, "prior_tokens": prior_tokens[i],
            "best_loglik": leaves[0][1]}))
    return outputs
