"""Decoding algorithms: pure functions over small Protocols (no Ray, no vLLM, no file I/O).

STRATEGIES maps a strategy name to its function; STRATEGY_PARAMS to its parameter dataclass.
Every strategy has the signature
``fn(prompts, generator, scorer, params, sampling, num_samples, seed) -> list[PromptResult]``.

MODEL_SIDE maps the name of a method that runs inside the generator's process (tree searches,
speculative decoding) to ``fn(engine, prompts, num_samples, seeds, sampling, params) ->
list[SearchOutput]``; its STRATEGIES entry is ``model_side_strategy(name)`` from
pipeline.decoding.search, which calls ``Generator.search`` and scores the candidates.
"""

from pipeline.decoding.aded import ADEDParams, aded_model_side
from pipeline.decoding.best_of_n import BestOfNParams, best_of_n
from pipeline.decoding.dsbd import DSBDParams, dsbd_search
from pipeline.decoding.search import model_side_strategy
from pipeline.decoding.sla import SLAParams, sla
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection
from pipeline.decoding.ults import ULTSParams, ults_model_side

MODEL_SIDE: dict = {
    "ults": ults_model_side,
    "aded": aded_model_side,
    "sla": sla,
    "dsbd": dsbd_search,
}

# Model-side methods that need a Drafter (models.draft) on the generator's engine.
USES_DRAFT = {"dsbd"}

STRATEGIES = {
    "best_of_n": best_of_n,
    "sbon": speculative_rejection,
    "speculative_rejection": speculative_rejection,
    "ults": model_side_strategy("ults"),
    "aded": model_side_strategy("aded"),
    "sla": model_side_strategy("sla"),
    "dsbd": model_side_strategy("dsbd"),
}

STRATEGY_PARAMS = {
    "best_of_n": BestOfNParams,
    "sbon": SpeculativeRejectionParams,
    "speculative_rejection": SpeculativeRejectionParams,
    "ults": ULTSParams,
    "aded": ADEDParams,
    "sla": SLAParams,
    "dsbd": DSBDParams,
}
