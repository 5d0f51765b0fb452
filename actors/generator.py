"""GeneratorActor: loads a causal LM once and serves the Generator protocol from pipeline.engines.hf
(or pipeline.engines.vllm_engine with backend "vllm")."""

from __future__ import annotations

import torch

from pipeline.decoding.protocols import RowState
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import HFEngine


class GeneratorActor:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", num_threads: int = 1,
                 draft: str | None = None, draft_actor=None, backend: str = "hf"):
        """``draft``: a draft model to load in this process (placement "colocated"); ``draft_actor``:
        a DraftActor handle to call instead (placement "actor"). Model-side methods that draft
        (dsbd) find it as ``engine.drafter``; with neither, dsbd drafts with ADED. ``backend``: "hf"
        (HFEngine) or "vllm" (VLLMEngine, for the methods whose registry record lists it)."""
        torch.set_num_threads(max(1, num_threads))
        if backend == "vllm":
            from pipeline.engines.vllm_engine import VLLMEngine

            self.engine = VLLMEngine.from_pretrained(model, dtype=dtype)
        else:
            self.engine = HFEngine.from_pretrained(model, device=device, dtype=dtype)
        if draft_actor is not None:
            from actors.remote import RemoteProxy

            self.engine.drafter = RemoteProxy(draft_actor)
        elif draft:
            from pipeline.engines.draft import HFDrafter

            self.engine.drafter = HFDrafter.from_pretrained(draft, device=device, dtype=dtype)

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams) -> None:
        self.engine.open(session, prompts, num_samples, seeds, sampling)

    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]:
        return self.engine.extend(session, until, keep)

    def close(self, session: str) -> dict:
        return self.engine.close(session)

    def search(self, method: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
               sampling: SamplingParams, params) -> list:
        return self.engine.search(method, prompts, num_samples, seeds, sampling, params)

    def stats(self) -> dict:
        return self.engine.stats()
