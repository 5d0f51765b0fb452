"""Dynamic-Width Speculative Beam Decoding (Qin et al., "Dynamic-Width Speculative Beam Decoding for
Efficient LLM Inference"): DSBD, plus the beam sampling it accelerates.

Terms (paper section 2.1 and 3.1)
- beam: a candidate sequence; beam sampling keeps W of them and draws the next W iid from
  p_beam (Eq. 1): the warped (T = temperature / top-k / top-p) joint distribution over
  (input beam, next token) proportional to p(beam) * p(token | beam).
- draft forest: the draft model beam-samples W_S beams for gamma steps from the W_L input beams
  (a Drafter returns it as gamma DraftLayers, each with the q_beam its nodes were drawn from).
- verification (Algorithm 1): layer by layer, draft beam x is accepted with probability
  min(1, p'(x) / q_beam(x)) (the paper's line 16 prints the ratio upside down; its proof, Eq. 13,
  and Leviathan et al. use p'/q); p' starts at p_beam, becomes norm(max(0, p' - q_beam)) after a
  rejection and is reset to p_beam after an acceptance. When W_L^(l) beams are accepted the layer
  passes and the rest are rejected, and so is every draft beam whose parent was rejected. A layer
  with fewer accepted beams is completed with one beam from p' and then beams from p_beam, and
  verification stops there. If every draft layer passes, an extra layer is sampled from p_beam.
- dynamic width (Eq. 2-7): alpha_j (Eq. 4) is the probability that the j-th draft beam is accepted
  given that the j-1 before it were rejected; P(m, k) (Eq. 2-3) the probability that k of m are
  accepted; W_L^(l) = max(W_min, the largest K with P(at least K accepted) >= t).
- forest-based parallel verification (section 3.3): every input beam's draft tree goes through
  the target in ONE forward pass (pipeline.engines.tree), and the KV cache is cut to the output
  beams' paths.
- memory mode (section 3.4): only the output beam with the lowest perplexity becomes the next
  iteration's input, so one KV cache row is kept, as in speculative decoding.

Choices the paper leaves open (each keeps Theorem 3.1, which only needs the drafts to be iid
draws from the q_beam used to verify them):
- q_beam weights the input beams by their TARGET likelihood (known exactly to the verifier) and
  deeper draft beams by that times the draft's conditional probabilities; the paper writes q of
  the whole beam. The layer-1 parent marginal of q_beam then equals p_beam's.
- Line 10 removes draft beams whose parent was rejected. The survivors are iid draws from q_beam
  CONDITIONED on their parent being accepted, so they are verified against q_beam restricted to
  the accepted parents and renormalised; verifying them against the unrestricted q_beam would
  bias the output.
- Beams are sampled with replacement (iid, as the theorem states), so two beams may coincide.
- EOS (beam sampling and DSBD alike). A beam ends at its first EOS: it is complete, and from then
  on its only continuation is one more EOS with probability 1 (log-prob 0), so p_beam (Eq. 1) still
  weighs it by its likelihood, which no longer changes, and it never grows a real token again (an
  absorbing state; ``absorb_ended``). All beams keep one length (the padding EOS fills the ended
  ones' rows), so the forest, the KV cache and Theorem 3.1 are untouched: only the target's
  next-token distribution after an ended beam is replaced before p_beam is formed. Decoding stops
  once every beam has ended, or at max_new_tokens. The candidate is the complete beam with the
  lowest perplexity (section 3.4 and Figure 1 rank beams by perplexity, "lowest perplexity"):
  the highest mean target log-likelihood per token of the response up to and including its EOS
  (``perplexity_rank``), so a beam is never ranked by tokens after its EOS, and beams of different
  lengths compare per token. With no EOS (``ignore_eos``) all beams have max_new_tokens tokens and
  this is the highest likelihood, as before. The paper only says decoding continues "until the
  stopping criteria are met (e.g., reaching the maximum number of tokens)"; the ranking by mean
  log-likelihood is also what Hugging Face's beam scorer does with its default length_penalty 1.
- The paper does not say how the last iteration meets the length cap: an iteration emits up to
  gamma + 1 positions (line 33's extra layer), so gamma is at most the room left minus one
  (``draft_depth``) and the final beams have exactly max_new_tokens positions, as in beam sampling.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.errors import ConfigError
from pipeline.decoding.aded import ADEDDrafter, ADEDLayerDrafter
from pipeline.decoding.domain import Drafter, DraftLayer, RowState, SearchOutput
from pipeline.decoding.sampling import (SamplingParams, beam_distribution, cut_response, inverse_cdf,
                                        residual_distribution)
from pipeline.decoding.tree import TokenTree


@dataclass
class DSBDParams:
    draft_width: int = 4
    """W_S: draft beams per layer of the draft forest."""
    num_draft_layers: int = 2
    """gamma: draft forest depth (beam-sampling steps of the draft model per iteration)."""
    acceptance_threshold: float = 0.9
    """t of Eq. 6-7: a layer's width is the largest K accepted with probability >= t."""
    min_width: int = 1
    """W_min of Eq. 6."""
    memory_mode: bool = False
    """Section 3.4: keep only the lowest-perplexity output beam (one KV cache row) between iterations."""
    trigram: str = ""
    """With no models.draft, ADED drafts: its starting tri-gram matrix (.npz from TrigramMatrix.save,
    e.g. jobs.build_trigram); empty: it starts empty and learns from the prompts and beams."""

    def __post_init__(self):
        if self.draft_width < 1 or self.num_draft_layers < 1 or self.min_width < 1:
            raise ConfigError("strategy: draft_width, num_draft_layers and min_width must be >= 1")
        if self.min_width > self.draft_width:
            raise ConfigError(f"strategy.min_width: {self.min_width} exceeds draft_width {self.draft_width}")
        if not 0 <= self.acceptance_threshold <= 1:
            raise ConfigError(f"strategy.acceptance_threshold: must be in [0, 1], got {self.acceptance_threshold}")


# -- the math (pure functions over tensors) ---------------------------------------------------


def acceptance_chain(p: torch.Tensor, q: torch.Tensor, m: int) -> torch.Tensor:
    """alpha_1..alpha_m of Eq. 4: alpha_j = sum q * min(1, p_j / q), p_1 = p, p_{j+1} = norm(max(p_j - q, 0))."""
    alphas = []
    pj = p
    for _ in range(m):
        alphas.append(torch.minimum(pj, q).sum())
        pj = residual_distribution(pj, q)
    return torch.stack(alphas) if alphas else torch.zeros(0)


def accepted_count_distribution(alphas: torch.Tensor) -> torch.Tensor:
    """P(M, k) for k = 0..M (Eq. 2-3), M = len(alphas); acceptance resets the chain to alpha_1."""
    a = alphas.double().tolist()
    m_total = len(a)
    # P[m][k]: k of m draft beams accepted, the chain restarting at alpha_1.
    P = [[0.0] * (m_total + 1) for _ in range(m_total + 1)]
    for m in range(m_total + 1):
        none = 1.0
        for j in range(m):
            none *= 1 - a[j]
        P[m][0] = none
        for k in range(1, m + 1):
            first_rejected = 1.0
            total = 0.0
            for i in range(1, m + 1):  # the i-th beam is the first accepted (Eq. 3)
                total += a[i - 1] * first_rejected * P[m - i][k - 1]
                first_rejected *= 1 - a[i - 1]
            P[m][k] = total
    return torch.tensor(P[m_total], dtype=torch.float64)


def dynamic_width(alphas: torch.Tensor, threshold: float, min_width: int) -> int:
    """W_L^(l) = max(W_min, max{K : 1 - sum_{k<K} P(M_S, k) >= t}) (Eq. 5-7)."""
    at_least = 1 - torch.cat([torch.zeros(1, dtype=torch.float64),
                              accepted_count_distribution(alphas).cumsum(0)])  # [M + 2]: P(>= K), K = 0..M + 1
    ok = [k for k in range(len(alphas) + 1) if at_least[k] >= threshold - 1e-12]
    return max(min_width, max(ok))


@dataclass
class LayerVerdict:
    accepted: list[int]
    """Positions (in the candidate list) of the accepted draft beams, in order."""
    outputs: list[int]
    """Flat (parent * V + token) indices of the layer's output beams: the accepted candidates,
    then (when the layer fails) one from p' and the rest from p_beam."""
    passed: bool
    """True when ``width`` draft beams were accepted (verification goes on to the next layer)."""


def verify_layer(p_beam: torch.Tensor, q_beam: torch.Tensor, candidates: list[int], width: int,
                 uniforms) -> LayerVerdict:
    """Algorithm 1, lines 12-30, for one layer. p_beam, q_beam: [M] over (parent, token);
    candidates: flat indices of the surviving draft beams, iid draws from q_beam; ``uniforms()``
    returns the next U(0, 1) float."""
    p_prime = p_beam
    accepted: list[int] = []
    for pos, x in enumerate(candidates):
        if len(accepted) == width:
            break
        if uniforms() * float(q_beam[x]) < float(p_prime[x]):  # r < p'(x) / q(x)
            accepted.append(pos)
            p_prime = p_beam
        else:
            p_prime = residual_distribution(p_prime, q_beam)
    outputs = [candidates[pos] for pos in accepted]
    if len(accepted) == width:
        return LayerVerdict(accepted, outputs, True)
    outputs.append(int(inverse_cdf(p_prime, torch.tensor(uniforms()))))
    while len(outputs) < width:
        outputs.append(int(inverse_cdf(p_beam, torch.tensor(uniforms()))))
    return LayerVerdict(accepted, outputs, False)


# -- decoding loops over small protocols --------------------------------------------------------


class ForestTarget(Protocol):
    """The target model's side (pipeline.engines.adapters.TreeSession): rows = beams, each row's
    cache holds its beam except the last token, which is the root of the row's next tree."""

    def open(self, prompt: list[int]) -> None:
        """One row: the prompt minus its last token in the cache."""

    def verify(self, trees: list) -> torch.Tensor:
        """One forward pass over a TokenTree per row; returns log-probs [B, N, V] after each node."""

    def commit(self, sources: list[tuple[int, list[int]]]) -> None:
        """New rows: (old row, accepted node path) each (pipeline.engines.tree.commit_paths)."""

    @property
    def forward_passes(self) -> int: ...


@dataclass
class Beam:
    tokens: list[int]
    """Generated tokens (prompt excluded); the last one is not yet in the target's cache. After an
    EOS only padding EOS follow (see the module docstring)."""
    logp: float
    """log p(tokens | prompt) under the target (unwarped), up to and including the first EOS."""
    ended_at: int | None = None
    """Length of the response up to and including its first EOS; None while the beam is open."""

    @property
    def length(self) -> int:
        """Tokens the beam's likelihood covers: up to its EOS, or all of them while it is open."""
        return self.ended_at if self.ended_at is not None else len(self.tokens)


def perplexity_rank(beam: Beam) -> float:
    """Higher is better: the mean target log-likelihood per token (minus log perplexity)."""
    return beam.logp / max(1, beam.length)


def absorb_ended(next_logp: torch.Tensor, beams: list[Beam], eos_ids: set[int]) -> torch.Tensor:
    """The target's next-token log-probs [len(beams), V] with each ended beam's row replaced by
    certainty of one more EOS (the smallest EOS id): an ended beam stays as it is."""
    ended = [i for i, b in enumerate(beams) if b.ended_at is not None]
    if not ended:
        return next_logp
    out = next_logp.clone()
    out[ended] = -torch.inf
    out[ended, min(eos_ids)] = 0.0
    return out


@dataclass
class DecodeStats:
    target_forwards: int = 0
    steps: int = 0
    """Generated positions (beam-sampling steps)."""
    beam_steps: int = 0
    """Sum over steps of the number of beams at that step (for the average accepted width)."""
    drafted: int = 0
    draft_layers_accepted: int = 0
    iterations: int = 0
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"target_forwards": self.target_forwards, "steps": self.steps, "beam_steps": self.beam_steps,
                "drafted_tokens": self.drafted, "draft_layers_accepted": self.draft_layers_accepted,
                "iterations": self.iterations}


def _uniforms(generator: torch.Generator):
    return lambda: float(torch.rand((), generator=generator))


def _best(beams: list[Beam]) -> Beam:
    """The lowest-perplexity beam; ties: the first."""
    return max(beams, key=perplexity_rank)


def _all_ended(beams: list[Beam]) -> bool:
    return all(b.ended_at is not None for b in beams)


def _finish(beams: list[Beam], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The lowest-perplexity final beam as the response (its tokens before its EOS)."""
    return cut_response(_best(beams).tokens, max_new_tokens, eos_ids)


def extend_beams(parents: list[Beam], next_logp: torch.Tensor, picks: list[int],
                 eos_ids: set[int] = frozenset()) -> list[Beam]:
    """The beams of flat p_beam indices ``picks`` (parent * V + token, Eq. 1): parent plus token,
    its target log-likelihood raised by log p(token | parent) (0 after an ended parent:
    ``absorb_ended``). A token in ``eos_ids`` ends an open beam. next_logp: [len(parents), V]."""
    vocab = next_logp.shape[-1]
    out = []
    for x in picks:
        parent, token = parents[x // vocab], x % vocab
        tokens = parent.tokens + [token]
        ended_at = parent.ended_at if parent.ended_at is not None else (len(tokens) if token in eos_ids else None)
        out.append(Beam(tokens, parent.logp + float(next_logp[x // vocab, token]), ended_at))
    return out


def beam_sampling(target: ForestTarget, prompt: list[int], width: int, sampling: SamplingParams, seed: int,
                  eos_ids: set[int] = frozenset(), stats: DecodeStats | None = None) -> list[int]:
    """Beam sampling (paper section 2.1): W beams drawn iid from p_beam at every step, one target
    forward per step. Width 1 is multinomial sampling. A beam ends at EOS, decoding stops when
    all have, and the answer is the lowest-perplexity beam (module docstring)."""

    stats = stats if stats is not None else DecodeStats()
    g = torch.Generator().manual_seed(seed)
    u = _uniforms(g)
    target.open(prompt)
    beams = [Beam([], 0.0)]
    pending = [prompt[-1]]
    while len(beams[0].tokens) < sampling.max_new_tokens and not _all_ended(beams):
        logp = absorb_ended(target.verify([TokenTree([t], [-1]) for t in pending])[:, 0], beams, eos_ids)  # [W, V]
        stats.target_forwards += 1
        vocab = logp.shape[-1]
        p = beam_distribution(torch.tensor([b.logp for b in beams]), logp, sampling)
        picks = [int(inverse_cdf(p, torch.tensor(u()))) for _ in range(width)]
        beams = extend_beams(beams, logp, picks, eos_ids)
        target.commit([(x // vocab, [0]) for x in picks])
        pending = [b.tokens[-1] for b in beams]
        stats.steps += 1
        stats.beam_steps += len(beams)
    return _finish(beams, sampling.max_new_tokens, eos_ids)


# -- DSBD, one step of Algorithm 1 per function ------------------------------------------------


@dataclass
class DraftForest:
    """The draft forest of section 3.3: the drafter's gamma layers arranged as one token tree per
    input beam, so that the target verifies every tree in one forward pass."""

    layers: list[DraftLayer]
    """Forest layers 1..gamma as the drafter returned them (each node's parent indexes the layer above)."""
    trees: list[TokenTree]
    """Tree b: input beam b's last token (its root, not yet in the target's cache) and its draft descendants."""
    where: list[list[tuple[int, int]]]
    """where[l][i]: (tree, node) of node i of forest layer l; layer 0 holds the input beams' roots."""


@dataclass
class ForestVerdict:
    """Algorithm 1's answer (line 35): the output beams of layer l_last, each a (parent, token) pair
    whose token is not yet in the target's cache."""

    parent_nodes: list[tuple[int, int]]
    """(tree, node) of each accepted beam of layer l_last - 1: the output beams' possible parents."""
    parent_beams: list[Beam]
    """Those parents as beams."""
    parent_logp: torch.Tensor
    """[len(parent_beams), V]: the target's next-token log-probs after each parent."""
    outputs: list[int]
    """Flat (parent * V + token) p_beam indices of the output beams."""


def build_forest(contexts: list[list[int]], layers: list[DraftLayer]) -> DraftForest:
    """Section 3.3 (Figure 3): hang draft layer l's nodes under their parents in layer l - 1, tree b
    rooted at input beam b, so a forward pass over the trees (topology-aware mask) gives the target's
    next-token distribution after every node of every layer: Algorithm 1's input."""
    tokens = [[c[-1]] for c in contexts]
    parents = [[-1] for _ in contexts]
    where = [[(b, 0) for b in range(len(contexts))]]
    for layer in layers:
        here = []
        for parent, token in zip(layer.parents, layer.tokens):
            tree, node = where[-1][parent]
            here.append((tree, len(tokens[tree])))
            tokens[tree].append(token)
            parents[tree].append(node)
        where.append(here)
    return DraftForest(layers, [TokenTree(t, p) for t, p in zip(tokens, parents)], where)


def target_p_beam(logp: torch.Tensor, nodes: list[tuple[int, int]], beams: list[Beam],
                  sampling: SamplingParams, eos_ids: set[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 line 11 (and 32): p_beam^(l) (Eq. 1) over (beam, next token) for the beams at
    forest positions ``nodes``. logp: [W_L, N, V] from the forest pass. Returns the next-token
    log-probs [|A|, V] (an ended beam's: one more EOS, ``absorb_ended``) and p_beam [|A| * V]."""
    next_logp = absorb_ended(torch.stack([logp[n] for n in nodes]), beams, eos_ids)  # [|A|, V]
    return next_logp, beam_distribution(torch.tensor([b.logp for b in beams]), next_logp, sampling)


def surviving_drafts(layer: DraftLayer, accepted: list[int], vocab: int,
                     device: torch.device) -> tuple[list[int], list[int], torch.Tensor]:
    """Algorithm 1 line 10: the draft beams of ``layer`` whose parent (a node of the layer above)
    is in ``accepted``. Returns their positions in the layer, their flat (slot * V + token) indices
    with slot the parent's place in ``accepted``, and q_beam [|accepted| * V] restricted to the
    accepted parents and renormalised: the survivors are iid draws from that conditional."""
    q_beam = layer.q_beam.to(device).reshape(-1, vocab)[accepted].reshape(-1).float()
    q_beam = q_beam / q_beam.sum().clamp(min=1e-30)
    slot = {n: s for s, n in enumerate(accepted)}
    survivors = [i for i, par in enumerate(layer.parents) if par in slot]
    candidates = [slot[layer.parents[i]] * vocab + layer.tokens[i] for i in survivors]
    return survivors, candidates, q_beam


def draft_depth(num_draft_layers: int, room: int) -> int:
    """gamma for an iteration that starts ``room`` positions short of max_new_tokens. When every
    draft layer passes, Algorithm 1 (lines 31-33) samples one more layer, so an iteration emits up
    to gamma + 1 positions: gamma <= room - 1 keeps every beam within the cap, and the final beams
    are ranked (``_finish``) at exactly max_new_tokens tokens, as beam sampling ranks them. (Drafting
    ``room`` layers would make beams of max_new_tokens + 1 tokens, ranked by a likelihood that
    includes a token the response then drops: a different output distribution.) With one position
    left gamma is 0: the forest is the input beams alone and the iteration is lines 31-33 only,
    one beam-sampling step."""
    return max(0, min(num_draft_layers, room - 1))


def verify_forest(forest: DraftForest, logp: torch.Tensor, beams: list[Beam], params: DSBDParams,
                  sampling: SamplingParams, fixed_width: int | None, uniforms, stats: DecodeStats,
                  eos_ids: set[int] = frozenset()) -> ForestVerdict:
    """Algorithm 1 lines 3-33 over the forest's target log-probs ``logp`` [W_L, N, V]: layer by layer,
    drop the drafts of rejected parents (line 10), set W_L^(l) by Eq. 6 (line 13; ``fixed_width``:
    a constant W_L) and verify (lines 12-30, verify_layer); stop at the first layer that fails. If
    every draft layer passes, sample the extra layer from p_beam^(gamma + 1) (lines 31-33): W_L beams,
    W_L the last layer's width (the input beams' count when gamma is 0)."""
    vocab = logp.shape[-1]
    if forest.layers and forest.layers[0].q_beam.numel() != len(beams) * vocab:
        raise ValueError(f"draft and target vocabularies differ: the draft's q_beam has "
                         f"{forest.layers[0].q_beam.numel() // len(beams)} tokens per beam, the target {vocab}")
    accepted = list(range(len(beams)))  # accepted nodes of forest layer l - 1 (layer 0: the input beams)
    accepted_beams = beams
    width = fixed_width or len(beams)
    for l, layer in enumerate(forest.layers, start=1):
        nodes = [forest.where[l - 1][n] for n in accepted]
        next_logp, p_beam = target_p_beam(logp, nodes, accepted_beams, sampling, eos_ids)
        survivors, candidates, q_beam = surviving_drafts(layer, accepted, vocab, logp.device)
        if fixed_width is None:
            width = dynamic_width(acceptance_chain(p_beam, q_beam, len(candidates)), params.acceptance_threshold,
                                  params.min_width)
        verdict = verify_layer(p_beam, q_beam, candidates, width, uniforms)
        if not verdict.passed:
            return ForestVerdict(nodes, accepted_beams, next_logp, verdict.outputs)
        stats.draft_layers_accepted += 1
        accepted = [survivors[pos] for pos in verdict.accepted]
        accepted_beams = extend_beams(accepted_beams, next_logp, [candidates[pos] for pos in verdict.accepted], eos_ids)
        stats.steps += 1
        stats.beam_steps += len(accepted)
    nodes = [forest.where[-1][n] for n in accepted]
    next_logp, p_beam = target_p_beam(logp, nodes, accepted_beams, sampling, eos_ids)
    return ForestVerdict(nodes, accepted_beams, next_logp,
                         [int(inverse_cdf(p_beam, torch.tensor(uniforms()))) for _ in range(width)])


def emit_beams(forest: DraftForest, verdict: ForestVerdict, memory_mode: bool,
               stats: DecodeStats, eos_ids: set[int] = frozenset()) -> tuple[list[Beam], list[tuple[int, list[int]]]]:
    """Algorithm 1 line 35: the output beams, the next iteration's input beams, with the KV path
    each keeps (section 3.3: its parent's tree and the path to the parent; its own token is the
    root of its next tree). Memory mode (section 3.4) keeps only the lowest-perplexity beam."""
    vocab = verdict.parent_logp.shape[-1]
    out = extend_beams(verdict.parent_beams, verdict.parent_logp, verdict.outputs, eos_ids)
    sources = []
    for x in verdict.outputs:
        tree, node = verdict.parent_nodes[x // vocab]
        sources.append((tree, forest.trees[tree].path_to(node)))
    stats.steps += 1
    stats.beam_steps += len(out)
    if memory_mode:  # one input beam (one KV cache row) for the next iteration
        best = max(range(len(out)), key=lambda i: perplexity_rank(out[i]))
        out, sources = [out[best]], [sources[best]]
    return out, sources


def dsbd_decode(target: ForestTarget, drafter: Drafter, prompt: list[int], params: DSBDParams,
                sampling: SamplingParams, seed: int, eos_ids: set[int] = frozenset(),
                stats: DecodeStats | None = None, fixed_width: int | None = None) -> list[int]:
    """DSBD for one prompt: per iteration, draft gamma layers (``draft_depth``: room is left for
    the extra layer of lines 31-33, so no beam outgrows max_new_tokens), build the forest, verify it
    in one target pass (Algorithm 1 with Eq. 2-7 widths, section 3.3), emit the output beams and cut
    the target's cache to their paths (optional memory mode, section 3.4). ``fixed_width`` replaces
    Eq. 6 with a constant W_L (the paper's section 3.1 scheme; with draft_width 1 and fixed_width 1
    this is exactly Leviathan et al.'s speculative decoding)."""

    stats = stats if stats is not None else DecodeStats()
    g = torch.Generator().manual_seed(seed)
    u = _uniforms(g)
    target.open(prompt)
    beams = [Beam([], 0.0)]
    while len(beams[0].tokens) < sampling.max_new_tokens and not _all_ended(beams):
        stats.iterations += 1
        contexts = [prompt + b.tokens for b in beams]
        gamma = draft_depth(params.num_draft_layers, sampling.max_new_tokens - len(beams[0].tokens))
        layers = drafter.draft(contexts, [b.logp for b in beams], params.draft_width, gamma, sampling,
                               int(torch.randint(0, 2**62, (), generator=g))) if gamma else []
        stats.drafted += sum(len(layer.tokens) for layer in layers)
        forest = build_forest(contexts, layers)
        logp = target.verify(forest.trees)  # [W_L, N, V]
        stats.target_forwards += 1
        verdict = verify_forest(forest, logp, beams, params, sampling, fixed_width, u, stats, eos_ids)
        beams, sources = emit_beams(forest, verdict, params.memory_mode, stats, eos_ids)
        target.commit(sources)
    return _finish(beams, sampling.max_new_tokens, eos_ids)


# -- the model-side method ------------------------------------------------------------------


class DSBDHost(Protocol):
    """What DSBD's model-side search needs of the generator's engine
    (pipeline.engines.adapters.HFSearchHost)."""

    eos_ids: set[int]
    vocab_size: int
    drafter: Drafter | None
    """The configured draft model (in-process or a DraftActor proxy); None: ADED drafts."""

    def forest_target(self) -> ForestTarget: ...

    def load_trigram(self, path: str, top_t: int): ...

    def remember(self, key: tuple, make): ...

    def decode(self, token_lists: list[list[int]]) -> list[str]: ...


def search(host: DSBDHost, prompts: list[list[int]], num_samples: int, seeds: list[int], sampling: SamplingParams,
           params: DSBDParams) -> list[SearchOutput]:
    """Model-side ``dsbd``: each candidate is one DSBD generation seeded by its row seed. With no
    draft model (``host.drafter`` None), ADED drafts: an ADEDLayerDrafter over a tri-gram matrix
    that starts as ``params.trigram`` (or empty), made once per engine. It is reset to that start
    for every prompt and adapts over that prompt's rows (ADED appendix Algorithm 2), so what a
    prompt's candidates are depends only on the prompt and its row seeds, never on the prompts that
    share its batch (or on sharding and resumption)."""
    drafter = host.drafter
    if drafter is None:
        drafter = host.remember(("dsbd-aded-drafter", params.trigram), lambda: ADEDLayerDrafter(
            ADEDDrafter(host.load_trigram(params.trigram, 12)), host.vocab_size))
    eos = set() if sampling.ignore_eos else set(host.eos_ids)
    outputs = []
    for i, prompt in enumerate(prompts):
        if isinstance(drafter, ADEDLayerDrafter):
            drafter.reset()  # every prompt starts from the same matrix
        rows, total = [], DecodeStats()
        for s in range(num_samples):
            row = i * num_samples + s
            tokens = dsbd_decode(host.forest_target(), drafter, prompt, params, sampling, seeds[row], eos, total)
            rows.append(RowState(row=row, token_ids=tokens, text=host.decode([tokens])[0], finished=True))
        outputs.append(SearchOutput(rows=rows, generated_tokens=total.beam_steps + total.drafted, stats=total.as_dict()))
    return outputs
