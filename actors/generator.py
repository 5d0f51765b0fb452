"""GeneratorActor: loads a causal LM once and serves the Generator protocol from pipeline.engines.hf
(or pipeline.engines.vllm_engine with backend "vllm").

Every work call takes the driver's ``timing`` (pipeline.observability.CallTiming, sent by the
factory's CallLedger; None from callers that send none) and runs inside the actor's timeline, which
``stats()["time"]`` reports: forward passes, sampling and bookkeeping, Ray calls, waiting for
rewards (a session is open whose next call has not come), waiting for work (none is open).

With ``merged_decoding`` the actor takes several calls at once (a threaded Ray actor, or the
coordinator's threads in-process) and the engine merges their decoding steps (HF) or decodes them
in one continuous batch (vLLM); otherwise its calls run one at a time, however many reach it together."""

from __future__ import annotations

import contextlib
import threading

import torch

from pipeline.decoding.domain import RowState
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import HFEngine
from pipeline.observability import ActorTimeline, CallTiming


class GeneratorActor:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", num_threads: int = 1,
                 draft: str | None = None, draft_actor=None, backend: str = "hf", merged_decoding: bool = False,
                 speculative=None, prepack: bool = True, load: dict | None = None,
                 draft_load: dict | None = None, vllm: dict | None = None):
        """``draft``: a draft model to load in this process (placement "colocated"); ``draft_actor``:
        a DraftActor handle to call instead (placement "actor"). Model-side methods that draft
        (dsbd) find it as ``engine.drafter``; with neither, dsbd drafts with ADED. ``backend``: "hf"
        (HFEngine) or "vllm" (VLLMEngine, for the methods whose registry record lists it; on CPU its
        model worker runs ``num_threads`` threads);
        ``merged_decoding`` (runtime.merged_decoding): concurrent calls share one step loop: the HF
        engine's merged forward passes, or vLLM's continuous batching (ContinuousVLLMEngine: a request
        per row, aborted when pruned); false: one call at a time (the vLLM engine in rounds of
        ``LLM.generate``). ``speculative`` (models.speculative, a
        pipeline.decoding.speculative.SpeculativeDecoding): speculative decoding inside either engine.
        ``prepack`` (models.cpu_prepack): the HF models' linears prepacked for oneDNN on CPU
        (pipeline.engines.hf.for_inference). ``load`` / ``draft_load``: ``from_pretrained`` keywords of the
        generator and the draft (models.hf: revision, attn_implementation, trust_remote_code, ...);
        ``vllm``: ``vllm.LLM`` keywords (models.vllm) with backend "vllm"."""
        torch.set_num_threads(max(1, num_threads))
        if backend == "vllm":
            from pipeline.engines.vllm_engine import VLLMEngine

            self.engine = VLLMEngine.from_pretrained(model, dtype=dtype, num_threads=max(1, num_threads),
                                                     continuous=merged_decoding, speculative=speculative,
                                                     **(vllm or {}))
        else:
            self.engine = HFEngine.from_pretrained(model, device=device, dtype=dtype, merged=merged_decoding,
                                                   speculative=speculative, prepack=prepack, load=load)
        if draft_actor is not None:
            from actors.remote import RemoteProxy

            self.engine.drafter = RemoteProxy(draft_actor)
        elif draft:
            from pipeline.engines.draft import HFDrafter

            self.engine.drafter = HFDrafter.from_pretrained(draft, device=device, dtype=dtype, prepack=prepack,
                                                            load=draft_load)
        merged = getattr(self.engine, "merged", False)
        self._one_at_a_time = contextlib.nullcontext() if merged else threading.Lock()
        self.timeline = ActorTimeline(lambda: len(self.engine.sessions), compute="sampling_and_bookkeeping",
                                      open_wait="waiting_for_rewards")

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams, timing: CallTiming | None = None) -> None:
        with self._one_at_a_time, self.timeline.call(timing):
            self.engine.open(session, prompts, num_samples, seeds, sampling)

    def extend(self, session: str, until: int, keep: list[int] | None = None,
               timing: CallTiming | None = None) -> list[RowState]:
        with self._one_at_a_time, self.timeline.call(timing):
            return self.engine.extend(session, until, keep)

    def close(self, session: str, timing: CallTiming | None = None) -> dict:
        with self._one_at_a_time, self.timeline.call(timing):
            return self.engine.close(session)

    def search(self, method: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
               sampling: SamplingParams, params, timing: CallTiming | None = None) -> list:
        with self._one_at_a_time, self.timeline.call(timing):
            return self.engine.search(method, prompts, num_samples, seeds, sampling, params)

    def stats(self) -> dict:
        return {**self.engine.stats(), "time": self.timeline.stats()}

    def shutdown(self) -> None:
        """Free the engine's processes and memory (the vLLM engine's; the HF engine has none). For
        in-process workers: a Ray actor's end takes them with it."""
        if hasattr(self.engine, "shutdown"):
            self.engine.shutdown()
