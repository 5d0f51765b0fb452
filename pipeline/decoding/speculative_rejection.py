"""Speculative rejection (Speculative Best-of-N), Algorithm 1 of
"Accelerating Best-of-N via Speculative Rejection" (Sun et al., 2024).

Terms (paper section 5):
- N candidates Y_1..Y_N are sampled for a prompt X up to the decision token tau
  (tau_k = min(tau, l_k): a sequence that hits EOS earlier stops there).
- Partial rewards R_partial = {s(Y_k^{<=tau_k})} (Eq. 2) come from the reward model s on
  prompt plus partial response.
- The cutoff r_cut = q_alpha(R_partial) is the alpha lower quantile of the partial rewards
  (Eq. 3), alpha = ``rejection_rate``.
- I_accepted = {k : s(Y_k^{<=tau_k}) >= r_cut} (Eq. 4) keep generating to EOS or the length
  cap; the others stop. Sequences that ended before tau are kept unchanged.
- The output is argmax over I_accepted of the final reward s(Y_k).
- For preference pairs the worst response matters too: with ``keep_lowest`` (on by default) each
  prompt's lowest-ranked live candidate also goes on at every decision token, so the pair's
  rejected side is a complete response with a final reward (our addition; the paper only needs
  the best).

The quantile follows the authors' public code: rank the candidates by partial reward and keep
the top ``round((1 - alpha) * n)`` of them (at least one), so r_cut is the score of the last
kept one; ties with r_cut are also kept, as Eq. 4's ">=" says. With alpha = 0 every candidate
is kept and the result equals Best-of-N's for the same seeds.

``decision_token`` may be a list: rejection then happens at each point in turn, ranking the
candidates still in play (the paper's "multiple decision tokens" direction, section 7).

Absent partial rewards: a scorer may have nothing to say about a partial response (a reward
function returning None, TRL's "no reward for this one", NaN or inf: the scorer reports NaN). Such
a row has no signal at that decision token, so it is never stopped there: it stays live and stays
out of everything that ranks rows (the quantile r_cut, keep_lowest's floor, the adaptive fit, the
memory budget's ranking), and is ranked again at the next decision token, if any. A row stopped
early therefore always has a finite partial reward. Only a non-finite *final* reward fails a
candidate (Candidate.failed; the build quarantines it).

Composite rewards compare like with like: R_partial ranks a row that ended before tau on the rewards
its prompt's partial responses are scored on there, not on its full weighted sum
(pipeline.engines.rewards.combine, the scorer's Scores.ranks), so s in Eq. 2 to 4 is one function
for every row of the prompt. A reward that says nothing about prefixes (None) yet scores finished
responses high would otherwise lift r_cut by a term no live row can have. The row's score, what the
output records, stays its full sum. With one reward the rank is the score.

Self-speculative rejection (``partial_reward: generator``): when the generator is a Reward Transformer
("Streaming Looking Ahead with Token-level Self-reward", Zhang et al., 2025, section 4.2, Eq. 13-16),
its reward channel predicts the final reward R'(x_{<=t}) at every token, in the decoding pass itself.
Then s in Eq. 2 to 4 is that channel: a row's partial reward r(Y^{<=tau}) at a decision token is the
generator's RowState.reward, R' at the last token the generator has read (the prompt plus the row's
response but its newest token, sampled from that same pass; Alg. 1's Y^{<=tau} less one token), and
a row that ended before tau ranks on R' of its whole response (the engine has read it whole), so the
cutoff compares one function across the prompt's rows. No live row reaches the reward model before
the end: models.reward scores only the rows that finished by a decision token (their score, what the
output records) and the final responses, by stateless ``score`` calls (no streaming session). A row
stopped at tau has the channel's reward as its score and no reward-model components. The generator
must be a Reward Transformer on a backend that reads its channel (pipeline.strategies checks both at
plan time).

Extensions, each from the paper's sections 6.3 and 7:
- Streaming partial rewards (``streaming_rewards``, on by default): when the scorer has sessions
  (protocols.StreamingScorer), the reward model keeps a KV cache per live row and each decision
  token costs only the new chunk; rows stopped or finished leave the reward cache with the next
  call, as they leave the generator's. Scores equal full re-scoring to float tolerance.
- Memory-budget mode (section 6.3, ``initial_candidates`` / ``max_live_candidates``): start
  ``initial_candidates`` rows per prompt, keep exactly ``max_live_candidates`` live rows past the
  first decision token (with keep_lowest, the lowest-ranked one among them; rows with no partial
  reward there take slots first and are never stopped, see _budget_rows), so peak KV memory
  after it is that of Best-of-``max_live_candidates`` while the search started wide (the paper starts 250 and keeps 20 at token 64). The prompt's result holds the
  ``num_samples`` rows ranked best (continued rows first, then by partial reward); the rows
  screened out cost tokens (counted in generated_tokens) but are not returned.
  ``initial_candidates: auto`` is the paper's sizing: "start with as many utterances in parallel
  as memory allows" (section 6.3): each batch starts as many rows per prompt as its share of the
  generator's KV pool holds up to the first decision token (Generator.capacity: the pool's blocks,
  the prompt's shared once), at most AUTO_MAX_CANDIDATES, and no more than those whose survivors
  (``max_live_candidates``, or Eq. 3's 1 - rejection_rate share and keep_lowest's row; rows tied at
  the cutoff may add more) the pool also holds to
  max_new_tokens, so the kept rows never outgrow the pool; never fewer than num_samples (the
  capacity is the batch's share of the pool and of runtime.rows_in_flight, which a batch of
  num_samples rows may exceed, as any strategy's would; a session that outgrows the whole pool fails
  in the step loop with one line).
- Prompt-dependent stopping (section 7, ``adaptive_rejection`` = z): from the second decision
  token on, each prompt fits the least-squares line of its current partial rewards on those of
  the previous decision token (the OLS fit and confidence band of the paper's Figure 2), and keeps
  every row whose partial reward plus z residual standard deviations reaches the current best.
  A prompt whose ranking is stable (small residuals) is pruned hard; one whose ranking still moves
  keeps more rows. The first decision token uses ``rejection_rate``.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass

from pipeline.decoding.best_of_n import assemble, open_session, score_rows
from pipeline.errors import ConfigError
from pipeline.decoding.domain import (Candidate, Generator, PromptInput, PromptResult, RowState, Scorer,
                                      Scores, components_of, ranks_of)
from pipeline.decoding.sampling import SamplingParams


PARTIAL_REWARDS = ("scorer", "generator")
"""``partial_reward``'s values: the reward model (models.reward), or the generator's reward channel."""


@dataclass
class SpeculativeRejectionParams:
    decision_token: int | list = 32
    """tau: generated tokens before the reward model ranks the partial responses (or a list)."""
    rejection_rate: float = 0.5
    """alpha in [0, 1): the fraction of partial responses stopped at each decision token."""
    initial_candidates: int | str | None = None
    """Memory-budget mode: rows started per prompt (>= sampling.num_samples); "auto": as many as the
    generator's KV pool holds to the first decision token (the HF backend); None: num_samples."""
    max_live_candidates: int | None = None
    """Memory-budget mode: rows per prompt that go on past the first decision token (the budget);
    None: the rejection_rate decides."""
    adaptive_rejection: float | None = None
    """z > 0 turns on prompt-dependent stopping from the second decision token on (see above)."""
    streaming_rewards: bool = True
    """Score partial responses through the scorer's streaming sessions when it has them."""
    partial_reward: str = "scorer"
    """Where the partial rewards at decision tokens come from: ``scorer``, models.reward (Eq. 2 as
    written); ``generator``, the generator's own reward channel, read in the decoding passes (a
    Reward Transformer, see above): the reward model then scores only finished rows."""
    keep_lowest: bool = True
    """Also finish each prompt's lowest-ranked live candidate at every decision token, so that a
    complete low-reward response exists for the pair's rejected side (data.rejected: complete):
    DPO then compares two finished responses, not a finished one with a truncated one. It costs
    one candidate's remaining tokens per prompt; false saves them (the rejected is then the worst
    survivor, or with data.rejected: any a stopped partial response), but the manifest's Best-of-N
    token estimate may then run high (estimate_length says how far)."""

    def __post_init__(self):
        taus = self.decision_token if isinstance(self.decision_token, list) else [self.decision_token]
        if not taus or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in taus):
            raise ConfigError(f"strategy.decision_token: expected a positive int or a list of them, got {self.decision_token!r}")
        if not 0 <= self.rejection_rate < 1:
            raise ConfigError(f"strategy.rejection_rate: must be in [0, 1), got {self.rejection_rate}")
        for key in ("initial_candidates", "max_live_candidates"):
            value = getattr(self, key)
            if key == "initial_candidates" and value == "auto":
                continue
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"strategy.{key}: expected a positive int{' or auto' if key[0] == 'i' else ''}, "
                                  f"got {value!r}")
        if (isinstance(self.initial_candidates, int) and self.max_live_candidates is not None
                and self.max_live_candidates > self.initial_candidates):
            raise ConfigError(f"strategy.max_live_candidates: {self.max_live_candidates} is more than "
                              f"initial_candidates {self.initial_candidates}")
        if self.partial_reward not in PARTIAL_REWARDS:
            raise ConfigError(f"strategy.partial_reward: expected one of {list(PARTIAL_REWARDS)}, "
                              f"got {self.partial_reward!r}")
        if self.adaptive_rejection is not None and not self.adaptive_rejection > 0:
            raise ConfigError(f"strategy.adaptive_rejection: expected z > 0, got {self.adaptive_rejection}")

    def check_sampling(self, sampling) -> None:
        """Checks against the sampling settings (num_samples), run by config validation."""
        if isinstance(self.initial_candidates, int) and self.initial_candidates < sampling.num_samples:
            raise ConfigError(f"strategy.initial_candidates: {self.initial_candidates} is less than "
                              f"sampling.num_samples {sampling.num_samples} (memory-budget mode starts at least N rows)")

    def check_backend(self, backend) -> None:
        """Checks against the models.backend record, run by config validation: ``auto`` reads the
        generator's KV pool (Backend.kv_capacity)."""
        if self.initial_candidates == "auto" and not backend.kv_capacity:
            raise ConfigError(f"strategy.initial_candidates: auto sizes the first batch by the generator's KV "
                              f"blocks; backend {backend.name} has none to read, so give a number")
        if self.partial_reward == "generator" and not backend.reward_channel:
            raise ConfigError(f"strategy.partial_reward: generator reads the generator's reward channel while "
                              f"decoding; backend {backend.name} reads none, so use models.backend: hf")

    @property
    def decision_tokens(self) -> list[int]:
        taus = self.decision_token if isinstance(self.decision_token, list) else [self.decision_token]
        return sorted(set(taus))


def rejection_cutoff(partial_rewards: list[float], rejection_rate: float) -> float:
    """r_cut = q_alpha(R_partial) (Eq. 3), over the finite rewards; -inf keeps everything."""
    finite = sorted(r for r in partial_rewards if math.isfinite(r))
    if not finite:
        return -math.inf
    keep = max(1, int(round((1.0 - rejection_rate) * len(finite))))
    return finite[len(finite) - keep]


def adaptive_cutoff(previous: list[float], current: list[float], z: float) -> float | None:
    """Prompt-dependent r_cut: max(current) - z * sigma, sigma the residual standard deviation of
    the least-squares fit current ~ a + b * previous over the prompt's rows. None when fewer than
    three rows have both rewards finite (no fit: the caller uses the fixed alpha)."""
    pairs = [(x, y) for x, y in zip(previous, current) if math.isfinite(x) and math.isfinite(y)]
    if len(pairs) < 3:
        return None
    n = len(pairs)
    mx = sum(x for x, _ in pairs) / n
    my = sum(y for _, y in pairs) / n
    sxx = sum((x - mx) ** 2 for x, _ in pairs)
    slope = sum((x - mx) * (y - my) for x, y in pairs) / sxx if sxx > 0 else 0.0
    residual = sum((y - my - slope * (x - mx)) ** 2 for x, y in pairs)
    sigma = math.sqrt(residual / (n - 2))
    return max(y for _, y in pairs) - z * sigma


class _Rewards:
    """Partial and final rewards for one batch: through a streaming session when the scorer has
    one (only new tokens are read), else by full re-scoring. With ``from_generator`` (``partial_reward:
    generator``) the partial rewards are the generator's own (``partial``) and the scorer, stateless,
    scores finished rows only."""

    def __init__(self, scorer: Scorer, prompts: list[PromptInput], rows_per_prompt: int, streaming: bool,
                 from_generator: bool = False):
        self.scorer, self.prompts, self.rows_per_prompt = scorer, prompts, rows_per_prompt
        self.from_generator = from_generator
        self.session = None
        sessions = all(callable(getattr(scorer, m, None)) for m in ("open", "extend", "close"))
        if streaming and sessions and not from_generator:  # the generator's partials need no session
            self.session = f"reward-{uuid.uuid4().hex}"
            scorer.open(self.session, [p.reward_input for p in prompts], rows_per_prompt,
                        columns=[p.columns for p in prompts])

    def __call__(self, rows: list[RowState]) -> list[float]:
        if self.session is None:
            return score_rows(self.scorer, self.prompts, self.rows_per_prompt, rows)
        return self.scorer.extend(self.session, [r.row for r in rows], [r.text for r in rows],
                                  finished=[r.finished for r in rows])

    def partial(self, rows: list[RowState]) -> list[float]:
        """The rewards at a decision token. From the scorer: as ``__call__``. From the generator: a
        live row's score and rank are its RowState.reward (R' of its prefix), and its components are
        empty (no reward model read it); a finished row's score and components are the scorer's and
        its rank is its RowState.reward (the channel compares the prompt's rows on one function)."""
        if not self.from_generator:
            return self(rows)
        missing = [r.row for r in rows if r.reward is None]
        if missing:
            raise ValueError(f"partial_reward generator: the generator reported no reward for rows {missing[:5]} "
                             "(it needs a Reward Transformer on the HF backend)")
        done = [r for r in rows if r.finished]
        scored = self(done)
        final = {r.row: (s, c) for r, s, c in zip(done, scored, components_of(scored))}
        scores = [final[r.row][0] if r.finished else r.reward for r in rows]
        components = [final[r.row][1] if r.finished else [] for r in rows]
        return Scores(scores, components, ranks=[r.reward for r in rows])

    def close(self) -> None:
        if self.session is not None:
            self.scorer.close(self.session)


def speculative_rejection(prompts: list[PromptInput], generator: Generator, scorer: Scorer,
                          params: SpeculativeRejectionParams, sampling: SamplingParams,
                          num_samples: int, seed: int) -> list[PromptResult]:
    points = [t for t in params.decision_tokens if t < sampling.max_new_tokens]
    # No decision token before max_new_tokens: no decision point, plain Best-of-N for these rows
    # (memory-budget mode has nothing to screen by, so it starts N rows, not initial_candidates).
    width = _width(generator, prompts, params, num_samples, points, sampling)  # rows started per prompt
    if width < num_samples:
        raise ValueError(f"initial_candidates ({width}) must be at least num_samples ({num_samples})")
    from_generator = params.partial_reward == "generator" and bool(points)
    session = open_session(generator, prompts, width, sampling, seed, rewards=from_generator)
    rewards = None
    candidates: dict[int, Candidate] = {}
    previous: dict[int, float] = {}  # row -> its rank (partial reward) at the previous decision token
    continued: set[int] = set()  # rows that went on past the first decision token
    live = list(range(len(prompts) * width))  # rows still decoding
    try:
        # Inside the try: a reward session that fails to open (its actor died) must not leak the
        # generator's prefilled batch.
        rewards = _Rewards(scorer, prompts, width, params.streaming_rewards, from_generator)
        for point, tau in enumerate(points):
            if not live:
                break
            rows = generator.extend(session, until=tau, keep=live)  # Alg. 1 line 2
            by_prompt, rank = _record_rewards(candidates, rows, rewards.partial(rows), width, tau)  # Eq. 2
            live = []
            for members in by_prompt.values():
                kept = _accepted(candidates, members, rank, point, params, previous)  # Eq. 3 and 4
                live += _stop_rejected(candidates, members, kept, tau, rank, previous)
            if point == 0:
                continued = set(live)
        if live:  # Alg. 1 line 5: finish the accepted sequences
            rows = generator.extend(session, until=sampling.max_new_tokens, keep=live)
            _record_rewards(candidates, rows, rewards(rows), width, None)
    finally:
        try:
            if rewards is not None:
                rewards.close()
        finally:  # a reward close that fails (its actor died) must not leak the generator's batch
            counters = generator.close(session)
    missing = set(range(len(prompts) * width)) - set(candidates)
    assert not missing, f"speculative rejection lost rows {sorted(missing)[:5]}"
    if width == num_samples:
        results = assemble(prompts, num_samples, candidates, _bon_tokens(candidates, num_samples, sampling))
    else:
        results = _screen(prompts, num_samples, width, candidates, continued, sampling)
    # A generator that decodes on while the rewards are computed (continuous vLLM) reports the
    # tokens its dropped rows made past their decision token, which no candidate holds.
    for result, extra in zip(results, (counters or {}).get("unreported_tokens") or []):
        result.generated_tokens += extra
    return results


def _record_rewards(candidates: dict[int, Candidate], rows: list[RowState], scores: list[float], width: int,
                    tau: int | None) -> tuple[dict[int, list[int]], dict[int, float]]:
    """Each row as its Candidate, with its reward and its rewards' scores (``components_of``): at
    decision token ``tau`` the partial reward s(Y_k^{<=tau_k}) (Eq. 2), kept in its partials unless the
    row finished; with ``tau`` None the final reward s(Y_k) of a finished row (Alg. 1 line 5; a row
    with no decision point before max_new_tokens has no partials: it is plain Best-of-N). Returns
    the rows by prompt, and each row's rank at this call (``ranks_of``), what the decision compares:
    its reward, except that a composite ranks a row that finished before ``tau`` on the rewards its
    prompt's partial rewards sum (like with like; see the module docstring)."""
    by_prompt: dict[int, list[int]] = {}
    rank: dict[int, float] = {}
    for r, s, parts, ranked in zip(rows, scores, components_of(scores), ranks_of(scores)):
        partials = candidates[r.row].partials if r.row in candidates else {}
        if tau is not None and not r.finished:
            partials = {**partials, tau: s}
        candidates[r.row] = Candidate(sample=r.row % width, token_ids=r.token_ids, text=r.text, score=s,
                                      completed=True if tau is None else r.finished, partials=partials,
                                      components=parts)
        rank[r.row] = ranked
        by_prompt.setdefault(r.row // width, []).append(r.row)
    return by_prompt, rank


def _accepted(candidates: dict[int, Candidate], members: list[int], rank: dict[int, float], point: int,
              params: SpeculativeRejectionParams, previous: dict[int, float]) -> set[int]:
    """The rows of one prompt that go on past decision point ``point``: I_accepted (Eq. 4, with r_cut
    from Eq. 3, or from the adaptive fit after the first point), keep_lowest's floor and the rows
    with no signal at tau; at the first point in memory-budget mode, ``_budget_rows`` (section 6.3).
    R_partial is the members' ``rank`` (a live row's partial reward; a row that ended before tau, on
    the same rewards as the live ones: see ``_record_rewards``). Non-finite ranks (no signal) are left
    out of every cutoff by the helpers."""
    partial = [rank[m] for m in members]
    floor = _lowest_live(candidates, members, rank) if params.keep_lowest else None
    if point == 0 and params.max_live_candidates is not None:  # section 6.3
        return _budget_rows(candidates, members, rank, params.max_live_candidates, floor)
    r_cut = None
    if point > 0 and params.adaptive_rejection is not None:
        r_cut = adaptive_cutoff([previous.get(m, math.nan) for m in members], partial, params.adaptive_rejection)
    if r_cut is None:
        r_cut = rejection_cutoff(partial, params.rejection_rate)  # Eq. 3
    # Eq. 4, the rejected side's supply, and the rows with no signal at tau
    return {m for m in members if rank[m] >= r_cut or m == floor or not _signalled(rank[m])}


def _stop_rejected(candidates: dict[int, Candidate], members: list[int], kept: set[int], tau: int,
                   rank: dict[int, float], previous: dict[int, float]) -> list[int]:
    """One prompt's rows after decision token ``tau``: those not ``kept`` stop there, the kept ones
    that are still decoding go on (returned); a row that ended before tau is kept unchanged (a
    non-finite final reward fails it). Each row's rank at tau goes to ``previous``."""
    live = []
    for m in members:
        c = candidates[m]
        # The rank, what the adaptive fit compares at the next point. For a live row it is its partial
        # reward; a finished row's is never read again (it is no member of a later decision).
        previous[m] = rank[m]
        if c.completed:
            continue
        if m in kept:
            live.append(m)
        else:
            c.stopped_early, c.stopped_at = True, tau
    return live


AUTO_MAX_CANDIDATES = 1024
"""``initial_candidates: auto`` starts at most this many rows per prompt, however large the pool
(the paper starts 250 on an 80 GB GPU)."""


def _width(generator: Generator, prompts: list[PromptInput], params: SpeculativeRejectionParams,
           num_samples: int, points: list[int], sampling: SamplingParams) -> int:
    """Rows started per prompt: num_samples, or memory-budget mode's initial_candidates (``auto``:
    the most rows the generator's KV pool holds to the first decision token whose survivors,
    ``max_live_candidates`` or Eq. 3's share and keep_lowest's row, it also holds to max_new_tokens;
    at least num_samples)."""
    if not points:  # no decision point: plain Best-of-N (memory-budget mode has nothing to screen by)
        return num_samples
    if params.initial_candidates == "auto":
        ids = [p.token_ids for p in prompts]
        first = min(generator.capacity(ids, points[0]), AUTO_MAX_CANDIDATES)  # every row to the first tau
        last = generator.capacity(ids, sampling.max_new_tokens)  # the survivors to the length cap

        def survivors(width: int) -> int:  # the rows past the first decision token: Eq. 3's keep and the floor
            if params.max_live_candidates:
                return min(width, params.max_live_candidates)
            return min(width, max(1, round((1 - params.rejection_rate) * width)) + bool(params.keep_lowest))

        width = max(first, num_samples)  # never fewer than num_samples: the strategy's own floor
        while width > num_samples and survivors(width) > last:
            width -= 1
        return width
    return params.initial_candidates or num_samples


def _budget_rows(candidates: dict[int, Candidate], members: list[int], rank: dict[int, float], budget: int,
                 floor: int | None) -> set[int]:
    """Memory-budget mode's survivors of the first decision token: ``budget`` live rows (or every
    live row when fewer), the best by partial reward (ties: lowest row). With keep_lowest (``floor``
    given) and a budget of two or more, the lowest-ranked live row takes the last slot, so the budget
    still holds and a complete low-reward response exists for the rejected side.

    Rows with no partial reward at tau (no signal) are never stopped: they go on first (lowest row
    first) and take budget slots, and the scored rows fill the rest of the budget by rank (the floor
    takes the last of them when two or more are left to the scored rows). When more
    rows than the budget have no signal, all of them still go on and no scored row does: stopping a
    row that was never ranked would drop a candidate for no reason (it could be neither ranked nor
    paired, and with a budget under num_samples it would be returned with no reward at all), so the
    budget is exceeded at this decision token, by unscored rows only."""
    live = [m for m in members if not candidates[m].completed]
    unscored = sorted(m for m in live if not _signalled(rank[m]))
    scored = sorted((m for m in live if _signalled(rank[m])), key=lambda m: (-rank[m], m))
    room = max(budget - len(unscored), 0)
    kept = scored[:room]
    if floor is not None and room >= 2 and floor not in kept:
        kept[-1] = floor
    return set(unscored) | set(kept)


def _signalled(rank: float) -> bool:
    """Whether a live row's rank (its partial reward at this decision token) is a signal: None, NaN
    and inf are "no signal here", never a failure (see the module docstring)."""
    return math.isfinite(rank)


def _lowest_live(candidates: dict[int, Candidate], members: list[int], rank: dict[int, float]) -> int | None:
    """The live (not completed) row with the lowest finite partial reward (``rank``); ties: lowest
    row. Rows with no signal are left out: they go on anyway, and cannot be ranked lowest."""
    live = [m for m in members if not candidates[m].completed and _signalled(rank[m])]
    return min(live, key=lambda m: (rank[m], m)) if live else None


def _screen(prompts: list[PromptInput], num_samples: int, width: int, candidates: dict[int, Candidate],
            continued: set[int], sampling: SamplingParams) -> list[PromptResult]:
    """Memory-budget mode: each prompt returns its num_samples best-ranked rows out of ``width``
    (rows that went on past the first decision token first, then by reward); the tokens of the
    rows screened out still count as the prompt's cost."""
    kept: dict[int, Candidate] = {}
    screened_tokens, screened = [0] * len(prompts), [0] * len(prompts)
    for i in range(len(prompts)):
        rows = list(range(i * width, (i + 1) * width))
        rank = sorted(rows, key=lambda r: (r in continued or candidates[r].completed,
                                           candidates[r].score if not candidates[r].failed else -math.inf, -r),
                      reverse=True)
        for slot, r in enumerate(sorted(rank[:num_samples])):
            kept[i * num_samples + slot] = candidates[r]
        screened[i] = width - num_samples
        screened_tokens[i] = sum(len(candidates[r].token_ids) for r in rank[num_samples:])
    results = assemble(prompts, num_samples, kept, _bon_tokens(kept, num_samples, sampling))
    for i, result in enumerate(results):
        result.generated_tokens += screened_tokens[i]
        result.stats = {"initial_candidates": width, "screened_out": screened[i]}
    return results


def _bon_tokens(candidates: dict[int, Candidate], num_samples: int, sampling: SamplingParams) -> dict[int, int]:
    """Tokens Best-of-N would have spent per row: an estimate for the rows stopped early, whose
    full length is unknown (``estimate_length``), the real count for the others, among them every
    row that never got a partial reward (such a row is never stopped). The anchors of a row stopped
    at tau are the prompt's rows that were live at tau and finished; one with no partial reward at
    tau cannot be placed on the line, so when none has one, the estimate is their mean length."""
    out = {}
    for row, c in candidates.items():
        if not c.stopped_early:
            out[row] = len(c.token_ids)
            continue
        prompt = row // num_samples
        # live at tau (a partial entry there, finite or not) and finished
        finished = [o for r, o in candidates.items() if r // num_samples == prompt and o.completed
                    and not o.stopped_early and c.stopped_at in o.partials]
        anchors = [(o.partials[c.stopped_at], len(o.token_ids)) for o in finished
                   if math.isfinite(o.partials[c.stopped_at])]
        if not anchors and finished:
            anchors = [(0.0, len(o.token_ids)) for o in finished]  # equal partials: their mean length
        estimate = estimate_length(c.partials.get(c.stopped_at, math.nan), anchors, c.stopped_at,
                                   sampling.max_new_tokens)
        out[row] = max(len(c.token_ids), estimate)
    return out


def estimate_length(partial: float, anchors: list[tuple[float, int]], tau: int, cap: int) -> int:
    """The full length a row stopped at ``tau`` with partial reward ``partial`` would have reached:
    the least-squares line of final length on partial reward through ``anchors``, the (partial
    reward at tau, final length) of the prompt's rows that were live at tau and finished, read at
    ``partial`` (clamped to the anchors' range: no extrapolation), within [tau, cap]. The rows that
    go on are the best-ranked ones, and better partial rewards come with longer responses, so
    their mean length alone overstates a stopped row's; the line corrects for the rank, and
    keep_lowest, which also finishes the lowest-ranked row, makes the anchors span the ranks. One
    anchor or equal partial rewards: their mean length; none: the cap.

    How far off it may be: with keep_lowest on, the anchors span the ranks and the estimate is close
    (configs/demo.yaml on the tiny models: 8,916 estimated vs 8,855 generated by a best_of_n build
    with the same seeds, +0.7%). With keep_lowest off, the anchors are the best-ranked rows only and
    a stopped row is read at the low edge of their range, so when longer responses score higher the
    estimate runs high: +22% at alpha 0.875 on the bench models (README, against a real Best-of-N run
    with the same seeds; the tiny demo gives -0.3%). Treat tokens_saved as an upper bound there; a
    best_of_n build with the same seed gives the exact figure. The build's summary says so."""
    if not anchors:
        return cap
    xs, ys = [a for a, _ in anchors], [b for _, b in anchors]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mean_x) ** 2 for x in xs)
    if sxx <= 0 or not math.isfinite(partial):
        return round(mean_y)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sxx
    partial = min(max(partial, min(xs)), max(xs))  # read the line inside its anchors, never beyond
    return round(min(max(mean_y + slope * (partial - mean_x), tau), cap))
