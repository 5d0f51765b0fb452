"""RewardActor: loads a sequence-classification reward model once and serves the Scorer protocol."""

from __future__ import annotations

import torch

from pipeline.engines.rewards import RewardScorer


class RewardActor:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", num_threads: int = 1,
                 batch_size: int = 32):
        torch.set_num_threads(max(1, num_threads))
        self.scorer = RewardScorer.from_pretrained(model, device=device, dtype=dtype, batch_size=batch_size)

    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        return self.scorer.score(prompts, responses)

    def stats(self) -> dict:
        return self.scorer.stats()
