"""The HF generator engine: batched incremental decoding with a KV cache over any Hugging Face
causal LM, and the loaders every HF model in the pipeline goes through.

The engine is stateful: a *session* holds a batch of candidate rows and their KV cache between
calls, so an algorithm can decode to a decision point, look at the partial responses, drop the
unpromising rows (from the batch and from the cache, which is where early termination saves
compute), and continue with the rest.

    engine.open(session, prompts, num_samples, seeds, sampling)   # prefill each prompt once, fan out
    engine.extend(session, until=32)                              # decode a chunk of steps
    engine.extend(session, until=128, keep=[0, 3, 5])             # prune rows, decode on
    engine.close(session)                                         # counters; frees the cache
    engine.search(ults.search, prompts, num_samples, seeds, sampling, params)  # a model-side search

HFEngine is two parts with one code path: the model runner (pipeline.engines.model_runner: the
model, its sessions' rows, prefill, one decoding step, speculative decoding's draft-and-verify
step) and the step loop (pipeline.engines.step_loop: continuous batching, which decides when each
piece of model work runs). Every call goes through the loop, so concurrent calls (a threaded
GeneratorActor, the coordinator's threads in-process) share its forward passes; whether a
generator takes concurrent calls at all is its actor's choice (runtime.continuous_batching).
"""

from __future__ import annotations

import dataclasses
import threading
import uuid
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pipeline.decoding.domain import RowState, check_open
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import SpeculativeDecoding
from pipeline.engines.model_runner import ModelRunner, Session
from pipeline.engines.step_loop import StepLoop

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_KEYS = ("revision", "trust_remote_code")
"""The loading settings (models.hf, ``HFLoadConfig.load_kwargs``) a tokenizer takes too."""
GENERATE_PREFILL_TOKENS = 16384
"""``generate``'s bound on one session's prefill: its prompts times the longest one's tokens. A
session's prompts go through one left-padded forward pass (RowBatch.prefill), whose activations grow
with the padded tokens and its attention with their square: the last 60 prompts of IFBench's test
set (the longest 2,591 tokens) passed 9 GB in one session. A prompt longer than the bound is a
session alone."""


def torch_dtype(name: str) -> torch.dtype | str:
    """models.dtype as ``from_pretrained`` takes it: a torch dtype, or "auto" (the checkpoint's own)."""
    return "auto" if name == "auto" else DTYPES[name]


def load_pretrained(auto_cls, name_or_path: str, dtype: str = "float32", load: dict | None = None):
    """``auto_cls.from_pretrained`` (AutoModelForCausalLM, AutoModelForSequenceClassification) with
    models.dtype and models.hf's keywords for this model (``HFLoadConfig.load_kwargs(role)``:
    revision, attn_implementation, trust_remote_code, ...)."""
    return auto_cls.from_pretrained(name_or_path, dtype=torch_dtype(dtype), **(load or {}))


class PackedLinear(torch.nn.Module):
    """An ``nn.Linear`` for inference on CPU whose weight oneDNN reordered once, at load, into its
    blocked layout (``torch.ops.mkldnn._reorder_linear_weight``; the forward is
    ``torch.ops.mkldnn._linear_pointwise``, the op PyTorch's own CPU compiler emits for a prepacked
    linear). Two properties our decoding uses (benchmarks/hf_throughput.py ``--compare-prepack``):
    a pass over 2-8 rows costs about what one row does, where PyTorch's default linear (MKL, from
    the plain layout at every call) cost 1.5-2x on our CPU, which is what draft-and-verify decoding
    pays for (speculative decoding, ADED, DSBD); and the layer's output for a row is bitwise the same
    however many rows share the pass. Inference only: the packed weight is not a parameter and takes
    no gradient."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = None if linear.bias is None else linear.bias.detach().clone()  # not a view of the loaded file

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def can_prepack(device: str | torch.device, dtype: str) -> bool:
    """Prepacked linears apply: float32 on CPU with oneDNN built in. ``dtype`` "auto": the caller
    passes the loaded model's (``for_inference`` does)."""
    return torch.device(device).type == "cpu" and dtype == "float32" and torch.backends.mkldnn.is_available()


def for_inference(model, device: str | torch.device = "cpu", dtype: str = "float32", prepack: bool = True):
    """A loaded model, moved to ``device`` in eval mode; with ``prepack`` (models.cpu_prepack) and
    where ``can_prepack``, every ``nn.Linear`` in it becomes a PackedLinear (a tied output head too:
    its packed copy is separate, the embedding keeps the shared weight)."""
    model = model.to(device).eval()
    if dtype == "auto":  # the checkpoint's dtype, now loaded
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if prepack and can_prepack(device, dtype):
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if type(child) is torch.nn.Linear:
                    setattr(module, name, PackedLinear(child))
    if torch.device(device).type == "cpu":
        own_weights(model)
    return model


@torch.no_grad()
def own_weights(model) -> None:
    """Give every CPU parameter and buffer of ``model`` memory of its own. transformers loads a
    safetensors checkpoint on CPU as views of the file's private memory map, and one tensor left
    there (an embedding, a norm) keeps the whole mapping, with every page the load touched, resident:
    measured on SmolLM2-135M in float32, 0.56 GB of file pages beside the model's own 0.66 GB
    (docs/benchmarks.md, "The KV pool"). A copy of each such tensor lets the map go."""
    for tensor in list(model.parameters()) + list(model.buffers()):  # each shared tensor once
        if tensor.device.type == "cpu":
            tensor.data = tensor.data.clone()


def load_tokenizer(name_or_path: str, load: dict | None = None):
    """Any HF tokenizer directory or hub id; a missing pad token falls back to EOS. ``load``: the
    model's loading keywords (models.hf), of which the tokenizer takes TOKENIZER_KEYS."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **{k: v for k, v in (load or {}).items()
                                                                if k in TOKENIZER_KEYS})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


class HFEngine:
    """Generator implementation over an HF causal LM (see pipeline.decoding.domain.Generator and the
    module docstring): a ModelRunner driven by a StepLoop."""

    continuous_batching = True
    """Concurrent calls share the step loop's forward passes (any number of threads may call)."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu",
                 speculative: SpeculativeDecoding | None = None, kv_cache_memory=None, heap: bool = False,
                 kv_rows: int | None = None):
        """``speculative``: speculative decoding of extends to the cap (pipeline.engines.model_runner);
        None or k = 0: off. ``kv_cache_memory`` (runtime.kv_cache_memory): the KV cache's budget
        (pipeline.engines.backends.parse_memory; None: auto). ``heap``: runtime.bound_heap. ``kv_rows``: the
        rows a step's compiled attention serves (runtime.rows_in_flight; None: attention_kernel.MAX_ROWS)."""
        self.runner = ModelRunner(model, tokenizer, device, speculative, kv_cache_memory=kv_cache_memory, heap=heap,
                                  kv_rows=kv_rows)
        self.loop = StepLoop(self.runner)
        self.model, self.tokenizer, self.device = self.runner.model, tokenizer, self.runner.device
        self.eos_ids, self.pad_id = self.runner.eos_ids, self.runner.pad_id
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()  # guards ``sessions`` and each session's ``until``
        self.drafter = None
        """A Drafter for the strategies that draft (dsbd): the draft model in-process or a DraftActor
        proxy, set by the GeneratorActor; None: they draft with ADED."""
        self._search_host = None

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32",
                        speculative: SpeculativeDecoding | None = None, prepack: bool = True,
                        load: dict | None = None, kv_cache_memory=None, heap: bool = False,
                        kv_rows: int | None = None) -> HFEngine:
        """Any HF causal LM; a Reward Transformer directory (pipeline.engines.reward_transformer)
        loads with its reward channel, which model-side strategies such as SLA read. ``prepack``: see
        ``for_inference``. ``load``: ``from_pretrained`` keywords (models.hf, ``load_pretrained``)."""
        from pipeline.engines.reward_transformer import RewardTransformer, has_reward_channel

        tokenizer = load_tokenizer(name_or_path, load)
        if has_reward_channel(name_or_path):
            model = RewardTransformer.from_pretrained(name_or_path, dtype=torch_dtype(dtype), device=device, load=load)
        else:
            model = load_pretrained(AutoModelForCausalLM, name_or_path, dtype, load)
        return cls(for_inference(model, device, dtype, prepack), tokenizer, device, speculative=speculative,
                   kv_cache_memory=kv_cache_memory, heap=heap, kv_rows=kv_rows)

    @classmethod
    def from_options(cls, name_or_path: str, options) -> HFEngine:
        """The HF backend's generator engine (pipeline.engines.backends: EngineOptions). Its step loop
        always batches continuously; ``options.continuous_batching`` is the actor's to apply (false:
        it serializes the calls)."""
        return cls.from_pretrained(name_or_path, device=options.device, dtype=options.dtype,
                                   speculative=options.speculative, prepack=options.prepack, load=options.load,
                                   kv_cache_memory=options.kv_cache_memory, heap=options.bound_heap,
                                   kv_rows=options.kv_rows)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", None) or self.tokenizer.model_max_length)

    @property
    def speculative(self) -> SpeculativeDecoding | None:
        return self.runner.speculative

    @property
    def generated_tokens(self) -> int:
        """Tokens sampled on this engine's model, by every session and model-side search."""
        return self.runner.generated_tokens

    @property
    def forward_passes(self) -> int:
        """Forward passes on this engine's model (a step shared by several sessions counts once)."""
        return self.runner.forward_passes

    # -- Generator protocol ----------------------------------------------------------------

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams, rewards: bool = False) -> None:
        """See Generator.open; ``rewards`` (a Reward Transformer only): every pass over the session's
        rows also reads the reward channel (ModelRunner.prefill)."""
        with self._lock:
            check_open(self.sessions, session, prompts, num_samples, seeds)
        state = self.loop.between_steps(lambda: self.runner.prefill(prompts, num_samples, seeds, sampling, rewards))
        state.name = session
        with self._lock:
            check_open(self.sessions, session, prompts, num_samples, seeds)  # a concurrent open of the same id
            self.sessions[session] = state

    @torch.inference_mode()
    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]:
        with self._lock:
            state = self._session(session)
            if state.until is not None:
                raise ValueError(f"session {session}: extend while another extend of it is under way")
            state.until = min(until, state.sampling.max_new_tokens)
        try:
            # Between two steps: the loop's driver may preempt this session's blocks meanwhile.
            reported = self.loop.between_steps_of(state, lambda: self.runner.prune(state, keep, session))
            self.loop.extend(state)
        finally:
            with self._lock:
                state.until = None
        return self.runner.report(state, reported)

    def close(self, session: str) -> dict:
        """See Generator.close. Safe at any time, from any thread: an extend of the session under way
        (stepping, preempted or waiting for blocks) raises its own RuntimeError ("closed while its
        extend was under way", step_loop.closed_error) and the sessions stepping beside it go on with
        the tokens they would have had; the session holds nothing after, and is never readmitted."""
        with self._lock:
            state = self.sessions.pop(session, None)
        if state is None:
            return {"generated_tokens": 0, "forward_passes": 0}
        self.loop.close(state)
        return {"generated_tokens": state.generated_tokens, "forward_passes": state.forward_passes}

    def capacity(self, prompts: list[list[int]], until: int) -> int:
        """Rows per prompt of ``prompts`` that the KV cache's pool holds with ``until`` generated
        tokens each (memory-budget speculative rejection's first batch; KVCache.rows_that_fit)."""
        return self.loop.between_steps(lambda: self.runner.kv.rows_that_fit([len(p) for p in prompts], until))

    def stats(self) -> dict:
        return {"generated_tokens": self.generated_tokens, "forward_passes": self.forward_passes,
                "open_sessions": len(self.sessions), **self.runner.kv.stats()}

    def shutdown(self) -> None:
        """Nothing to free: the HF engine holds no processes, and its memory goes with the object."""

    def _session(self, session: str) -> Session:
        try:
            return self.sessions[session]
        except KeyError:
            raise ValueError(f"unknown session {session}") from None

    # -- model-side searches -----------------------------------------------------------------

    @property
    def search_host(self):
        """This engine as every model-side search's host (pipeline.engines.adapters.HFSearchHost);
        it keeps the searches' per-engine state."""
        if self._search_host is None:
            from pipeline.engines.adapters import HFSearchHost

            self._search_host = HFSearchHost(self)
        return self._search_host

    def search(self, search: Callable[..., list], prompts: list[list[int]], num_samples: int, seeds: list[int],
               sampling: SamplingParams, params) -> list:
        """Run a model-side strategy's search function (its strategy record's ``search``,
        e.g. pipeline.decoding.ults.search: ``search(host, prompts, num_samples, seeds, sampling,
        params) -> list[SearchOutput]``) on this engine's model. Searches keep state on the engine
        and run their own forward passes: one at a time, between two steps of the loop, outside
        inference mode (they may train or need autograd-free tensors of their own)."""
        if not callable(search):
            raise TypeError(f"HFEngine.search takes a model-side search function "
                            f"(host, prompts, num_samples, seeds, sampling, params), got {search!r}")
        host = self.search_host
        return self.loop.between_steps(
            lambda: _without_inference_mode(lambda: search(host, prompts, num_samples, seeds, sampling, params)))

    # -- convenience -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], num_samples: int, seeds: list[int],
                 sampling: SamplingParams) -> list[RowState]:
        """Sample every row to the end (what Best-of-N needs), ``seeds`` one per row, prompt-major.
        In one session where the KV cache's pool holds every row at full length; else in consecutive
        sessions of as many prompts' rows as it holds (a prompt's own rows split only where even they
        do not fit), since the loop preempts whole sessions and one that outgrows the pool cannot run;
        and of at most GENERATE_PREFILL_TOKENS padded prompt tokens each. The rows come back in
        order, each ``row`` its index in the call (prompt-major), whatever session ran it."""
        out = []
        for group, count, first in self._groups(prompts, num_samples, sampling.max_new_tokens):
            session = f"generate-{uuid.uuid4().hex}"
            self.open(session, group, count, seeds[first:first + len(group) * count], sampling)
            try:
                rows = self.extend(session, until=sampling.max_new_tokens)
                out += [dataclasses.replace(r, row=first + r.row) for r in rows]
            finally:
                self.close(session)
        return out

    def _groups(self, prompts: list[list[int]], num_samples: int, until: int):
        """(prompts, rows per prompt, first row's index) of generate's sessions: consecutive prompts while
        the pool holds all their rows; a prompt whose N rows alone do not fit, in runs of what does (at
        least one row: a row that outgrows the pool fails with KVBudgetError, as in the step), each
        group's padded prefill within GENERATE_PREFILL_TOKENS (a longer prompt alone)."""
        if _padded(prompts) <= GENERATE_PREFILL_TOKENS and self.capacity(prompts, until) >= num_samples:
            yield prompts, num_samples, 0
            return
        group, first = [], 0
        for i, prompt in enumerate(prompts):
            if group and (_padded([*group, prompt]) > GENERATE_PREFILL_TOKENS
                          or self.capacity([*group, prompt], until) < num_samples):
                yield group, num_samples, first
                group, first = [], i * num_samples
            if group or self.capacity([prompt], until) >= num_samples:
                group.append(prompt)
                continue
            step = max(1, self.capacity([prompt], until))
            for start in range(0, num_samples, step):
                yield [prompt], min(step, num_samples - start), i * num_samples + start
            first = (i + 1) * num_samples
        if group:
            yield group, num_samples, first


def _padded(prompts: list[list[int]]) -> int:
    """Tokens of the left-padded batch that prefills ``prompts`` in one pass."""
    return len(prompts) * max((len(p) for p in prompts), default=0)


def _without_inference_mode(run: Callable[[], Any]) -> Any:
    """``run()`` with inference mode off: the driving thread may be inside an ``extend``, which runs in it."""
    with torch.inference_mode(False):
        return run()
