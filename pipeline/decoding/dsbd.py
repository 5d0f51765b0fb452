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
- A response ends at its first EOS; beams run to max_new_tokens (beam sampling and DSBD alike)
  and the candidate is the final beam with the lowest perplexity (highest target likelihood).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from pipeline.errors import ConfigError
from pipeline.decoding.aded import ADEDDrafter, ADEDLayerDrafter
from pipeline.decoding.protocols import Drafter, DraftLayer, RowState, SearchOutput
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
    """Generated tokens (prompt excluded); the last one is not yet in the target's cache."""
    logp: float
    """log p(tokens | prompt) under the target (unwarped)."""


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
    return max(beams, key=lambda b: b.logp)


def _finish(beams: list[Beam], max_new_tokens: int, eos_ids: set[int]) -> list[int]:
    """The lowest-perplexity final beam (all have one length) as the response."""
    return cut_response(_best(beams).tokens, max_new_tokens, eos_ids)


def beam_sampling(target: ForestTarget, prompt: list[int], width: int, sampling: SamplingParams, seed: int,
                  eos_ids: set[int] = frozenset(), stats: DecodeStats | None = None) -> list[int]:
    """Beam sampling (paper section 2.1): W beams drawn iid from p_beam at every step, one target
    forward per step. Width 1 is multinomial sampling."""

    stats = stats if stats is not None else DecodeStats()
    g = torch.Generator().manual_seed(seed)
    u = _uniforms(g)
    target.open(prompt)
    beams = [Beam([], 0.0)]
    pending = [prompt[-1]]
    while len(beams[0].tokens) < sampling.max_new_tokens:
        logp = target.verify([TokenTree([t], [-1]) for t in pending])[:, 0]  # [W, V]
        stats.target_forwards += 1
        vocab = logp.shape[-1]
        p = beam_distribution(torch.tensor([b.logp for b in beams]), logp, sampling)
        picks = [int(inverse_cdf(p, torch.tensor(u()))) for _ in range(width)]
        beams = [Beam(beams[x // vocab].tokens + [x % vocab], beams[x // vocab].logp + float(logp[x // vocab, x % vocab]))
                 for x in picks]
        target.commit([(x // vocab, [0]) for x in picks])
        pending = [b.tokens[-1] for b in beams]
        stats.steps += 1
        stats.beam_steps += len(beams)
    return _finish(beams, sampling.max_new_tokens, eos_ids)


def dsbd_decode(target: ForestTarget, drafter: Drafter, prompt: list[int], params: DSBDParams,
                sampling: SamplingParams, seed: int, eos_ids: set[int] = frozenset(),
                stats: DecodeStats | None = None, fixed_width: int | None = None) -> list[int]:
    """DSBD for one prompt (Algorithm 1 per iteration, Eq. 2-7 widths, forest verification in one
    target pass, optional memory mode). ``fixed_width`` replaces Eq. 6 with a constant W_L
    (the paper's section 3.1 scheme; with draft_width 1 and fixed_width 1 this is exactly
    Leviathan et al.'s speculative decoding)."""

    stats = stats if stats is not None else DecodeStats()
    g = torch.Generator().manual_seed(seed)
    u = _uniforms(g)
    target.open(prompt)
    beams = [Beam([], 0.0)]
    while len(beams[0].tokens) < sampling.max_new_tokens:
        stats.iterations += 1
        contexts = [prompt + b.tokens for b in beams]
        gamma = min(params.num_draft_layers, sampling.max_new_tokens - len(beams[0].tokens))
        layers: list[DraftLayer] = drafter.draft(contexts, [b.logp for b in beams], params.draft_width, gamma,
                                                 sampling, int(torch.randint(0, 2**62, (), generator=g)))
        stats.drafted += sum(len(layer.tokens) for layer in layers)
        # Forest: tree b is input beam b's last token (root) and its draft descendants.
        tokens = [[c[-1]] for c in contexts]
        parents = [[-1] for _ in contexts]
        where = [[(b, 0) for b in range(len(beams))]]  # where[l][i]: (tree, node) of node i of layer l
        for layer in layers:
            here = []
            for parent, token in zip(layer.parents, layer.tokens):
                tree, node = where[-1][parent]
                here.append((tree, len(tokens[tree])))
                tokens[tree].append(token)
                parents[tree].append(node)
            where.append(here)
        logp = target.verify([TokenTree(t, p) for t, p in zip(tokens, parents)])  # [W_L, N, V]
        stats.target_forwards += 1
        vocab = logp.shape[-1]
        if layers[0].q_beam.numel() != len(beams) * vocab:
            raise ValueError(f"draft and target vocabularies differ: the draft's q_beam has "
                             f"{layers[0].q_beam.numel() // len(beams)} tokens per beam, the target {vocab}")

        # Layer by layer. ``alive``: accepted nodes of the previous layer, with their beams.
        alive = list(range(len(beams)))  # node indices into layer l-1 (layer 0 = input beams)
        alive_beams = beams
        width = fixed_width or len(beams)
        out_parents, out_flat, out_layer = None, None, None
        for l, layer in enumerate(layers, start=1):
            next_logp = torch.stack([logp[where[l - 1][n]] for n in alive])  # [|A|, V]
            p_beam = beam_distribution(torch.tensor([b.logp for b in alive_beams]), next_logp, sampling)
            q_all = layer.q_beam.to(logp.device).reshape(-1, vocab)
            q_beam = q_all[alive].reshape(-1).float()
            q_beam = q_beam / q_beam.sum().clamp(min=1e-30)  # conditioned on surviving parents
            slot = {n: s for s, n in enumerate(alive)}
            survivors = [i for i, par in enumerate(layer.parents) if par in slot]
            candidates = [slot[layer.parents[i]] * vocab + layer.tokens[i] for i in survivors]
            if fixed_width is None:
                width = dynamic_width(acceptance_chain(p_beam, q_beam, len(candidates)), params.acceptance_threshold,
                                      params.min_width)
            verdict = verify_layer(p_beam, q_beam, candidates, width, u)
            if verdict.passed:
                stats.draft_layers_accepted += 1
                alive = [survivors[pos] for pos in verdict.accepted]
                alive_beams = [Beam(alive_beams[slot[layer.parents[i]]].tokens + [layer.tokens[i]],
                                    alive_beams[slot[layer.parents[i]]].logp
                                    + float(next_logp[slot[layer.parents[i]], layer.tokens[i]])) for i in alive]
                stats.steps += 1
                stats.beam_steps += len(alive)
                continue
            out_parents, out_flat, out_layer = alive, verdict.outputs, l - 1
            break
        if out_flat is None:  # every draft layer passed: an extra layer from p_beam^(gamma + 1)
            next_logp = torch.stack([logp[where[-1][n]] for n in alive])
            p_beam = beam_distribution(torch.tensor([b.logp for b in alive_beams]), next_logp, sampling)
            out_parents, out_layer = alive, len(layers)
            out_flat = [int(inverse_cdf(p_beam, torch.tensor(u()))) for _ in range(width)]
        else:
            next_logp = torch.stack([logp[where[out_layer][n]] for n in out_parents])
        # Output beams: parent (a node of layer out_layer) plus a new token not yet in the cache.
        new_beams, sources = [], []
        for x in out_flat:
            s, token = x // vocab, x % vocab
            parent = alive_beams[s]
            new_beams.append(Beam(parent.tokens + [token], parent.logp + float(next_logp[s, token])))
            tree, node = where[out_layer][out_parents[s]]
            sources.append((tree, TokenTree(tokens[tree], parents[tree]).path_to(node)))
        stats.steps += 1
        stats.beam_steps += len(new_beams)
        if params.memory_mode:  # section 3.4: one input beam (one KV cache row) for the next iteration
            best = max(range(len(new_beams)), key=lambda i: new_beams[i].logp)
            new_beams, sources = [new_beams[best]], [sources[best]]
        target.commit(sources)
        beams = new_beams
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
    that starts as ``params.trigram`` (or empty), kept by the engine, and reset to that start at
    every call so that a batch's output depends only on its prompts and seeds."""
    drafter = host.drafter
    if drafter is None:
        drafter = host.remember(("dsbd-aded-drafter", params.trigram), lambda: ADEDLayerDrafter(
            ADEDDrafter(host.load_trigram(params.trigram, 12)), host.vocab_size))
    if isinstance(drafter, ADEDLayerDrafter):
        drafter.reset()  # each batch starts from the same matrix: reproducible, resumable
    eos = set() if sampling.ignore_eos else set(host.eos_ids)
    outputs = []
    for i, prompt in enumerate(prompts):
        rows, total = [], DecodeStats()
        for s in range(num_samples):
            row = i * num_samples + s
            tokens = dsbd_decode(host.forest_target(), drafter, prompt, params, sampling, seeds[row], eos, total)
            rows.append(RowState(row=row, token_ids=tokens, text=host.decode([tokens])[0], finished=True))
        outputs.append(SearchOutput(rows=rows, generated_tokens=total.beam_steps + total.drafted, stats=total.as_dict()))
    return outputs
