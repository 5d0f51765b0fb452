"""The method registry: one record per decoding method, and the only table of them. Config (names
and parameter classes), plan-time model checks, the actor factory (draft models), the engines
(model-side searches), the vLLM check and evaluation all read it.

Adding a method = one file in pipeline/decoding (its params dataclass, its algorithm, and for a
model-side method a ``search(host, prompts, num_samples, seeds, sampling, params)`` over a small
host Protocol that pipeline.engines.adapters.HFSearchHost satisfies) plus one record below.

Two kinds of method:
- coordinator-side (``run`` given): the algorithm drives a Generator session from the coordinator,
  e.g. speculative rejection's decode / score / prune rounds;
- model-side (``search`` given): the algorithm makes many small model calls per token, so it runs
  wholly inside the generator's process (``Generator.search``); its ``run`` is then
  pipeline.decoding.model_side.run_model_side, which sends the batch, checks the counts and scores
  every candidate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.decoding import aded, best_of_n, dsbd, sla, speculative_rejection, ults
from pipeline.decoding.model_side import model_side_strategy
from pipeline.errors import ConfigError


@dataclass(frozen=True)
class Strategy:
    name: str
    """The strategy name of configs and the CLI (strategy.name, --strategy)."""
    params: type
    """Its parameters: a dataclass written flat under ``strategy:`` in YAML; validates itself."""
    summary: str
    """One line for help texts and the README."""
    run: Callable[..., list] | None = None
    """Coordinator side: fn(prompts, generator, scorer, params, sampling, num_samples, seed) ->
    list[PromptResult]. Filled from ``search`` for model-side methods."""
    search: Callable[..., list] | None = None
    """Model side: fn(host, prompts, num_samples, seeds, sampling, params) -> list[SearchOutput],
    run by the generator's engine (Generator.search); None for coordinator-side methods."""
    aliases: tuple[str, ...] = ()
    """Other names accepted for it."""
    uses_draft: bool = False
    """Loads models.draft (when set) as the engine's drafter."""
    backends: frozenset[str] = frozenset({"hf"})
    """Generator backends that serve it (models.backend)."""
    check_models: Callable[[Any, Any], None] | None = field(default=None)
    """Plan time, before any actor starts: fn(params, models config) raises ConfigError when the
    models cannot serve the method (a missing reward channel, a bad tri-gram file)."""

    def __post_init__(self):
        if (self.run is None) == (self.search is None):
            raise ValueError(f"method {self.name}: give exactly one of run (coordinator side) or search (model side)")
        if self.run is None:
            object.__setattr__(self, "run", model_side_strategy(self.name))


def check_trained_channel(params: Any, models: Any) -> None:
    """SLA reads rewards from the generator's own channel: refuse a generator without a trained one."""
    from pipeline.engines.reward_transformer import CHANNEL_WEIGHTS, has_trained_channel

    path = models.generator
    if "://" not in path and not has_trained_channel(path):
        raise ConfigError(f"models.generator: strategy 'sla' needs a Reward Transformer with a trained reward "
                          f"channel, but {path!r} has no trained {CHANNEL_WEIGHTS}; train one with "
                          f"python -m jobs.train_reward_transformer")


def check_trigram_file(params: Any, models: Any) -> None:
    """``strategy.trigram`` (aded, and dsbd without a draft model) must be a saved tri-gram matrix."""
    from pipeline.engines.trigram import load_trigram

    if params.trigram and "://" not in params.trigram:
        try:
            load_trigram(params.trigram)
        except ValueError as exc:
            raise ConfigError(f"strategy.trigram: {exc}") from None


STRATEGIES: dict[str, Strategy] = {m.name: m for m in (
    Strategy("best_of_n", best_of_n.BestOfNParams, "Best-of-N: sample N to the end, score each (the baseline)",
           run=best_of_n.best_of_n, backends=frozenset({"hf", "vllm"})),
    Strategy("sbon", speculative_rejection.SpeculativeRejectionParams,
           "speculative rejection: stop the lowest partial rewards at decision tokens",
           run=speculative_rejection.speculative_rejection, aliases=("speculative_rejection",),
           backends=frozenset({"hf", "vllm"})),
    Strategy("ults", ults.ULTSParams, "uncertainty-guided likelihood-tree search (the num_samples best leaves)",
           search=ults.search),
    Strategy("aded", aded.ADEDParams, "Best-of-N sampling sped up by ADED drafts (distribution unchanged)",
           search=aded.search, check_models=check_trigram_file),
    Strategy("sla", sla.SLAParams, "streaming looking-ahead on a Reward Transformer's own token rewards",
           search=sla.search, check_models=check_trained_channel),
    Strategy("dsbd", dsbd.DSBDParams, "dynamic-width speculative beam decoding (draft model, or ADED drafts)",
           search=dsbd.search, uses_draft=True, check_models=check_trigram_file),
)}


def names() -> list[str]:
    """Every accepted strategy name, aliases included."""
    return sorted([*STRATEGIES, *(a for m in STRATEGIES.values() for a in m.aliases)])


def lookup(name: str) -> Strategy:
    """The record of ``name`` (or an alias); ConfigError naming the choices otherwise."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    for record in STRATEGIES.values():
        if name in record.aliases:
            return record
    raise ConfigError(f"strategy.name: unknown strategy {name!r}; choose from {names()}")
