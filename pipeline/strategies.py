"""The strategy registry: one record per decoding strategy (a method of one of the papers), and the
only table of them. Config (names and parameter classes), plan-time model checks, the actor factory
(draft models), the coordinator (what a batch runs) and the evaluation all read it. Engines never do:
a model-side strategy's search function travels to the engine with the call (``Generator.search``).

Adding a strategy = one file in pipeline/decoding (its params dataclass, its algorithm, and for a
model-side strategy a ``search(host, prompts, num_samples, seeds, sampling, params)`` over a small
host Protocol that pipeline.engines.adapters.HFSearchHost satisfies) plus one record below; and a
golden record (tests/test_golden.py).

Two kinds of strategy:
- coordinator-side (``run`` given): the algorithm drives a Generator session from the coordinator,
  e.g. speculative rejection's decode / score / prune rounds; it needs an engine that serves
  sessions;
- model-side (``search`` given): the algorithm makes many small model calls per token, so it runs
  wholly inside the generator's process (``Generator.search``); its ``run`` is then
  pipeline.decoding.model_side.run_model_side, which sends the batch with the search function,
  checks the counts and scores every candidate; it needs an engine that serves search.

Which backends serve a strategy follows from what each backend declares it serves
(pipeline.engines.backends).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from pipeline.decoding import aded, best_of_n, dsbd, sla, speculative_rejection, ults
from pipeline.decoding.model_side import model_side_strategy
from pipeline.engines.backends import BACKENDS, SEARCH, SESSIONS
from pipeline.errors import ConfigError

log = logging.getLogger(__name__)


class ModelFiles(Protocol):
    """What the plan-time checks read from model files, given by the caller (pipeline.preflight.MODEL_FILES):
    the registry itself imports no engine."""

    def has_reward_channel(self, path: str) -> bool:
        """A Reward Transformer directory (a reward channel, trained or not)."""

    def has_trained_channel(self, path: str) -> bool:
        """A Reward Transformer directory with a trained reward channel."""

    def load_trigram(self, path: str) -> Any:
        """A saved tri-gram matrix; ValueError naming the problem otherwise."""


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
    check_models: Callable[[Any, Any, ModelFiles], None] | None = field(default=None)
    """Plan time, before any actor starts: fn(params, models config, model files) raises ConfigError
    when the models cannot serve the strategy (a missing reward channel, a bad tri-gram file)."""

    def __post_init__(self):
        if (self.run is None) == (self.search is None):
            raise ValueError(f"method {self.name}: give exactly one of run (coordinator side) or search (model side)")
        if self.run is None:
            object.__setattr__(self, "run", model_side_strategy(self.name, self.search))

    @property
    def needs(self) -> str:
        """What an engine must serve to run it (pipeline.engines.backends): SEARCH or SESSIONS."""
        return SEARCH if self.search is not None else SESSIONS

    @property
    def backends(self) -> tuple[str, ...]:
        """The generator backends that serve it (models.backend), in registry order."""
        return tuple(name for name, b in BACKENDS.items() if self.needs in b.serves)


def check_trained_channel(params: Any, models: Any, files: ModelFiles) -> None:
    """SLA reads rewards from the generator's own channel: refuse a generator without a trained one."""
    path = models.generator
    if "://" not in path and not files.has_trained_channel(path):
        raise ConfigError(f"models.generator: strategy 'sla' needs a Reward Transformer with a trained reward "
                          f"channel, but {path!r} has none; train one with bon-train-reward-transformer "
                          f"(python -m jobs.train_reward_transformer)")


def check_partial_reward(params: Any, models: Any, files: ModelFiles) -> None:
    """sbon's ``partial_reward: generator`` reads the generator's reward channel (self-speculative
    rejection): refuse a generator without one, and warn when it is untrained (its partial rewards
    then rank rows at random). The backend is checked with the params (``check_backend``)."""
    path = models.generator
    if params.partial_reward != "generator" or "://" in path:
        return
    if not files.has_reward_channel(path):
        raise ConfigError(f"strategy.partial_reward: generator reads the generator's reward channel, but "
                          f"models.generator {path!r} is no Reward Transformer; use partial_reward: scorer, or "
                          f"train one with python -m jobs.train_reward_transformer")
    if not files.has_trained_channel(path):
        log.warning("strategy.partial_reward: generator: the reward channel of %r is untrained, so its partial "
                    "rewards carry no signal; train it with python -m jobs.train_reward_transformer", path)


def check_trigram_file(params: Any, models: Any, files: ModelFiles) -> None:
    """``strategy.trigram`` (aded, and dsbd without a draft model) must be a saved tri-gram matrix."""
    if params.trigram and "://" not in params.trigram:
        try:
            files.load_trigram(params.trigram)
        except ValueError as exc:
            raise ConfigError(f"strategy.trigram: {exc}") from None


STRATEGIES: dict[str, Strategy] = {m.name: m for m in (
    Strategy("best_of_n", best_of_n.BestOfNParams, "Best-of-N: sample N to the end, score each (the baseline)",
           run=best_of_n.best_of_n),
    Strategy("sbon", speculative_rejection.SpeculativeRejectionParams,
           "speculative rejection: stop the lowest partial rewards at decision tokens",
           run=speculative_rejection.speculative_rejection, aliases=("speculative_rejection",),
           check_models=check_partial_reward),
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
