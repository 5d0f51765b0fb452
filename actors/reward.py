"""RewardActor: loads a sequence-classification reward model (or a reward function, or a weighted list
of both: pipeline.engines.rewards.CompositeScorer) once and serves the Scorer protocol,
stateless ``score`` and the streaming sessions (``open`` / ``extend`` / ``close``) whose KV cache
lives here, so a session's calls must all reach the same actor (the coordinator pins them). A
composite's ``score`` and ``extend`` return pipeline.decoding.domain.Scores, each reward's scores
with the sum, in the same reply.

Every work call takes the driver's ``timing`` (pipeline.observability.CallTiming; None from callers
that send none) and runs inside the actor's timeline, which ``stats()["time"]`` reports: forward
passes, tokenizing and bookkeeping, Ray calls, waiting for the generator (a streaming session is
open whose next call has not come), waiting for work (none is open)."""

from __future__ import annotations

import torch

from pipeline.engines.backends import EngineOptions
from pipeline.engines.backends import backend as backend_record
from pipeline.engines.rewards import load_rewards
from pipeline.observability import ActorTimeline, CallTiming


class RewardActor:
    def __init__(self, model: str | list[str], device: str = "cpu", dtype: str = "float32", num_threads: int = 1,
                 batch_size: int = 32, prepack: bool = True, load: dict | None = None, backend: str = "hf",
                 vllm: dict | None = None, cache_mb: int | None = None, weights: list[float] | None = None,
                 pass_tokens: int = 0, heap: bool = False):
        """``model``: a sequence-classification model (dir or Hub id), or a reward function
        ``module:function`` (pipeline.engines.rewards.FunctionScorer), or a list of them, summed with
        ``weights`` (models.reward_weights; pipeline.engines.rewards.CompositeScorer). ``load``: the
        models' ``from_pretrained`` keywords (models.hf); ``backend`` (models.reward_backend): the
        record of pipeline.engines.backends whose reward scorer loads each model ("vllm": vLLM's
        pooling runner, with ``vllm`` (models.reward_vllm) as ``vllm.LLM`` keywords). ``cache_mb``:
        runtime.reward_cache_mb, each model's streaming pool (None: the device's default). ``pass_tokens``: runtime.reward_pass_tokens
        (0: the device's default); ``heap``: runtime.bound_heap."""
        torch.set_num_threads(max(1, num_threads))
        options = EngineOptions(device=device, dtype=dtype, num_threads=max(1, num_threads), prepack=prepack, load=load,
                                settings=vllm, batch_size=batch_size, reward_pass_tokens=pass_tokens or None,
                                bound_heap=heap,
                                reward_cache_bytes=None if cache_mb is None else cache_mb << 20)
        record = backend_record(backend, "models.reward_backend")
        self.scorer = load_rewards([model] if isinstance(model, str) else list(model), weights,
                                   lambda spec: record.load_reward(spec, options))
        self.timeline = ActorTimeline(lambda: len(self.scorer.sessions), compute="tokenizing_and_bookkeeping",
                                      open_wait="waiting_for_generator")

    def score(self, prompts: list[str], responses: list[str], finished: list[bool] | None = None,
              columns: list[dict] | None = None, timing: CallTiming | None = None) -> list[float]:
        with self.timeline.call(timing):
            return self.scorer.score(prompts, responses, finished=finished, columns=columns)

    def open(self, session: str, prompts: list[str], num_samples: int, columns: list[dict] | None = None,
             timing: CallTiming | None = None) -> None:
        with self.timeline.call(timing):
            self.scorer.open(session, prompts, num_samples, columns=columns)

    def extend(self, session: str, rows: list[int], responses: list[str], finished: list[bool] | None = None,
               timing: CallTiming | None = None) -> list[float]:
        with self.timeline.call(timing):
            return self.scorer.extend(session, rows, responses, finished=finished)

    def close(self, session: str, timing: CallTiming | None = None) -> dict:
        with self.timeline.call(timing):
            return self.scorer.close(session)

    def stats(self) -> dict:
        return {**self.scorer.stats(), "time": self.timeline.stats()}

    def shutdown(self) -> None:
        """Free the scorer's engine processes and memory (the vLLM pooling engine's; the HF and
        function scorers have none). For in-process workers: a Ray actor's end takes them with it."""
        if hasattr(self.scorer, "shutdown"):
            self.scorer.shutdown()
