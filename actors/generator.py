"""GeneratorActor: loads a causal LM once, on the engine its backend names (pipeline.engines.backends:
HFEngine for "hf", VLLMEngine for "vllm"), and serves the engine contract (Engine, SearchEngine) to
the coordinator.

Every work call takes the driver's ``timing`` (pipeline.observability.CallTiming, sent by the
factory's CallLedger; None from callers that send none) and runs inside the actor's timeline, which
``stats()["time"]`` reports: forward passes, sampling and bookkeeping, Ray calls, waiting for
rewards (a session is open whose next call has not come), waiting for work (none is open).

With ``continuous_batching`` the actor takes several calls at once (a threaded Ray actor, or the
coordinator's threads in-process) and the engine decodes them in one continuous batch (HF: its step
loop; vLLM: one request per row); otherwise its calls run one at a time, however many reach it
together."""

from __future__ import annotations

import contextlib
import threading

import torch

from pipeline.decoding.domain import RowState
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.backends import SEARCH, EngineOptions
from pipeline.engines.backends import backend as backend_record
from pipeline.observability import ActorTimeline, CallTiming


class GeneratorActor:
    def __init__(self, model: str, device: str = "cpu", dtype: str = "float32", num_threads: int = 1,
                 draft: str | None = None, draft_actor=None, backend: str = "hf", continuous_batching: bool = False,
                 speculative=None, prepack: bool = True, load: dict | None = None,
                 draft_load: dict | None = None, vllm: dict | None = None, kv_cache_memory=None,
                 heap: bool = False, kv_rows: int | None = None):
        """``draft``: a draft model to load in this process (placement "colocated"); ``draft_actor``:
        a DraftActor handle to call instead (placement "actor"). Model-side strategies that draft
        (dsbd) find it as ``engine.drafter``; with neither, dsbd drafts with ADED. ``backend``
        (models.backend): a record of pipeline.engines.backends, whose engine class loads the model
        (vLLM on CPU: its model worker runs ``num_threads`` threads);
        ``continuous_batching`` (runtime.continuous_batching): concurrent calls share one continuous
        batch (the HF engine's step loop; vLLM's ContinuousVLLMEngine, a request per row, aborted
        when pruned); false: one call at a time (the vLLM engine in rounds of ``LLM.generate``).
        ``speculative`` (models.speculative, a
        pipeline.decoding.speculative.SpeculativeDecoding): speculative decoding inside either engine.
        ``prepack`` (models.cpu_prepack): the HF models' linears prepacked for oneDNN on CPU
        (pipeline.engines.hf.for_inference). ``load`` / ``draft_load``: ``from_pretrained`` keywords of the
        generator and the draft (models.hf: revision, attn_implementation, trust_remote_code, ...);
        ``vllm``: the backend's engine keywords (models.vllm: ``vllm.LLM`` keywords) with backend "vllm".
        ``kv_cache_memory`` (runtime.kv_cache_memory): the HF engine's KV cache budget; ``heap``
        (runtime.bound_heap): glibc heap tuning for this process; ``kv_rows`` (runtime.rows_in_flight):
        the rows a decoding step's compiled attention serves (its largest row bucket; None: 1,024)."""
        torch.set_num_threads(max(1, num_threads))
        self.backend = backend_record(backend)
        self.engine = self.backend.load_generator(model, EngineOptions(
            device=device, dtype=dtype, num_threads=max(1, num_threads), continuous_batching=continuous_batching,
            speculative=speculative, prepack=prepack, load=load, settings=vllm, kv_cache_memory=kv_cache_memory,
            bound_heap=heap, kv_rows=kv_rows))
        if draft_actor is not None:
            from actors.remote import RemoteDrafter

            self.engine.drafter = RemoteDrafter(draft_actor)
        elif draft:
            from pipeline.engines.draft import HFDrafter

            self.engine.drafter = HFDrafter.from_pretrained(draft, device=device, dtype=dtype, prepack=prepack,
                                                            load=draft_load)
        # The engine takes concurrent calls when it batches continuously; the actor serializes them
        # unless runtime.continuous_batching asks for that.
        concurrent = continuous_batching and self.engine.continuous_batching
        self._one_at_a_time = contextlib.nullcontext() if concurrent else threading.Lock()
        self.timeline = ActorTimeline(lambda: len(self.engine.sessions), compute="sampling_and_bookkeeping",
                                      open_wait="waiting_for_rewards", warm_up="kernel_warm_up")

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams, timing: CallTiming | None = None, rewards: bool = False) -> None:
        asked = {"rewards": True} if rewards else {}  # only when asked: see Generator.open
        with self._one_at_a_time, self.timeline.call(timing):
            self.engine.open(session, prompts, num_samples, seeds, sampling, **asked)

    def extend(self, session: str, until: int, keep: list[int] | None = None,
               timing: CallTiming | None = None) -> list[RowState]:
        with self._one_at_a_time, self.timeline.call(timing):
            return self.engine.extend(session, until, keep)

    def capacity(self, prompts: list[list[int]], until: int, timing: CallTiming | None = None) -> int:
        """Rows per prompt the engine's KV blocks hold (HFEngine.capacity)."""
        if not hasattr(self.engine, "capacity"):  # config refuses this pairing; this guards direct use
            raise ValueError(f"backend {self.backend.name} cannot size a batch by its KV blocks "
                             "(strategy.initial_candidates: auto)")
        with self._one_at_a_time, self.timeline.call(timing):
            return self.engine.capacity(prompts, until)

    def kv_use(self) -> dict | None:
        """The engine's KV cache figures now (KVCache.stats), None without a paged cache; it takes
        no lock, so it answers beside the work under way (a glance: RemoteProxy.glance)."""
        runner = getattr(self.engine, "runner", None)
        kv = getattr(runner, "kv", None)
        return kv.stats() if kv is not None and kv.allocated else None

    def close(self, session: str, timing: CallTiming | None = None) -> dict:
        with self._one_at_a_time, self.timeline.call(timing):
            return self.engine.close(session)

    def search(self, search, prompts: list[list[int]], num_samples: int, seeds: list[int],
               sampling: SamplingParams, params, timing: CallTiming | None = None) -> list:
        """A model-side strategy's ``search`` function run by the engine (SearchEngine.search)."""
        if SEARCH not in self.backend.serves:  # config refuses this pairing; this guards direct use
            raise ValueError(f"backend {self.backend.name} serves no model-side strategy "
                             f"({getattr(search, '__module__', search)})")
        with self._one_at_a_time, self.timeline.call(timing):
            return self.engine.search(search, prompts, num_samples, seeds, sampling, params)

    def stats(self) -> dict:
        return {**self.engine.stats(), "time": self.timeline.stats()}

    def shutdown(self) -> None:
        """Free the engine's processes and memory (the vLLM engine's; the HF engine has none). For
        in-process workers: a Ray actor's end takes them with it."""
        self.engine.shutdown()
