"""The coordinator side of model-side methods (tree searches, speculative decoding).

Methods such as SLA, ULTS, DSBD and ADED call the model many times per token with small inputs,
so each runs wholly inside the generator's process (``Generator.search``), and only the finished
candidates come back. The coordinator side is the same for all of them and lives here: send the
batch, check the counts, score every candidate with the reward model, assemble PromptResults.

A model-side strategy's record in pipeline.strategies names its ``search(host, prompts, num_samples,
seeds, sampling, params) -> list[SearchOutput]``; the function itself goes to the generator with the
call (``generator.search(search, ...)``; through Ray it travels by reference, module and name), so the
engine runs it without looking anything up. ``host`` is the generator engine's adapter
(pipeline.engines.adapters.HFSearchHost), seen through the small Protocol the strategy declares.
"""

from __future__ import annotations

from typing import Any, Callable

from pipeline.decoding.best_of_n import assemble, score_rows, scored_candidates
from pipeline.decoding.domain import Generator, PromptInput, PromptResult, Scorer
from pipeline.decoding.sampling import SamplingParams, row_seed


def run_model_side(method: str, search: Callable[..., list], prompts: list[PromptInput], generator: Generator,
                   scorer: Scorer, params: Any, sampling: SamplingParams, num_samples: int,
                   seed: int) -> list[PromptResult]:
    """Strategy ``method``'s batch: ``search`` run by the generator's engine, every candidate scored."""
    seeds = [row_seed(seed, p.prompt_id, s) for p in prompts for s in range(num_samples)]
    outputs = generator.search(search, [p.token_ids for p in prompts], num_samples, seeds, sampling, params)
    if len(outputs) != len(prompts):
        raise RuntimeError(f"{method}: generator returned {len(outputs)} results for {len(prompts)} prompts")
    rows = []
    for i, out in enumerate(outputs):
        ids = sorted(r.row for r in out.rows)
        if ids != list(range(i * num_samples, (i + 1) * num_samples)):
            raise RuntimeError(f"{method}: prompt {prompts[i].prompt_id} came back with rows {ids}, "
                               f"expected {num_samples} rows from {i * num_samples}")
        rows.extend(out.rows)
    candidates = scored_candidates(rows, score_rows(scorer, prompts, num_samples, rows), num_samples)
    results = assemble(prompts, num_samples, candidates, {r.row: len(r.token_ids) for r in rows})
    for result, out in zip(results, outputs):
        # A search's cost is what it decoded, not the length of what it kept.
        result.generated_tokens = out.generated_tokens
        result.stats = dict(out.stats)
    return results


def model_side_strategy(method: str, search: Callable[..., list]) -> Callable[..., list[PromptResult]]:
    """The coordinator-side ``run`` of the model-side strategy registered as ``method``, whose engine
    side is ``search``."""

    def strategy(prompts, generator, scorer, params, sampling, num_samples, seed):
        return run_model_side(method, search, prompts, generator, scorer, params, sampling, num_samples, seed)

    strategy.__name__ = method
    strategy.__doc__ = f"Coordinator side of the model-side strategy {method!r} (see pipeline.decoding.model_side)."
    return strategy
