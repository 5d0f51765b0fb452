"""DraftActor: loads the draft model once and serves the Drafter protocol (pipeline.engines.draft).

Where it sits is config (runtime.draft_placement): "actor" puts it in its own Ray actor with
runtime.draft resources (a whole GPU, or a fraction so Ray can pack it next to the generator);
"colocated" loads the same HFDrafter inside the GeneratorActor's process instead, which saves a
round trip per DSBD iteration (benchmarks/dsbd.py measures both).
"""

from __future__ import annotations

import torch

from pipeline.decoding.domain import DraftLayer
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.draft import HFDrafter


class DraftActor:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", num_threads: int = 1,
                 prepack: bool = True, load: dict | None = None):
        """``load``: the draft's ``from_pretrained`` keywords (models.hf)."""
        torch.set_num_threads(max(1, num_threads))
        self.drafter = HFDrafter.from_pretrained(model, device=device, dtype=dtype, prepack=prepack, load=load)

    def draft(self, contexts: list[list[int]], prefix_logp: list[float], width: int, depth: int,
              sampling: SamplingParams, seed: int) -> list[DraftLayer]:
        return self.drafter.draft(contexts, prefix_logp, width, depth, sampling, seed)

    def stats(self) -> dict:
        return self.drafter.stats()
