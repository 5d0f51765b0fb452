"""RewardActor: loads a sequence-classification reward model once and serves the Scorer protocol,
stateless ``score`` and the streaming sessions (``open`` / ``extend`` / ``close``) whose KV cache
lives here, so a session's calls must all reach the same actor (the coordinator pins them)."""

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

    def open(self, session: str, prompts: list[str], num_samples: int) -> None:
        self.scorer.open(session, prompts, num_samples)

    def extend(self, session: str, rows: list[int], responses: list[str]) -> list[float]:
        return self.scorer.extend(session, rows, responses)

    def close(self, session: str) -> dict:
        return self.scorer.close(session)

    def stats(self) -> dict:
        return self.scorer.stats()
