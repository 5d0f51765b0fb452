"""The equal-compute frontier of speculative rejection against Best-of-K, replayed on collected
completions: the paper's own comparison (reward reached against compute spent), and beside
it the same-N one, whose saving one cut at tau caps near L / (tau + (1 - alpha)(L - tau)).

    python -m benchmarks.frontier --counterfactual DIR/counterfactual.json [DIR2/counterfactual.json ...] [--sizes 8,16,32] \
        [--taus 16,32,64,16+64] [--alphas 0.5,0.75,0.9] [--level instruction] [--weights 0,1] [--json OUT.json] [--plot OUT.png]
        [--more-samples DIR3/counterfactual.json [DIR4/counterfactual.json ...]] [--held-out-splits 300]
        [--prompts FILE [FILE ...]] [--reward-prompt per-prompt|per-candidate] [--leave-out-prompt]

The input is jobs.counterfactual's JSON (``bon-counterfactual ... --output DIR``): per prompt, N_max
completions with their lengths, the combined reward at each decision token and at the end, and the
judge's verdicts (IFEval strict, per instruction). Nothing is sampled here; every point is replayed on
those same completions (--weights: under another combination of the collection's rewards, e.g. the
reward model alone, whose choices IFEval judges without circularity when the other reward is IFEval's
own checker; --more-samples: collections of the same prompts under another --seed, pooled per prompt, so
N_max 64 costs a second N-32 collection, not a new one):

- Best-of-K for K = 1..N_max, as an exact expectation over the K-subsets: the completion ranked r-th
  by final reward (ties: the lower index, as pair selection breaks them) is Best-of-K's choice in
  C(N - 1 - r, K - 1) of the C(N, K) subsets.
- Speculative rejection at every (N, tau, alpha): Algorithm 1 replayed by
  pipeline.decoding.metrics (accepted_in_turn, chosen), exactly at N = N_max and averaged over
  --subsets random N-subsets below it. A tau of A+B is decision tokens A then B in turn, as a list
  in strategy.decision_token decides: each rejects alpha of the rows still in play.
- Compute per prompt: generator tokens (the prompt's prefill once, as the engine shares a prompt
  among its samples; then a stopped row costs min(length, tau), a kept one its length) plus the reward
  model's tokens read (a streaming session reads each generated token once; Best-of-K reads its K
  responses once) and its reads of the prompt (below), weighted by --generator-cost and --reward-cost
  (seconds per token, measured on your models; the defaults count tokens, a prefill token as a
  decoded one).
- The prompt's tokens: the generator's are its prefill, the prompt through its chat
  template (pipeline.data.chat.PromptFormatter); the reward model's are the head of its text before
  the response (pipeline.data.chat.reward_prompt_tokens; summed over the collection's reward models,
  a reward function reads none). jobs.counterfactual records both per prompt (``prompt_tokens``,
  ``reward_prompt_tokens``); for a collection made before it did, --prompts FILE counts them with the
  tokenizers of the models the collection names (its ``generator`` and ``reward``), each of its
  prompts found in FILE by its ``prompt_id``, or, where it records none, as the job took them (FILE's
  usable rows from the first; a prompt's instruction count is checked against the judge's verdicts).
  How often the reward model reads the prompt follows its backend (--reward-prompt; default: the
  collection's ``streaming_reward``). pipeline.engines.rewards.RewardScorer in a streaming session
  (a decoder reward model whose cached scores match full re-scoring, with a block pool) reads a
  prompt's head once for all its rows and shares its blocks (``shared_heads``): ``per-prompt``. An
  encoder reward model, one whose cached scores do not match, runtime.reward_cache_mb 0 or
  strategy.streaming_rewards false falls back to ``score``, which reads the prompt with every
  candidate's whole text: ``per-candidate``, the prompt once per candidate (K for Best-of-K, N for
  sbon). That is a lower bound for sbon there: such a backend reads prompt and response again at
  every decision token, which neither side counts (the response tokens are counted once, as a
  streaming session reads them). vLLM's reward backend
  (pipeline.engines.vllm_reward) scores whole texts but its prefix cache serves a prompt's shared
  blocks after the first read: about ``per-prompt``. The Reward Transformer (SLA) reads the reward in
  the generator's own pass and does not apply here. --leave-out-prompt counts no prompt token, as
  the earliest figures (docs/history.md) did.
- Quality: the judge's prompt- and instruction-level accuracy of the chosen completion, and the
  mean final reward.
- For each sbon point: the compute ratio at equal quality, Best-of-K's compute interpolated at
  sbon's quality (--level) over sbon's compute, with a percentile bootstrap interval over prompts
  (--bootstrap resamples). Where sbon's quality is above Best-of-N_max's, the ratio is a lower
  bound (``above_curve``).
- For each sbon point, the same-N comparison as well (``bon-build``'s own comparison):
  its normalized score (Eq. 5: 100 for Best-of-N's choice among the same N candidates, 0 for their
  worst; prompts whose N rewards all tie left out) and Best-of-N's compute over its own
  (``same_n_ratio``).
- The headline: the point with the largest ratio. Its bootstrap interval is for that point fixed, and
  ignores that it was the best of the grid on the same prompts it is scored on. --held-out-splits K
  measures the choice instead: K times, the prompts are split at random into two halves
  (the splits drawn from --seed), the point with the largest ratio on the first half is chosen (the
  Best-of-K curve also from that half alone) and its ratio is taken on the other half; the median and
  the 2.5-97.5% range over the splits are printed and written (``held_out``) beside the headline.

Prints the prompt tokens per prompt, the curve and the points; --json writes them (``prompt_tokens``:
the means and each prompt's counts), --plot draws quality against compute (the
Best-of-K curve and the sbon points; its title carries the headline and, with --held-out-splits, the
held-out figure). Bad input prints one line and exits with code 2.
"""

from __future__ import annotations

import functools
import gzip
import json
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks import bench_parser, fail, parse, write_json, write_png
from pipeline.decoding.metrics import PromptRewards, accepted_in_turn, chosen, normalized_score, subset


@dataclass
class Prompt:
    """One prompt's collected completions: rewards, lengths, the judge's verdicts."""

    rewards: PromptRewards
    judged: list[list[bool]]
    prompt_tokens: int = 0
    """The generator's prefill: the prompt through its chat template, read once per prompt."""
    reward_prompt_tokens: int = 0
    """What the reward models read of the prompt at each read (``reward_prompt`` says how often)."""

    def prompt_reads(self, candidates: int, reward_prompt: str) -> tuple[int, int]:
        """The prompt tokens a method with ``candidates`` candidates reads: the generator's prefill
        once, and the reward models' once per prompt (``per-prompt``) or per candidate."""
        return self.prompt_tokens, self.reward_prompt_tokens * (candidates if reward_prompt == "per-candidate" else 1)


@dataclass
class Point:
    """Per-prompt expectations of one method: generator and reward tokens, judged prompt-level
    (all instructions followed), instructions followed, and the chosen completion's final reward."""

    generator: np.ndarray
    reward: np.ndarray
    prompt_level: np.ndarray
    followed: np.ndarray
    final: np.ndarray
    score: np.ndarray | None = None
    """sbon only: the normalized score (Eq. 5) against Best-of-N of the same N candidates; NaN where they tie."""
    prompt: np.ndarray | None = None
    """The prompt's share of ``generator`` + ``reward``: prefill and the reward models' prompt reads."""


def read(path: str) -> dict:
    """A counterfactual JSON's data (gzip-compressed where the name ends in .gz, as the committed
    collections under benchmarks/results/counterfactual-heldout are); one line and exit 2 when it
    cannot be read."""
    try:
        raw = Path(path).read_bytes()
        data = json.loads(gzip.decompress(raw) if path.endswith(".gz") else raw)
        if not isinstance(data.get("completions"), list):
            raise KeyError("completions")
        return data
    except (OSError, EOFError, ValueError, KeyError, AttributeError) as exc:
        fail(f"{path}: not a counterfactual JSON with completions ({type(exc).__name__}: {exc})")


def load(path: str, data: dict, weights: list[float] | None = None,
         counts: list[tuple[int, int]] | None = None) -> tuple[list[Prompt], dict]:
    """The prompts of ``data`` (the counterfactual JSON at ``path``, pooled with any --more-samples: ``pool``)
    that the judge saw; one line and exit 2 otherwise. ``weights``: one per reward of the collection, its
    rewards combined anew as a build combines them (jobs.counterfactual.Collected.rewards); None: the
    collection's own combination. ``counts``: each prompt's (prefill, reward prompt) tokens, one per
    prompt of the collection (``prompt_counts``); None: no prompt token counted."""
    try:
        specs = _specs(data)
        if weights is not None and len(weights) != len(specs):
            fail(f"{path}: --weights has {len(weights)} weights for its {len(specs)} rewards ({', '.join(map(str, specs))})")
        counts = counts or [(0, 0)] * len(data["completions"])
        prompts = [Prompt(_rewards(c, specs, weights), c["judged"], *count)
                   for c, count in zip(data["completions"], counts) if c.get("judged")]
    except (ValueError, KeyError, TypeError) as exc:
        fail(f"{path}: not a counterfactual JSON with completions ({type(exc).__name__}: {exc})")
    if not prompts:
        fail(f"{path}: no prompt has the judge's verdicts (the prompts need IFEval's columns)")
    return prompts, data


def _specs(data: dict) -> list:
    """The collection's rewards (--reward), a list."""
    return data["reward"] if isinstance(data.get("reward"), list) else [data.get("reward")]


SAME = ("generator", "reward", "reward_weights", "taus", "max_new_tokens", "num_samples")
"""What the collections replayed together must share."""

COUNTS = ("prompt_tokens", "reward_prompt_tokens")
"""What jobs.counterfactual records of each prompt's tokens: the generator's prefill, and what the
reward models read of the prompt at each read."""


def load_all(paths: list[str], weights: list[float] | None = None, more: list[list[str]] | None = None,
             prompt_files: list[str] | None = None, column: str = "prompt",
             count_prompts: bool = True) -> tuple[list[Prompt], dict]:
    """``load`` of each path, the prompts concatenated; the first's settings, which the others must share
    (SAME; one line and exit 2 otherwise). ``more``: lists of collections of the same prompts under other
    seeds, one per path in order, whose completions are pooled into that path's prompts (``pool``).
    ``count_prompts``: each prompt's tokens as recorded, or counted from ``prompt_files`` (one for all
    paths, or one per path in order; ``prompt_counts``); False: none counted."""
    if more and any(len(m) != len(paths) for m in more):
        fail(f"--more-samples: {' / '.join(str(len(m)) for m in more)} paths for {len(paths)} --counterfactual paths "
             "(one per --counterfactual, in order)")
    if prompt_files and len(prompt_files) not in (1, len(paths)):
        fail(f"--prompts: {len(prompt_files)} files for {len(paths)} --counterfactual paths (one for all, or one "
             "per --counterfactual, in order)")
    files = (prompt_files * len(paths) if len(prompt_files) == 1 else prompt_files) if prompt_files else [None] * len(paths)
    groups = [[path, *extra] for path, *extra in zip(paths, *(more or []))]
    prompts, first = [], None
    for group, file in zip(groups, files):
        data = pool(group)
        counts = prompt_counts(group[0], data, file, column) if count_prompts else None
        more_prompts, data = load(group[0], data, weights, counts)
        differ = [key for key in SAME if first is not None and data.get(key) != first.get(key)]
        if differ:
            fail(f"{group[0]}: not collected as {paths[0]} was ({', '.join(differ)} differ)")
        prompts, first = prompts + more_prompts, first or data
    return prompts, first


def prompt_counts(path: str, data: dict, prompt_file: str | None, column: str = "prompt") -> list[tuple[int, int]]:
    """Each prompt's (generator prefill, reward models' prompt tokens per read) of the collection
    ``data`` at ``path``: as it records them (COUNTS), or counted from ``prompt_file`` with the
    tokenizers of the models it names (its ``generator``; its ``reward`` models, a reward function
    counting none): the prompt through the generator's chat template (PromptFormatter, as
    jobs.counterfactual renders it) and the head of each reward model's text
    (pipeline.data.chat.reward_prompt_tokens). A prompt is found by its ``prompt_id``, or, in a
    collection that records none, is the file's usable row of the same index (as the job took the
    file's first rows), its instruction count checked against the judge's verdicts. Counts missing
    with no file, a prompt not found, or a tokenizer that does not load: one line, exit 2."""
    entries = data["completions"]
    if all(key in c for c in entries for key in COUNTS):
        return [(int(c["prompt_tokens"]), int(c["reward_prompt_tokens"])) for c in entries]
    if prompt_file is None:
        fail(f"{path}: no prompt token counts (collected before jobs.counterfactual recorded them): --prompts FILE, "
             "the prompt file it was collected from, counts them (--leave-out-prompt: none counted)")
    from pipeline.data.chat import PromptFormatter, prompt_id, reward_prompt_tokens
    from pipeline.engines.rewards import is_reward_function

    rows = _prompt_rows(prompt_file, column)
    by_id = {prompt_id(row.prompt): row for row in rows}
    matched = []
    for i, c in enumerate(entries):
        row = by_id.get(c["prompt_id"]) if "prompt_id" in c else rows[i] if i < len(rows) else None
        if row is None:
            fail(f"{path}: prompt {i} ({'id ' + c['prompt_id'] if 'prompt_id' in c else 'no id: the row of its index'}) "
                 f"is not in {prompt_file} ({len(rows)} usable rows)")
        instructions = row.columns.get("instruction_id_list")
        if c.get("judged") and instructions is not None and len(instructions) != len(c["judged"][0]):
            fail(f"{path}: prompt {i} has {len(c['judged'][0])} instructions, row {row.source_row + 1} of {prompt_file} "
                 f"{len(instructions)}: not the prompt it was collected from")
        matched.append(row.prompt)
    formatter = PromptFormatter(_tokenizer(str(data.get("generator"))), sys.maxsize)
    readers = [_tokenizer(spec) for spec in _specs(data) if spec and not is_reward_function(spec)]
    return [(len(formatter.render(prompt)[1]), sum(reward_prompt_tokens(t, prompt) for t in readers))
            for prompt in matched]


def _prompt_rows(path: str, column: str) -> list:
    """The usable prompt rows of a prompt file, as jobs.counterfactual reads them
    (pipeline.data.prompts.read_prompt_file); one line and exit 2 when it cannot be read."""
    from pipeline.data.prompts import read_prompt_file
    from pipeline.errors import InputError

    try:
        return read_prompt_file(path, column)[0]
    except InputError as exc:
        fail(str(exc))


@functools.cache
def _tokenizer(path: str):
    """The tokenizer of the model at ``path`` (local files only: nothing is fetched); one line naming
    the path and exit 2 when it does not load."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        fail(f"{path}: cannot load the tokenizer ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})")


def pool(paths: list[str]) -> dict:
    """One collection of ``paths``, collections of the same prompts (in the same order) under different
    seeds: each prompt's completions are the first's followed by the others', so N_max is their sum.
    They must share SAME but num_samples, each prompt's id where both record one, and each prompt's
    instruction count; the seeds must differ (the same seed draws the same completions again). One line
    and exit 2 otherwise."""
    data = read(paths[0])
    for path in paths[1:]:
        other = read(path)
        differ = [key for key in SAME if key != "num_samples" and other.get(key) != data.get(key)]
        if len(other["completions"]) != len(data["completions"]):
            differ.append(f"prompts ({len(other['completions'])} against {len(data['completions'])})")
        for i, (mine, theirs) in enumerate(zip(data["completions"], other["completions"])):
            if set(mine) - {"prompt_id", *COUNTS} != set(theirs) - {"prompt_id", *COUNTS}:
                differ.append(f"prompt {i}'s fields")
            elif "prompt_id" in mine and "prompt_id" in theirs and mine["prompt_id"] != theirs["prompt_id"]:
                differ.append(f"prompt {i}'s id")
            elif {len(j) for j in mine.get("judged") or [[]]} != {len(j) for j in theirs.get("judged") or [[]]}:
                differ.append(f"prompt {i}'s instructions")
        if differ:
            fail(f"{path}: not the same prompts and settings as {paths[0]} ({', '.join(differ[:3])} differ)")
        seeds = data.get("seeds", [data.get("seed")])
        if other.get("seed") in seeds:
            fail(f"{path}: collected with seed {other.get('seed')}, as {paths[0]} was: the same completions again")
        data = {**data, "seeds": [*seeds, other.get("seed")],
                "num_samples": data.get("num_samples", 0) + other.get("num_samples", 0),
                "completions": [_pooled(a, b) for a, b in zip(data["completions"], other["completions"])]}
    return data


def _pooled(first: dict, second: dict) -> dict:
    """One prompt's completions of two collections, the first's then the second's (every per-completion
    list); of what describes the prompt (its id, COUNTS), the first's where it has it, else the second's."""
    def join(a, b):
        return {k: join(a[k], b[k]) for k in a} if isinstance(a, dict) else (a or []) + (b or [])
    per_prompt = ("prompt_id", *COUNTS)
    pooled = {key: join(value, second[key]) for key, value in first.items() if key not in per_prompt}
    prompt = {key: first.get(key, second.get(key)) for key in per_prompt if key in first or key in second}
    return {**prompt, **pooled}


def _rewards(completions: dict, specs: list, weights: list[float] | None) -> PromptRewards:
    """One prompt's rewards: as collected (``weights`` None), or each reward's own values combined by ``weights``."""
    if weights is None:
        return PromptRewards(completions["lengths"], completions["final"],
                             {int(t): v for t, v in completions["partial"].items()})
    from jobs.counterfactual import Collected

    per = [completions["rewards"][spec] for spec in specs]
    taus = [int(t) for t in per[0]["partial"]]
    return Collected(lengths=completions["lengths"], final=[r["final"] for r in per],
                     partial={t: [r["partial"][str(t)] for r in per] for t in taus},
                     ended={t: completions["ended"][str(t)] for t in taus}).rewards(weights)


def _order(rewards: PromptRewards) -> list[int]:
    """Completions best first, as ``chosen`` picks them (finite final rewards first, ties: lower index)."""
    return sorted(range(len(rewards.final)),
                  key=lambda k: (not math.isfinite(rewards.final[k]), -rewards.final[k] if math.isfinite(
                      rewards.final[k]) else 0.0, k))


def best_of_k(prompts: list[Prompt], k: int, reward_prompt: str = "per-prompt") -> Point:
    """Best-of-K's exact expectation over the K-subsets of each prompt's completions; its prompt read
    as ``Prompt.prompt_reads`` of K candidates."""
    rows = []
    for p in prompts:
        n, order = len(p.rewards.final), _order(p.rewards)
        weights = [math.comb(n - 1 - r, k - 1) / math.comb(n, k) for r in range(n)]
        tokens = k * sum(p.rewards.lengths) / n
        prefill, reward_prompt_read = p.prompt_reads(k, reward_prompt)
        pick = list(zip(weights, order))
        rows.append((tokens + prefill, tokens + reward_prompt_read, sum(w * all(p.judged[c]) for w, c in pick),
                     sum(w * sum(p.judged[c]) for w, c in pick),
                     sum(w * p.rewards.final[c] for w, c in pick if math.isfinite(p.rewards.final[c])),
                     prefill + reward_prompt_read))
    generator, reward, level, followed, final, prompt = map(np.array, zip(*rows))
    return Point(generator, reward, level, followed, final, prompt=prompt)


def sbon(prompts: list[Prompt], n: int, tau: int | tuple[int, ...], alpha: float, subsets: int, seed: int,
         keep_lowest: bool = True, reward_prompt: str = "per-prompt") -> Point:
    """Algorithm 1 at (tau, alpha) on N-subsets of each prompt's completions (all of them at N_max),
    averaged: per prompt, the tokens spent and the judged quality of its choice. ``tau`` a tuple:
    decision tokens in turn, each rejecting ``alpha`` of the candidates still in play
    (pipeline.decoding.metrics.accepted_in_turn). Its prompt is read as ``Prompt.prompt_reads`` of its
    N candidates."""
    taus = _in_turn(tau)
    rows = []
    for i, p in enumerate(prompts):
        total = len(p.rewards.final)
        draws = [list(range(total))] if n >= total else \
            [sorted(random.Random(seed * 1_000_003 + i * 7919 + s).sample(range(total), n)) for s in range(subsets)]
        sums, scores = np.zeros(4), []
        for keep in draws:
            sub = subset(p.rewards, keep)
            kept, stopped = accepted_in_turn(sub, taus, alpha, keep_lowest)
            pick = chosen(sub, kept)
            judged = p.judged[keep[pick]] if pick is not None else [False] * len(p.judged[0])
            tokens = sum(min(length, stopped.get(j, length)) for j, length in enumerate(sub.lengths))
            sums += (tokens, all(judged), sum(judged), sub.final[pick] if pick is not None else 0.0)
            scores.append(normalized_score(sub.final, sub.final[pick] if pick is not None else -math.inf))
        tokens, level, followed, final = sums / len(draws)
        finite = [v for v in scores if math.isfinite(v)]
        score = sum(finite) / len(finite) if finite else math.nan
        prefill, reward_prompt_read = p.prompt_reads(min(n, total), reward_prompt)
        # streaming: the reward reads each generated token once
        rows.append((tokens + prefill, tokens + reward_prompt_read, level, followed, final, score,
                     prefill + reward_prompt_read))
    generator, reward, level, followed, final, score, prompt = map(np.array, zip(*rows))
    return Point(generator, reward, level, followed, final, score, prompt)


def aggregate(point: Point, instructions: np.ndarray, costs: tuple[float, float], index=None) -> dict:
    """Means over prompts (``index``: a bootstrap resample of them): compute per prompt, quality."""
    index = np.arange(len(point.generator)) if index is None else index
    generator, reward = point.generator[index].mean(), point.reward[index].mean()
    scored = point.score[index] if point.score is not None else np.array([])
    scored = scored[np.isfinite(scored)]
    return {"generator_tokens": float(generator), "reward_tokens": float(reward),
            "prompt_tokens": float(point.prompt[index].mean()) if point.prompt is not None else 0.0,
            "compute": float(costs[0] * generator + costs[1] * reward),
            "prompt_level": float(point.prompt_level[index].mean()),
            "instruction_level": float(point.followed[index].sum() / instructions[index].sum()),
            "final_reward": float(point.final[index].mean()),
            **({"normalized_score": float(scored.mean()) if len(scored) else math.nan} if point.score is not None else {})}


def equal_quality_compute(curve: list[dict], quality: float, level: str) -> tuple[float, bool]:
    """Best-of-K's compute interpolated at ``quality`` along the curve (K ascending): the first
    segment that reaches it. (compute, False), or (the curve's last compute, True) when no K reaches it."""
    previous = None
    for point in curve:
        if point[level] >= quality:
            if previous is None or point[level] == previous[level]:
                return point["compute"], False
            share = (quality - previous[level]) / (point[level] - previous[level])
            return previous["compute"] + share * (point["compute"] - previous["compute"]), False
        previous = point
    return curve[-1]["compute"], True


def ratio(curve_points: list[Point], point: Point, instructions, costs, level: str, index=None) -> tuple[float, bool]:
    curve = [aggregate(p, instructions, costs, index) for p in curve_points]
    return _ratio_on(curve, point, instructions, costs, level, index)


def _ratio_on(curve: list[dict], point: Point, instructions, costs, level: str, index=None) -> tuple[float, bool]:
    """``ratio`` against a curve already aggregated over the same ``index``."""
    at = aggregate(point, instructions, costs, index)
    compute, above = equal_quality_compute(curve, at[level], level)
    return compute / at["compute"], above


def held_out(curve_points: list[Point], points: list[Point], instructions: np.ndarray, costs: tuple[float, float],
             level: str, splits: int, seed: int) -> dict:
    """Held-out selection: ``splits`` times, the prompts in two random halves, the first
    (half of them, rounded down) to choose the point on, the other to measure it on (``choose_on``).
    Returns the held-out ratios' median and 2.5-97.5% range over splits, the chosen points' ratios
    on their own half (the median: what selection adds), how often each point was chosen (by index
    into ``points``), and how many held-out ratios are lower bounds (the point above the whole curve)."""
    rng = np.random.default_rng([seed, 62])  # apart from the bootstrap's draws, so those stay as they were
    prompts = len(instructions)
    own, held, above, chosen = [], [], 0, {}
    for _ in range(splits):
        order = rng.permutation(prompts)
        best, in_sample, value, is_above = choose_on(curve_points, points, instructions, costs, level,
                                                     np.sort(order[: prompts // 2]), np.sort(order[prompts // 2:]))
        own.append(in_sample)
        held.append(value)
        above += is_above
        chosen[best] = chosen.get(best, 0) + 1
    low, median, high = _spread(held)
    return {"splits": splits, "select_prompts": prompts // 2, "measure_prompts": prompts - prompts // 2,
            "ratio_median": median, "ratio_low": low, "ratio_high": high,
            "in_sample_median": _spread(own)[1], "above_curve_splits": above,
            "chosen": dict(sorted(chosen.items(), key=lambda item: -item[1])), "ratios": held}


def choose_on(curve_points: list[Point], points: list[Point], instructions: np.ndarray, costs: tuple[float, float],
              level: str, select: np.ndarray, measure: np.ndarray) -> tuple[int, float, float, bool]:
    """One split: the index of the point of ``points`` with the largest equal-quality ratio on the
    prompts ``select`` (as the headline is chosen; ties: the first in grid order), its ratio there, and
    its ratio on the prompts ``measure`` with whether that is a lower bound; each ratio is against
    Best-of-K's curve over the same prompts alone."""
    curve = [aggregate(p, instructions, costs, select) for p in curve_points]
    in_sample = [_ratio_on(curve, p, instructions, costs, level, select)[0] for p in points]
    best = int(np.argmax(in_sample))
    curve = [aggregate(p, instructions, costs, measure) for p in curve_points]
    return (best, in_sample[best], *_ratio_on(curve, points[best], instructions, costs, level, measure))


def _spread(values: list[float]) -> tuple[float, float, float]:
    """The 2.5% percentile, the median and the 97.5% percentile of ``values`` (the bootstrap's
    convention for the ends); NaN for none."""
    if not values:
        return math.nan, math.nan, math.nan
    ordered = sorted(values)
    return ordered[int(0.025 * len(ordered))], float(np.median(ordered)), ordered[int(0.975 * len(ordered)) - 1]


def frontier(prompts: list[Prompt], sizes: list[int], taus: list[int], alphas: list[float], level: str,
             costs: tuple[float, float], subsets: int, resamples: int, seed: int, splits: int = 0,
             reward_prompt: str = "per-prompt") -> dict:
    """The Best-of-K curve and every sbon point with its equal-quality compute ratio and interval;
    ``splits`` above 0: the held-out selection of the best point as well (``held_out``).
    ``reward_prompt``: how often the reward models read the prompt (``Prompt.prompt_reads``)."""
    n_max = min(len(p.rewards.final) for p in prompts)
    instructions = np.array([len(p.judged[0]) for p in prompts], dtype=float)
    curve_points = [best_of_k(prompts, k, reward_prompt) for k in range(1, n_max + 1)]
    rng = np.random.default_rng(seed)
    samples = [rng.integers(0, len(prompts), len(prompts)) for _ in range(resamples)]
    # Every point is bootstrapped on the same resamples: the curve is aggregated once per resample, not
    # once per point and resample (the same figures, 28-60 times fewer aggregations on a grid).
    curve = [aggregate(p, instructions, costs) for p in curve_points]
    resampled = None
    points, replayed = [], []
    for n in (s for s in sizes if s <= n_max):
        for tau in taus:
            for alpha in alphas:
                point = sbon(prompts, n, tau, alpha, subsets, seed, reward_prompt=reward_prompt)
                value, above = _ratio_on(curve, point, instructions, costs, level)
                if resampled is None:
                    resampled = [[aggregate(p, instructions, costs, s) for p in curve_points] for s in samples]
                spread = sorted(_ratio_on(c, point, instructions, costs, level, s)[0] for c, s in zip(resampled, samples))
                low, high = (spread[int(0.025 * len(spread))], spread[int(0.975 * len(spread)) - 1]) if spread \
                    else (math.nan, math.nan)
                at = aggregate(point, instructions, costs)
                same_n = aggregate(curve_points[n - 1], instructions, costs)["compute"] / at["compute"]
                points.append({"n": n, "tau": list(tau) if isinstance(tau, tuple) else tau, "alpha": alpha, **at,
                               "ratio": value, "ratio_low": low, "ratio_high": high, "above_curve": above,
                               "same_n_ratio": same_n})
                replayed.append(point)
    result = {"prompts": len(prompts), "n_max": n_max, "level": level, "costs_per_token": list(costs),
              "prompt_tokens": {"reward_prompt": reward_prompt,
                                "generator": float(np.mean([p.prompt_tokens for p in prompts])),
                                "reward": float(np.mean([p.reward_prompt_tokens for p in prompts])),
                                "per_prompt": {"generator": [p.prompt_tokens for p in prompts],
                                               "reward": [p.reward_prompt_tokens for p in prompts]}},
              "best_of_k": [{"k": k, **aggregate(p, instructions, costs)} for k, p in enumerate(curve_points, 1)],
              "sbon": points}
    if splits > 0 and points:
        held = held_out(curve_points, replayed, instructions, costs, level, splits, seed)
        top = points[int(np.argmax([p["ratio"] for p in points]))]  # the headline: ties to the first, as held_out
        held["chosen"] = [{**_grid_point(points[i]), "splits": count} for i, count in held["chosen"].items()]
        result["held_out"] = {"headline": {**_grid_point(top), "ratio": top["ratio"], "ratio_low": top["ratio_low"],
                                           "ratio_high": top["ratio_high"]}, **held}
    return result


def _grid_point(point: dict) -> dict:
    """A point's place in the grid: N, tau, alpha."""
    return {"n": point["n"], "tau": point["tau"], "alpha": point["alpha"]}


def draw(result: dict, level: str):
    def figure(plt):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        curve = result["best_of_k"]
        ax.plot([c["compute"] for c in curve], [c[level] for c in curve], "-o", ms=3, label="Best-of-K, K = 1..N")
        best = sorted(result["sbon"], key=lambda p: -p["ratio"])[:5]  # labelled: the five best ratios
        ax.scatter([p["compute"] for p in result["sbon"]], [p[level] for p in result["sbon"]], s=18, marker="^",
                   color="tab:red", label="speculative rejection (N, tau, alpha)")
        for p in best:
            ax.annotate(f"N{p['n']} tau{_tau(p['tau'])} a{p['alpha']}: {p['ratio']:.2f}x", (p["compute"], p[level]),
                        fontsize=7, xytext=(4, -10), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("compute per prompt (generator + reward tokens, cost-weighted)")
        ax.set_ylabel("the chosen completion's final reward" if level == "final_reward"
                      else f"IFEval {level.replace('_', '-')} (strict)")
        ax.set_title(f"Equal-compute frontier, {result['prompts']} prompts" + _title_figures(result), fontsize=9)
        ax.legend(loc="lower right")
        return fig
    return figure


def _title_figures(result: dict) -> str:
    """With --held-out-splits: the headline's in-sample ratio with its fixed-point interval, and the
    held-out figure beside it (the PNG carries both)."""
    held = result.get("held_out")
    if not held:
        return ""
    top = held["headline"]
    return (f"\nbest of {len(result['sbon'])} points, chosen and scored on all: N{top['n']} tau{_tau(top['tau'])} "
            f"a{top['alpha']}: {top['ratio']:.2f}x [{top['ratio_low']:.2f}, {top['ratio_high']:.2f}] (fixed point)"
            f"\nheld out (chosen on {held['select_prompts']}, scored on the other {held['measure_prompts']}): "
            f"{held['ratio_median']:.2f}x [{held['ratio_low']:.2f}, {held['ratio_high']:.2f}] over {held['splits']} splits")


def _in_turn(tau: int | tuple[int, ...]) -> list[int]:
    """A point's decision tokens, in turn: [tau] for one."""
    return list(tau) if isinstance(tau, tuple) else [tau]


def _tau(tau: int | list[int]) -> str:
    """A point's decision token(s) as --taus writes them: 64, or 16+64 for decision tokens in turn."""
    return "+".join(map(str, tau)) if isinstance(tau, list) else str(tau)


def _taus(text: str) -> list[int | tuple[int, ...]]:
    """--taus: decision tokens, comma-separated; A+B is one point with decision tokens A then B."""
    try:
        out = [tuple(int(t) for t in item.split("+")) for item in text.split(",") if item.strip()]
    except ValueError:
        fail(f"--taus {text}: decision tokens are integers, comma-separated, A+B for several in turn")
    if any(list(t) != sorted(set(t)) for t in out):
        fail(f"--taus {text}: the decision tokens of one point increase (A+B with A < B)")
    return [t[0] if len(t) == 1 else t for t in out]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__name__, __doc__, json=None, plot=None, seed=0, prompts=dict(
        nargs="+", metavar="FILE", help="the prompt file(s) a collection was made from (jobs.counterfactual's "
        "--prompts), one for all --counterfactual or one per --counterfactual in order: its prompt tokens counted "
        "where it does not record them (the earliest collections)"))
    parser.add_argument("--counterfactual", required=True, nargs="+",
                        help="jobs.counterfactual's counterfactual.json; several: their prompts replayed as one set "
                             "(collections of the same generator, rewards, taus and cap, e.g. a prompt file's two halves)")
    parser.add_argument("--sizes", default="", help="sbon's N values (default: N_max)")
    parser.add_argument("--taus", default="", help="decision tokens, comma-separated; A+B: one point with decision "
                             "tokens A then B, each rejecting alpha of the rows in play (default: the counterfactual's)")
    parser.add_argument("--alphas", default="", help="rejection rates (default: the counterfactual's)")
    parser.add_argument("--level", choices=["instruction_level", "prompt_level", "final_reward"],
                        default="instruction_level", help="the quality the ratio is taken at")
    parser.add_argument("--generator-cost", type=float, default=1.0, help="seconds (or units) per generated token")
    parser.add_argument("--reward-cost", type=float, default=1.0, help="seconds (or units) per reward token read")
    parser.add_argument("--subsets", type=int, default=200, help="random N-subsets per prompt below N_max")
    parser.add_argument("--bootstrap", type=int, default=1000, help="resamples of the prompts for the intervals")
    parser.add_argument("--weights", default="",
                        help="one weight per reward of the collection, W,W,...: its rewards combined anew (e.g. 0,1: "
                             "the second reward alone); default: the collection's --reward-weights")
    parser.add_argument("--held-out-splits", type=int, default=0, metavar="K",
                        help="held-out selection: K random halvings of the prompts, the best point (largest ratio) "
                             "chosen on one half and its ratio taken on the other; median and 2.5-97.5%% range over "
                             "the K splits, drawn from --seed (default 0: not run)")
    parser.add_argument("--more-samples", nargs="+", action="append", metavar="PATH",
                        help="counterfactual JSONs of the same prompts under another --seed, one per --counterfactual "
                             "in order: each prompt's completions pooled (N_max their sum); repeat for more")
    parser.add_argument("--prompt-column", default="prompt", help="the column of --prompts that holds the prompt")
    parser.add_argument("--reward-prompt", choices=["per-prompt", "per-candidate"], default=None,
                        help="how often the reward model reads the prompt: once per prompt (a streaming reward "
                             "session), or once per candidate (whole-text scoring); default: per-prompt where the "
                             "collection's reward streamed (streaming_reward), per-candidate where it did not")
    parser.add_argument("--leave-out-prompt", action="store_true",
                        help="count no prompt token on either side (as the earliest figures did)")
    args = parse(parser, argv)
    if args.held_out_splits < 0:
        fail(f"--held-out-splits {args.held_out_splits}: a count of splits, 0 or more")
    prompts, data = load_all(args.counterfactual, _floats(args.weights) or None, args.more_samples, args.prompts,
                             args.prompt_column, not args.leave_out_prompt)
    reward_prompt = args.reward_prompt or ("per-prompt" if data.get("streaming_reward", True) else "per-candidate")
    n_max = min(len(p.rewards.final) for p in prompts)
    taus = _taus(args.taus) or data.get("taus") or sorted(prompts[0].rewards.partial)
    needed = sorted({t for tau in taus for t in _in_turn(tau)})
    missing = [t for t in needed if any(t not in p.rewards.partial for p in prompts)]
    if missing:
        fail(f"{', '.join(args.counterfactual)}: no partial rewards at tau {missing} (it has {sorted(prompts[0].rewards.partial)})")
    result = frontier(prompts, [int(s) for s in _floats(args.sizes)] or [n_max], taus,
                      _floats(args.alphas) or data.get("alphas") or [0.75], args.level,
                      (args.generator_cost, args.reward_cost), args.subsets, args.bootstrap, args.seed,
                      args.held_out_splits, reward_prompt)
    report(result, args.level)
    write_json(args.json, {"counterfactual": args.counterfactual, "more_samples": args.more_samples,
                           "prompt_files": args.prompts,
                           "reward_weights": _floats(args.weights) or data.get("reward_weights"), **result}, args)
    write_png(args.plot, draw(result, args.level))
    return 0


def report(result: dict, level: str) -> None:
    print(f"{result['prompts']} prompts, N_max {result['n_max']}; quality: {level}")
    counted = result["prompt_tokens"]
    reads = "once per prompt" if counted["reward_prompt"] == "per-prompt" else "once per candidate"
    print(f"prompt tokens per prompt (in the compute below): the generator's prefill {counted['generator']:.1f} "
          f"(once per prompt), the reward model's {counted['reward']:.1f} per read ({counted['reward_prompt']}: {reads})")
    print("Best-of-K:  K  compute  prompt  instruction")
    for c in result["best_of_k"]:
        print(f"          {c['k']:>3} {c['compute']:>8.0f}  {c['prompt_level']:.3f}   {c['instruction_level']:.3f}")
    print("sbon:  N      tau alpha  compute  prompt  instruction  ratio at equal quality [95%]   same N: score, ratio")
    for p in result["sbon"]:
        bound = ">=" if p["above_curve"] else "  "
        print(f"    {p['n']:>4} {_tau(p['tau']):>8} {p['alpha']:.3f} {p['compute']:>8.0f}  {p['prompt_level']:.3f}   "
              f"{p['instruction_level']:.3f}      {bound}{p['ratio']:.2f}x [{p['ratio_low']:.2f}, {p['ratio_high']:.2f}]"
              f"   {p['normalized_score']:6.2f}, {p['same_n_ratio']:.2f}x")
    held = result.get("held_out")
    if held:
        top = held["headline"]
        print(f"headline, the best of {len(result['sbon'])} points on all {result['prompts']} prompts: N {top['n']}, "
              f"tau {_tau(top['tau'])}, alpha {top['alpha']}: {top['ratio']:.2f}x [{top['ratio_low']:.2f}, "
              f"{top['ratio_high']:.2f}] (bootstrap of that point, fixed)")
        print(f"held out, the best point chosen on {held['select_prompts']} prompts and scored on the other "
              f"{held['measure_prompts']}: {held['ratio_median']:.2f}x [{held['ratio_low']:.2f}, {held['ratio_high']:.2f}] "
              f"(median [2.5%, 97.5%] over {held['splits']} splits; the chosen point's own half gave "
              f"{held['in_sample_median']:.2f}x; above the curve in {held['above_curve_splits']})")
        print("  chosen: " + ", ".join(f"N {c['n']} tau {_tau(c['tau'])} alpha {c['alpha']} ({c['splits']})"
                                       for c in held["chosen"][:5]))


if __name__ == "__main__":
    sys.exit(main())
