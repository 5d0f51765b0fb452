"""The small interfaces the decoding algorithms see. Engines, Ray actor proxies and test fakes
all satisfy them, so the same algorithm code runs in unit tests, in-process, and on a cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Protocol

from pipeline.decoding.sampling import SamplingParams


@dataclass
class RowState:
    """One candidate row as the generator reports it after a decoding call."""

    row: int
    """Row id inside its session: prompt index * num_samples + sample index."""
    token_ids: list[int]
    """All response tokens so far (no prompt, EOS excluded)."""
    text: str
    """The decoded response so far, special tokens removed."""
    finished: bool
    """True once the row emitted EOS or reached max_new_tokens."""
    reward: float | None = None
    """The generator's own reward for the row so far, from a session opened with ``rewards=True``
    on a Reward Transformer (SLA's reward channel, R'(x_{<=t}), read in the decoding pass): R' at
    the last token the model has read, which is the prompt plus every response token but the newest
    (the newest is sampled from that pass and read by the next). A row that ended with EOS has been
    read whole, so its reward is R' of its full response. None: the session did not ask for it."""


@dataclass
class PromptInput:
    """A prompt ready for generation."""

    prompt_id: str
    text: str
    """The text the generator is conditioned on (chat template applied when used)."""
    raw_prompt: str
    """The prompt as it appeared in the input (a conversation: its JSON text)."""
    token_ids: list[int]
    messages: list[dict] | None = None
    """The conversation ({"role", "content"} messages, system turns included) when the input row
    held one instead of a string."""
    columns: dict = field(default_factory=dict)
    """The input row's other columns (data.extra_columns), by name: a reward function gets them
    (Scorer.score ``columns``) and the output keeps them beside the pair."""

    @property
    def reward_input(self) -> str | list[dict]:
        """What the reward model reads before the response: the conversation, or the raw prompt."""
        return self.messages if self.messages is not None else self.raw_prompt


@dataclass
class Candidate:
    sample: int
    token_ids: list[int]
    text: str
    score: float = math.nan
    """Final reward if completed; the partial reward at the stop if stopped early; NaN if failed."""
    completed: bool = False
    """Generated to EOS or max_new_tokens."""
    stopped_early: bool = False
    """Terminated by speculative rejection at a decision token."""
    stopped_at: int | None = None
    """Decision token at which it was stopped."""
    partials: dict = field(default_factory=dict)
    """Speculative rejection: its partial reward at each decision token it was live at (tau -> reward)."""
    components: list[float] = field(default_factory=list)
    """Each reward's score from the call that gave ``score`` (``components_of``): a composite reward's,
    in models.reward's order, NaN for one the sum left out (so ``score`` is the weighted sum of the
    finite ones); one reward's, its score. Empty: not scored yet. The output's chosen_scores and
    rejected_scores."""

    @property
    def failed(self) -> bool:
        return not math.isfinite(self.score)


@dataclass
class PromptResult:
    prompt: PromptInput
    candidates: list[Candidate]
    generated_tokens: int = 0
    """Tokens this prompt cost."""
    bon_equivalent_tokens: int = 0
    """Tokens plain Best-of-N would have generated for the same candidates (estimate for stopped ones)."""
    stats: dict = field(default_factory=dict)


@dataclass
class SearchOutput:
    """One prompt's result from a model-side method (see Generator.search)."""

    rows: list[RowState]
    """Exactly num_samples candidates; row ids are prompt index * num_samples + sample index."""
    generated_tokens: int
    """Tokens the method decoded for this prompt, drafts and explored branches included (its cost)."""
    stats: dict = field(default_factory=dict)
    """Method counters (forward passes, expansions, accepted lengths, ...), summed into the manifest."""


class Generator(Protocol):
    """A stateful batched decoder: a session holds the KV cache of its rows between calls."""

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams, rewards: bool = False) -> None:
        """Prefill each prompt once and fan it out to num_samples rows, one seed per row.
        ``rewards``: report each row's RowState.reward, the generator's own reward channel read in
        the same forward passes; an engine whose model has no channel refuses it (ValueError).
        Callers pass it only when true, so generators without the keyword serve everything else."""

    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]:
        """Drop rows not in ``keep`` (from the batch and the KV cache), then decode the rest until
        each has ``until`` tokens or is finished. Returns the kept rows' states."""

    def close(self, session: str) -> dict:
        """Free the session; returns its counters (generated_tokens, forward_passes), and, from an
        engine whose rows decode on while the caller scores them (continuous vLLM),
        ``unreported_tokens``: per prompt, tokens decoded that no returned RowState holds (the
        caller adds them to the prompt's cost)."""

    def capacity(self, prompts: list[list[int]], until: int) -> int:
        """Rows per prompt whose KV up to ``until`` generated tokens the engine's cache holds, each
        prompt's shared blocks once (memory-budget speculative rejection's ``initial_candidates:
        auto``). Only engines with a paged KV cache have it (the HF engine)."""

    def search(self, search: Callable[..., list[SearchOutput]], prompts: list[list[int]], num_samples: int,
               seeds: list[int], sampling: SamplingParams, params: object) -> list[SearchOutput]:
        """Run a model-side strategy's ``search`` function (its pipeline.strategies record's) wholly
        inside the generator's process, where the model and its KV caches are: tree searches and
        speculative decoding make many small model calls, too many for a round trip each. The
        function comes with the call; the engine looks nothing up. One SearchOutput per prompt."""


def check_open(open_sessions, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int]) -> None:
    """The arguments of ``Generator.open`` every engine refuses: a session id in use, a seed count
    other than one per row, an empty prompt list or prompt."""
    if session in open_sessions:
        raise ValueError(f"session {session} is already open")
    if len(seeds) != len(prompts) * num_samples:
        raise ValueError(f"need {len(prompts) * num_samples} seeds, got {len(seeds)}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")


class Scores(list):
    """What a scorer of several rewards returns from ``score`` and ``extend``: the scores, a list of
    floats as any scorer returns, with ``components``, per response each reward's score from the same
    call (pipeline.engines.rewards.CompositeScorer: NaN for a reward its sum left out), and ``ranks``,
    per response the value a decision in this call ranks it by: its score, except for a finished
    response whose prompt also has partial responses in the call, whose rank sums only the rewards
    those partial responses' scores sum, so that a decision token compares like with like
    (pipeline.engines.rewards.combine). It crosses Ray as itself (pickled, with its components and
    ranks). A scorer of one reward returns a plain list."""

    def __init__(self, scores: list[float], components: list[list[float]], ranks: list[float] | None = None):
        super().__init__(scores)
        if len(components) != len(scores):
            raise ValueError(f"{len(components)} component lists for {len(scores)} scores")
        if ranks is not None and len(ranks) != len(scores):
            raise ValueError(f"{len(ranks)} ranks for {len(scores)} scores")
        self.components = [list(c) for c in components]
        self.ranks = list(scores) if ranks is None else list(ranks)


def components_of(scores: list[float]) -> list[list[float]]:
    """Per response, the scores ``scores`` sums: a Scores' components, else each score alone (one reward)."""
    components = getattr(scores, "components", None)
    return [list(c) for c in components] if components is not None else [[s] for s in scores]


def ranks_of(scores: list[float]) -> list[float]:
    """Per response, the value a decision in this call ranks it by: a Scores' ranks, else the scores
    themselves (one reward: a finished response and a partial one are scored alike)."""
    ranks = getattr(scores, "ranks", None)
    return list(ranks) if ranks is not None else list(scores)


class Scorer(Protocol):
    def score(self, prompts: list[str | list[dict]], responses: list[str], finished: list[bool] | None = None,
              columns: list[dict] | None = None) -> list[float]:
        """Reward of each (prompt, response) pair; NaN marks no score, never 0 (a failed final score;
        no signal for a partial response, see speculative_rejection). A prompt is
        a string or a conversation (PromptInput.reward_input). ``finished``: per response, whether it
        is final (EOS or max_new_tokens) rather than partial; None: all final. ``columns``: per
        response, its input row's other columns (PromptInput.columns). A reward model reads neither;
        a reward function (pipeline.engines.rewards.FunctionScorer) gets both. A scorer of several
        rewards returns Scores, which also holds each reward's score (``components_of``)."""


@dataclass
class DraftLayer:
    """One layer of a draft forest (DSBD Fig. 2a): ``width`` nodes beam-sampled from the previous layer."""

    parents: list[int]
    """Index of each node's parent in the previous layer (layer 1: in the list of contexts)."""
    tokens: list[int]
    """Each node's token."""
    q_beam: object
    """Tensor [num_parents * V]: the (warped) joint distribution over (parent, token) that the nodes
    were drawn from, iid; flat index parent * V + token. One-hot rows for a deterministic drafter."""


class Drafter(Protocol):
    """Proposes a draft forest for speculative verification: a draft model (pipeline.engines.draft)
    or a model-free drafter such as ADED. Speculative decoding is the case of one context, width 1."""

    def draft(self, contexts: list[list[int]], prefix_logp: list[float], width: int, depth: int,
              sampling: SamplingParams, seed: int) -> list[DraftLayer]:
        """Beam-sample ``depth`` layers of ``width`` nodes from the ``contexts`` (full token ids,
        prompt included), weighting context i by exp(prefix_logp[i]); ``seed`` makes it reproducible."""


class StreamingScorer(Scorer, Protocol):
    """A Scorer with sessions that mirror the Generator's: the reward model keeps a KV cache per
    candidate row, so a partial reward costs only the tokens that are new since the last call
    (pipeline.engines.rewards.RewardScorer; encoder reward models re-score in full behind it)."""

    def open(self, session: str, prompts: list[str | list[dict]], num_samples: int,
             columns: list[dict] | None = None) -> None:
        """Start a session whose rows are prompt index * num_samples + sample (the generator's ids);
        ``columns``: each prompt's other input columns (see Scorer.score)."""

    def extend(self, session: str, rows: list[int], responses: list[str],
               finished: list[bool] | None = None) -> list[float]:
        """Reward of each listed row's (prompt, response so far); unlisted rows leave the cache.
        ``finished``: as in Scorer.score."""

    def close(self, session: str) -> dict:
        """Free the session; returns its counters (tokens_read)."""
