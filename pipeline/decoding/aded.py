"""ADED: Adaptive Draft-Verification for Efficient LLM Decoding (Liu, Lei, Zhang and Xu).

Terms:
- LLM representative: a tri-gram matrix P(w_i | w_{i-2}, w_{i-1}) (Eq. 1), top t continuations per
  context, updated from the model's own verified output (appendix Algorithm 2); see
  pipeline.decoding.trigram.TrigramMatrix, seen here through ``LLMRepresentative``.
- Draft maker: Monte-Carlo tree search (appendix Algorithm 1) from the last two context tokens.
  Selection maximises PUCT(s, a) = Q(s, a) + E * P(s, a) * sqrt(sum_b N(s, b)) / (1 + N(s, a))
  (Eq. 2 / 17) with E = C1 + log((sum_b N(s, b) + C2 + 1) / C2) (Eq. 3 / 16); P is the tri-gram
  probability, N the visit count, Q the mean rollout score. Expansion adds a child for every
  untried continuation; simulation rolls out by sampling the tri-gram matrix to the draft length
  l; the score is 1 + the sum of the tri-gram probabilities along the state (Algorithm 1,
  lines 35-37) and is backed up along the path. Defaults (appendix F): C1 = 32, C2 = 8, 150
  iterations, l = 4, n = 24 candidates, t = 12. Where Algorithm 1 descends into the *last* new
  child after an expansion, we take the most probable one (the PUCT choice among unvisited
  children, which all score E * P * 0 = 0, broken by the prior); the paper's order of the
  untried list is not specified.
- Draft construction: the n best root-to-leaf paths of the search tree (most visited first) are
  merged into one token tree (common prefixes once) and verified in ONE target forward pass with
  tree attention (pipeline.engines.tree).
- Acceptance. Greedy: walk down the tree while the target's argmax is a child's token; the target's
  argmax after the last accepted node is the bonus token. Sampling: at each node draw the next token
  from the target's (warped) distribution with the row's own random stream (RowStreams, as the
  engine's rows draw); if it is a child's token the walk continues, else it is the bonus token (the
  paper's "new tokens are sampled and compared to the draft tokens"). Every emitted token is drawn
  from the target given the exact prefix, one uniform per token in order, so the output is
  distributed exactly as plain sampling; with the same per-row seeds it is the same sequence up to
  float rounding of the tree pass.
"""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.errors import ConfigError
from pipeline.decoding.domain import DraftLayer, RowState, SearchOutput
from pipeline.decoding.sampling import RowStreams, SamplingParams, sample_next, sample_with
from pipeline.decoding.tree import TokenTree


class LLMRepresentative(Protocol):
    def continuations(self, a: int, b: int) -> list[tuple[int, float]]:
        """Stored continuations of context (a, b) with their probabilities, most probable first."""

    def probability(self, a: int, b: int, c: int) -> float: ...

    def update(self, tokens: list[int], max_length: int, increment: float, max_prob: float) -> None: ...


class TreeDrafter(Protocol):
    """Model-free drafter: given the context token ids, a token tree of candidate continuations.
    Root-level nodes (parent -1) continue the context. This is how ADED serves speculative
    decoding and DSBD when no draft model is configured."""

    def propose(self, context: list[int]) -> TokenTree: ...

    def observe(self, context: list[int], new_tokens: int) -> None:
        """The last ``new_tokens`` of ``context`` were just verified (adaptive drafters learn)."""


class TreeVerifier(Protocol):
    """The target side (pipeline.engines.adapters.TreeTarget)."""

    def open(self, prompts: list[list[int]], num_samples: int) -> torch.Tensor: ...

    def verify(self, trees: list[TokenTree]) -> torch.Tensor: ...

    def commit(self, sources: list[tuple[int, list[int]]]) -> None: ...

    def select(self, keep: list[int]) -> None: ...


# -- the draft maker (appendix Algorithm 1) ----------------------------------------------------


class _Node:
    __slots__ = ("token", "parent", "prior", "children", "untried", "visits", "value", "depth")

    def __init__(self, token, parent, prior, untried, depth):
        self.token, self.parent, self.prior, self.untried, self.depth = token, parent, prior, untried, depth
        self.children: list[_Node] = []
        self.visits, self.value = 0, 0.0


def exploration(total_visits: int, c1: float, c2: float) -> float:
    """E = C1 + log((sum_b N(s, b) + C2 + 1) / C2)   (Eq. 3)."""
    return c1 + math.log((total_visits + c2 + 1) / c2)


def puct(child: _Node, total_visits: int, c1: float, c2: float) -> float:
    """PUCT(s, a) = Q(s, a) + E * P(s, a) * sqrt(sum_b N(s, b)) / (1 + N(s, a))   (Eq. 2)."""
    q = child.value / child.visits if child.visits else 0.0
    return q + exploration(total_visits, c1, c2) * child.prior * math.sqrt(total_visits) / (1 + child.visits)


def mcts_drafts(matrix: LLMRepresentative, context: list[int], iterations: int = 150, depth: int = 4,
                candidates: int = 24, c1: float = 32.0, c2: float = 8.0, rng: random.Random | None = None
                ) -> list[list[int]]:
    """Appendix Algorithm 1 from the last two tokens of ``context``: up to ``candidates`` drafts of
    at most ``depth`` tokens, best first."""
    if len(context) < 2:
        return []
    rng = rng or random.Random(0)
    a, b = context[-2], context[-1]
    root = _Node(None, None, 1.0, matrix.continuations(a, b), 0)
    if not root.untried:
        return []
    for _ in range(iterations):
        node, state = root, [a, b]
        # Selection: down through fully expanded nodes.
        while not node.untried and node.children and node.depth < depth:
            total = sum(c.visits for c in node.children)
            node = max(node.children, key=lambda c: puct(c, total, c1, c2))
            state.append(node.token)
        # Expansion: a child per untried continuation; go into the most probable one.
        if node.untried and node.depth < depth:
            for token, prob in node.untried:
                node.children.append(_Node(token, node, prob, matrix.continuations(state[-1], token), node.depth + 1))
            node.untried = []
            node = node.children[0]
            state.append(node.token)
        # Simulation: roll out by the tri-gram probabilities to the draft length.
        while len(state) - 2 < depth:
            conts = matrix.continuations(state[-2], state[-1])
            if not conts:
                break
            tokens, probs = zip(*conts)
            state.append(rng.choices(tokens, weights=probs)[0])
        score = 1.0 + sum(matrix.probability(state[i - 2], state[i - 1], state[i]) for i in range(2, len(state)))
        # Backpropagation.
        while node is not None:
            node.visits += 1
            node.value += score
            node = node.parent
    leaves: list[_Node] = []
    stack = list(root.children)
    while stack:
        node = stack.pop()
        if node.children:
            stack.extend(node.children)
        elif node.visits:
            leaves.append(node)
    leaves.sort(key=lambda n: (-n.visits, -n.value / n.visits))
    drafts = []
    for leaf in leaves[:candidates]:
        path, node = [], leaf
        while node is not root:
            path.append(node.token)
            node = node.parent
        drafts.append(path[::-1])
    return drafts


def merge_drafts(drafts: list[list[int]]) -> TokenTree:
    """One token tree (a trie) from candidate drafts: each common prefix appears once."""
    tokens, parents = [], []
    index: dict[tuple[int, int], int] = {}
    for draft in drafts:
        parent = -1
        for token in draft:
            key = (parent, token)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = index[key]
    return TokenTree(tokens, parents)


@dataclass
class ADEDDrafter:
    """ADED's drafter: MCTS over the adaptive tri-gram matrix. Implements TreeDrafter."""

    matrix: LLMRepresentative
    iterations: int = 150
    depth: int = 4
    candidates: int = 24
    c1: float = 32.0
    c2: float = 8.0
    adaptive: bool = True
    increment: float = 0.1
    max_prob: float = 1.0
    seed: int = 0
    rng: random.Random = field(init=False)

    def __post_init__(self):
        self.rng = random.Random(self.seed)

    def propose(self, context: list[int]) -> TokenTree:
        return merge_drafts(mcts_drafts(self.matrix, context, self.iterations, self.depth, self.candidates,
                                        self.c1, self.c2, self.rng))

    def observe(self, context: list[int], new_tokens: int) -> None:
        if self.adaptive:  # each new tri-gram once (Algorithm 2 over the last new_tokens + 2 tokens)
            self.matrix.update(context, new_tokens + 2, self.increment, self.max_prob)


@dataclass
class ADEDLayerDrafter:
    """ADED as a DSBD / speculative-decoding Drafter (pipeline.decoding.domain.Drafter), for when
    no draft model is configured (issue 4, item 9).

    Per call it drafts from the highest-weighted context (largest prefix_logp; ties: the first):
    the MCTS (appendix Algorithm 1, Eq. 2-3) over the tri-gram matrix runs ``depth`` levels deep
    and its most-visited leaf's path is the draft; a path shorter than ``depth`` goes on with the
    matrix's most probable continuation, and where the matrix knows none, repeats the last token.
    Given the MCTS's random stream (seeded by ``seed``, independent of the verifier's uniforms) this
    is a deterministic choice, so each layer holds ``width`` copies of one node and its q_beam is
    one-hot over (parent, token): the nodes ARE iid draws from it, which is all DSBD's Theorem 3.1
    and Leviathan et al.'s acceptance (accept x with p(x), else resample from norm(max(0, p - q)))
    need for the output to keep the target's distribution. Layer 1's parent is the chosen context;
    deeper layers continue node 0 of the layer above (a passed layer always accepted node 0: after a
    rejection p'(x) = 0 for the one drafted x, so later copies are rejected too).

    Adaptive update (appendix Algorithm 2): the contexts DSBD drafts from are the prompt plus
    target-verified tokens, so before drafting, the tokens of the chosen context that are new since
    the last call (beyond their common prefix with it; all of it, prompt included, for a new row)
    go to ``ADEDDrafter.observe``. ``reset()`` restores the matrix it started with; dsbd's search
    calls it before every prompt, so that a prompt's candidates depend only on the prompt and its
    seeds, not on its batch-mates (reproducible, resumable), while the matrix adapts across the
    prompt's rows and iterations."""

    drafter: ADEDDrafter
    vocab_size: int
    """The target's output vocabulary: q_beam rows have this many tokens."""
    initial: object = field(init=False)
    seen: list[int] = field(init=False, default_factory=list)

    def __post_init__(self):
        self.initial = self.drafter.matrix.copy()

    def reset(self) -> None:
        self.drafter.matrix = self.initial.copy()
        self.seen = []

    def draft(self, contexts: list[list[int]], prefix_logp: list[float], width: int, depth: int,
              sampling: SamplingParams, seed: int) -> list[DraftLayer]:
        best = max(range(len(contexts)), key=lambda i: (prefix_logp[i], -i))
        context = list(contexts[best])
        common = 0
        for a, b in zip(context, self.seen):
            if a != b:
                break
            common += 1
        if len(context) > common:
            self.drafter.observe(context, len(context) - common)
        self.seen = context
        matrix = self.drafter.matrix
        found = mcts_drafts(matrix, context, self.drafter.iterations, depth, 1, self.drafter.c1, self.drafter.c2,
                            random.Random(seed))
        path = found[0] if found else []
        state = context + path
        while len(path) < depth:
            conts = matrix.continuations(state[-2], state[-1]) if len(state) >= 2 else []
            token = conts[0][0] if conts else state[-1]
            path.append(token)
            state.append(token)
        layers = []
        for level, token in enumerate(path):
            parents = len(contexts) if level == 0 else width
            parent = best if level == 0 else 0
            q_beam = torch.zeros(parents * self.vocab_size)
            q_beam[parent * self.vocab_size + token] = 1.0
            layers.append(DraftLayer([parent] * width, [token] * width, q_beam))
        return layers


@dataclass
class RetrievalDrafter:
    """A static REST-like baseline: the longest suffix of the context (up to ``max_suffix`` tokens)
    found in the corpus retrieves the ``candidates`` most frequent ``depth``-token continuations
    that followed it there, merged into a token tree. No updates."""

    corpus: list[list[int]]
    depth: int = 4
    candidates: int = 24
    max_suffix: int = 3
    index: dict = field(init=False)

    def __post_init__(self):
        self.index = {}
        for seq in self.corpus:
            for i in range(len(seq)):
                cont = tuple(seq[i + 1:i + 1 + self.depth])
                if not cont:
                    continue
                for k in range(1, self.max_suffix + 1):
                    if i + 1 - k < 0:
                        break
                    self.index.setdefault(tuple(seq[i + 1 - k:i + 1]), Counter())[cont] += 1

    def propose(self, context: list[int]) -> TokenTree:
        for k in range(min(self.max_suffix, len(context)), 0, -1):
            found = self.index.get(tuple(context[-k:]))
            if found:
                return merge_drafts([list(c) for c, _ in found.most_common(self.candidates)])
        return TokenTree([], [])

    def observe(self, context: list[int], new_tokens: int) -> None:
        pass


# -- verification and acceptance ----------------------------------------------------------------


def accept(tree: TokenTree, logits: torch.Tensor, sampling: SamplingParams,
           generator: torch.Generator | RowStreams | torch.Tensor) -> tuple[list[int], int]:
    """Walk ``tree`` (node 0 is the committed-but-uncached token) with the target's logits [N, V]:
    at each node draw the next token (argmax when temperature is 0, else a sample from the warped
    target distribution: one draw per node, so one per token the row gains); follow the child with
    that token, else stop. The draws come from the row's generator, its one-row RowStreams, or the
    row's next uniforms already drawn (a tensor [k], k > the tree's depth: ``RowStreams.ahead``,
    which the caller then moves on by ``len(path)``; the tokens are those of the one-row stream).
    Returns (accepted path of node indices, starting with 0; the next token drawn after it)."""
    children: dict[tuple[int, int], int] = {}
    for i, (tok, parent) in enumerate(zip(tree.tokens, tree.parents)):
        children.setdefault((parent, tok), i)
    path, node = [0], 0
    while True:
        if isinstance(generator, torch.Tensor):
            token = int(sample_with(logits[node][None], sampling, generator[len(path) - 1:len(path)])[0])
        else:
            stream = generator if isinstance(generator, RowStreams) else [generator]
            token = int(sample_next(logits[node][None], sampling, stream)[0])
        child = children.get((node, token))
        if child is None:
            return path, token
        path.append(child)
        node = child


def accept_tokens(tree: TokenTree, logits: torch.Tensor, sampling: SamplingParams,
                  generator: torch.Generator | RowStreams, eos: set[int]) -> tuple[list[int], list[int], int]:
    """``accept``, then the response ends at the first EOS: returns (the accepted path, the accepted
    draft tokens before any EOS among them, the token drawn after them, which is that EOS if one
    was accepted)."""
    path, token = accept(tree, logits, sampling, generator)
    new = [tree.tokens[i] for i in path[1:]]
    ended = next((i for i, t in enumerate(new) if t in eos), None)
    if ended is not None:  # an accepted draft token is EOS: the response ends at the first one
        new, token = new[:ended], new[ended]
    return path, new, token


@dataclass
class DecodeStats:
    forward_passes: int = 0
    """Target forward passes after the prefill (one per verification step)."""
    emitted: int = 0
    """Tokens emitted by those passes (accepted draft tokens + one bonus token each)."""
    draft_seconds: float = 0.0
    accepted_per_step: list = field(default_factory=list)
    """(row, step, tokens emitted) per verification."""


def aded_decode(target: TreeVerifier, drafter: TreeDrafter, prompts: list[list[int]], num_samples: int,
                seeds: list[int], sampling: SamplingParams, eos_ids: set[int], device: str | torch.device = "cpu"
                ) -> tuple[list[list[int]], DecodeStats]:
    """Draft-verify decoding of len(prompts) * num_samples rows in lockstep (row r: prompt r // num_samples).
    Each step every live row proposes a tree after its pending token, one forward pass verifies all
    trees, ``accept`` picks each row's path, and the cache keeps only those paths. Returns each row's
    response tokens (EOS excluded) and counters."""
    rows = len(prompts) * num_samples
    streams = RowStreams.seeded(seeds, device)  # the engine's streams: the rows plain sampling makes
    stats = DecodeStats()
    logits = target.open(prompts, num_samples)  # [R, V]
    out: list[list[int]] = [[] for _ in range(rows)]
    live: list[int] = []
    cap = sampling.max_new_tokens
    eos = set() if sampling.ignore_eos else eos_ids
    first = sample_next(logits, sampling, streams).tolist()  # [R]
    for r, token in enumerate(first):
        if token not in eos:
            out[r].append(token)
            if len(out[r]) < cap:
                live.append(r)
    if len(live) < rows:
        target.select(live)  # the batch holds row r at position r until now
    step = 0
    while live:
        trees = []
        start = time.perf_counter()
        for r in live:
            draft = drafter.propose(prompts[r // num_samples] + out[r])
            room = cap - len(out[r]) - 1  # draft tokens that can still fit, before the bonus token
            keep = [i for i, d in enumerate(draft.depths()) if d < room]
            remap = {old: new + 1 for new, old in enumerate(keep)}
            trees.append(TokenTree([out[r][-1]] + [draft.tokens[i] for i in keep],
                                   [-1] + [remap.get(draft.parents[i], 0) for i in keep]))
        stats.draft_seconds += time.perf_counter() - start
        logits = target.verify(trees)  # [B, N, V]
        stats.forward_passes += 1
        sources, next_live = [], []
        live_streams = streams.select(torch.tensor(live, dtype=torch.long, device=streams.device))
        uniforms = live_streams.ahead(1 + max(max(tree.depths(), default=0) for tree in trees)).to(logits.device)
        draws = []
        for b, (r, tree) in enumerate(zip(live, trees)):
            path, new, token = accept_tokens(tree, logits[b], sampling, uniforms[b], eos)
            draws.append(len(path) if sampling.temperature else 0)
            done = token in eos
            emitted = new + ([] if done else [token])
            out[r].extend(emitted)
            stats.emitted += len(new) + 1
            stats.accepted_per_step.append((r, step, len(new) + 1))
            drafter.observe(prompts[r // num_samples] + out[r], len(emitted))
            if len(out[r]) >= cap:
                del out[r][cap:]
                done = True
            if not done:
                sources.append((b, path))
                next_live.append(r)
        streams.counters[live] += torch.tensor(draws, dtype=torch.long, device=streams.device)
        target.commit(sources)
        live = next_live
        step += 1
    return out, stats


# -- the build strategy ----------------------------------------------------------------------------


@dataclass
class ADEDParams:
    trigram: str = ""
    """A saved tri-gram matrix (.npz, pipeline.engines.trigram.save_trigram); empty: start from the prompts alone."""
    top_t: int = 12
    """t: continuations kept per context."""
    iterations: int = 150
    """MCTS iterations per draft."""
    draft_depth: int = 4
    """l: tokens per candidate draft."""
    candidates: int = 24
    """n: candidate drafts merged into the token tree."""
    c1: float = 32.0
    """C1 in E = C1 + log((sum N + C2 + 1) / C2)."""
    c2: float = 8.0
    """C2 in the same."""
    adaptive: bool = True
    """Update the tri-gram matrix from prompts and verified outputs (appendix Algorithm 2)."""
    increment: float = 0.1
    """Algorithm 2's increment (the paper gives no value)."""
    max_prob: float = 1.0
    """Algorithm 2's cap (the paper gives no value)."""

    def __post_init__(self):
        for key in ("top_t", "iterations", "draft_depth", "candidates"):
            if getattr(self, key) < 1:
                raise ConfigError(f"strategy.{key}: must be >= 1, got {getattr(self, key)}")
        if self.c2 <= 0:
            raise ConfigError(f"strategy.c2: must be > 0, got {self.c2}")
        if not 0 < self.increment <= self.max_prob:
            raise ConfigError(f"strategy.increment: must be in (0, max_prob], got {self.increment}")


class ADEDHost(Protocol):
    """What ADED's model-side search needs of the generator's engine
    (pipeline.engines.adapters.HFSearchHost)."""

    eos_ids: set[int]
    device: object

    def tree_target(self) -> TreeVerifier: ...

    def load_trigram(self, path: str, top_t: int) -> LLMRepresentative:
        """The saved matrix at ``path``, or an empty one keeping ``top_t`` continuations."""

    def remember(self, key: tuple, make):
        """Per-engine state: ``make()`` the first time ``key`` is asked for, the same object after."""

    def decode(self, token_lists: list[list[int]]) -> list[str]: ...


def search(host: ADEDHost, prompts: list[list[int]], num_samples: int, seeds: list[int],
           sampling: SamplingParams, params: ADEDParams) -> list[SearchOutput]:
    """Model-side ``aded``: Best-of-N sampling where every row is decoded with ADED drafts verified
    by the target (output distribution unchanged). The tri-gram matrix is the engine's (made on
    the first call), so it keeps adapting across batches."""
    matrix = host.remember(("aded-trigram", params.trigram, params.top_t),
                           lambda: host.load_trigram(params.trigram, params.top_t))
    drafter = ADEDDrafter(matrix, params.iterations, params.draft_depth, params.candidates, params.c1, params.c2,
                          params.adaptive, params.increment, params.max_prob, seed=seeds[0] if seeds else 0)
    if params.adaptive:
        for prompt in prompts:  # the input's tri-grams too (ADED Fig. 2)
            matrix.update(prompt, len(prompt), params.increment, params.max_prob)
    tokens, stats = aded_decode(host.tree_target(), drafter, prompts, num_samples, seeds, sampling, host.eos_ids,
                                host.device)
    outputs = []
    for i in range(len(prompts)):
        ids = list(range(i * num_samples, (i + 1) * num_samples))
        texts = host.decode([tokens[r] for r in ids])
        mine = [(step, n) for r, step, n in stats.accepted_per_step if r in ids]
        outputs.append(SearchOutput(
            rows=[RowState(row=r, token_ids=tokens[r], text=t, finished=True) for r, t in zip(ids, texts)],
            generated_tokens=sum(len(tokens[r]) for r in ids),
            # summable counters: row-steps verified, tokens they emitted (accepted + bonus), and the
            # batched target forward passes this prompt's rows took part in (prefill included)
            stats={"verify_steps": len(mine), "verified_tokens": sum(n for _, n in mine),
                   "forward_passes": 1 + len({step for step, _ in mine})}))
    return outputs
