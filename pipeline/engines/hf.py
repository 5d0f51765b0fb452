"""Batched incremental decoding with a KV cache over any Hugging Face causal LM.

The engine is stateful: a *session* holds a batch of candidate rows and their KV cache between
calls, so an algorithm can decode to a decision point, look at the partial responses, drop the
unpromising rows (from the batch and from the cache, which is where early termination saves
compute), and continue with the rest.

    engine.open(session, prompts, num_samples, seeds, sampling)   # prefill each prompt once, fan out
    engine.extend(session, until=32)                              # decode a chunk of steps
    engine.extend(session, until=128, keep=[0, 3, 5])             # prune rows, decode on
    engine.close(session)                                         # counters; frees the cache

Rows of several prompts share one batch (a pipeline.engines.rows.RowBatch): prompts are
left-padded, the attention mask hides the padding, and position ids count real tokens only, so a
row's logits match an unpadded run.
Every row samples with its own seeded ``torch.Generator`` (see pipeline.decoding.sampling).

Merged decoding (``merged=True``): several threads may call one engine at once (a threaded
GeneratorActor serving several batches, the coordinator's threads in-process), and the ``extend``
calls pending at any moment share one step loop: each step is one forward pass over the live rows
of every session being extended, their RowBatches concatenated (``RowBatch.concat``, left-padded to
a common cache length). Each call returns when its own rows reach its ``until`` (or EOS), so a
session that stops to be scored leaves the loop (``RowBatch.split``) while the others go on, and a
session that opens meanwhile is prefilled between two steps and joins at its first ``extend``. The
batch is re-cut only when its membership changes (a session joins or leaves, rows finish). Rows
sample from their own generators, so with the same seeds and the same batch composition the
candidates are identical; they are not bit-identical to the unmerged engine's: a row's logits
depend slightly on the rows that share its forward pass (left padding to a common length, kernels
chosen by batch shape; up to ~1.3e-4 on a real model), so a token sampled near a tie in the
inverse CDF may rarely differ, and the row diverges from there. The candidates' distribution is
the same. (The tiny test models' CPU passes happen to agree exactly.)

Speculative decoding (``speculative``, models.speculative, off by default): an extend to the length
cap (Best-of-N's rows, the candidates that survive speculative rejection's last decision token)
whose session has at most ``max_rows`` live rows decodes by drafting and verifying: each row
proposes up to k tokens by prompt lookup over its own prompt and response (vLLM's ngram method,
pipeline.decoding.speculative.prompt_lookup), one forward pass verifies every row's chain
(``RowBatch.verify``), and ADED's sampling acceptance (pipeline.decoding.aded.accept) keeps the
draft tokens the row's own sampler draws, one uniform per token in order, as plain decoding would:
the rows are the ones plain decoding makes (up to float rounding of the verification pass), in
fewer forward passes when drafts are accepted. The rejected drafts' cache columns stay, hidden by
the attention mask (``RowBatch.commit_prefixes``). Rows then advance unevenly, which is why only
extends to the cap speculate (an extend to a decision token needs every row at exactly tau). With
merged decoding such an extend (at most ``max_rows`` live rows when it starts) runs its steps
between the shared loop's, on its own rows; unmerged, a session switches to speculative steps as
soon as its rows thin out to ``max_rows``.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from pipeline.decoding.aded import accept_tokens
from pipeline.decoding.domain import RowState, check_open
from pipeline.decoding.sampling import SamplingParams, sample_next
from pipeline.decoding.speculative import SpeculativeDecoding, prompt_lookup
from pipeline.decoding.tree import TokenTree
from pipeline.engines.rows import RowBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
TOKENIZER_KEYS = ("revision", "trust_remote_code")
"""The loading settings (models.hf, ``HFLoadConfig.load_kwargs``) a tokenizer takes too."""


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
        self.bias = None if linear.bias is None else linear.bias.detach()

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
    return model


def load_tokenizer(name_or_path: str, load: dict | None = None):
    """Any HF tokenizer directory or hub id; a missing pad token falls back to EOS. ``load``: the
    model's loading keywords (models.hf), of which the tokenizer takes TOKENIZER_KEYS."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **{k: v for k, v in (load or {}).items()
                                                                if k in TOKENIZER_KEYS})
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def eos_token_ids(model, tokenizer) -> set[int]:
    """EOS ids from the generation config (it may list several) and the tokenizer."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple)) else [value])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


@dataclass
class _Session:
    sampling: SamplingParams
    batch: RowBatch | None  # the live rows' KV cache, aligned with ``rows``; None while in the step loop
    rows: list[int]  # live row ids, aligned with the batch dimension
    generators: list[torch.Generator]
    tokens: dict[int, list[int]]  # row id -> response tokens (EOS excluded)
    last_token: torch.Tensor | None = None  # [B] sampled, not yet in the cache: the next step feeds it
    finished: set[int] = field(default_factory=set)
    generated_tokens: int = 0
    forward_passes: int = 0  # the passes that decoded this session's rows (its prefill included)
    until: int | None = None  # the target of the extend under way; None: none is
    in_loop: bool = False  # merged decoding: the rows are in the step loop (set and cleared under its lock)
    positions: list[int] = field(default_factory=list)  # merged decoding: the live rows' positions there
    error: BaseException | None = None  # merged decoding: why the step loop dropped this session
    prompts: list[list[int]] = field(default_factory=list)  # the prompts' token ids (speculative decoding drafts from them)
    num_samples: int = 1  # rows per prompt: row r answers prompts[r // num_samples]

    @property
    def cache(self) -> DynamicCache:
        return self.batch.cache

    def extended(self) -> bool:
        """The pending extend is done: every live row holds ``until`` tokens (they advance in
        lockstep), or none is left."""
        return not self.rows or len(self.tokens[self.rows[0]]) >= self.until


@dataclass
class _Job:
    """Model work other than a decoding step (a prefill, a model-side search), run by the thread that
    drives the step loop, between two steps."""

    run: Callable[[], Any]
    result: Any = None
    error: BaseException | None = None
    done: bool = False


class HFEngine:
    """Generator implementation over an HF causal LM (see pipeline.decoding.domain.Generator)."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu", merged: bool = False,
                 speculative: SpeculativeDecoding | None = None):
        """``merged``: concurrent calls share one step loop (merged decoding, see the module
        docstring); False: calls must come one at a time (a caller serializes them).
        ``speculative``: speculative decoding of extends to the cap (module docstring); None or
        k = 0: off."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._eos = torch.tensor(sorted(self.eos_ids) or [-1], device=self.device)
        self.pad_id = tokenizer.pad_token_id
        self.sessions: dict[str, _Session] = {}
        self.generated_tokens = 0
        self.forward_passes = 0
        self.drafter = None
        """A Drafter for the methods that draft (dsbd): the draft model in-process or a DraftActor
        proxy, set by the GeneratorActor; None: they draft with ADED."""
        self._search_host = None
        self.merged = merged
        self.speculative = speculative if speculative is not None and speculative.enabled else None
        # Merged decoding's state; the condition's lock guards it.
        self._cond = threading.Condition()
        self._driving: int | None = None  # the thread that runs the model now (the loop's driver)
        self._jobs: list[_Job] = []  # model work waiting for the next gap between steps
        self._joining: list[_Session] = []  # sessions whose extend waits to join the loop
        self._members: list[_Session] = []  # sessions in the merged batch, in batch order
        self._merged: RowBatch | None = None  # the members' live rows, one KV cache
        self._waiters: list[tuple[Callable[[], bool], threading.Condition]] = []  # threads in _serve

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32",
                        merged: bool = False, speculative: SpeculativeDecoding | None = None,
                        prepack: bool = True, load: dict | None = None) -> HFEngine:
        """Any HF causal LM; a Reward Transformer directory (pipeline.engines.reward_transformer)
        loads with its reward channel, which model-side methods such as SLA read. ``prepack``: see
        ``for_inference``. ``load``: ``from_pretrained`` keywords (models.hf, ``load_pretrained``)."""
        from pipeline.engines.reward_transformer import RewardTransformer, has_reward_channel

        tokenizer = load_tokenizer(name_or_path, load)
        if has_reward_channel(name_or_path):
            model = RewardTransformer.from_pretrained(name_or_path, dtype=torch_dtype(dtype), device=device, load=load)
        else:
            model = load_pretrained(AutoModelForCausalLM, name_or_path, dtype, load)
        return cls(for_inference(model, device, dtype, prepack), tokenizer, device, merged=merged,
                   speculative=speculative)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", None) or self.tokenizer.model_max_length)

    # -- decoding ---------------------------------------------------------------------------

    def _append(self, session: _Session, logits: torch.Tensor) -> None:
        """Sample one token per live row from logits [B, V]; retire rows that hit EOS or the cap."""
        done = self._sample(session, logits)
        if done:
            retired = set(done)
            self._select(session, [i for i in range(len(session.rows)) if i not in retired])

    def _sample(self, session: _Session, logits: torch.Tensor) -> list[int]:
        """Sample one token per live row from logits [B, V]; returns the batch positions of the rows
        that hit EOS or the cap (now finished; the caller drops them)."""
        tokens = sample_next(logits, session.sampling, session.generators)  # [B]
        return self._record(session, tokens, *self._listed(tokens, session.sampling))

    def _listed(self, tokens: torch.Tensor, sampling: SamplingParams) -> tuple[list[int], list[bool]]:
        """Sampled tokens [B] as a list, and which of them are EOS."""
        is_eos = [False] * len(tokens) if sampling.ignore_eos else torch.isin(tokens, self._eos).tolist()
        return tokens.tolist(), is_eos

    def _record(self, session: _Session, tokens: torch.Tensor, listed: list[int], is_eos: list[bool]) -> list[int]:
        """Append each live row's sampled token (tokens [B], also as a list, with its EOS flags);
        returns the batch positions of the rows that hit EOS or the cap."""
        session.last_token = tokens
        session.generated_tokens += len(session.rows)
        self.generated_tokens += len(session.rows)
        cap = session.sampling.max_new_tokens
        done = []
        for i, (row, token, eos) in enumerate(zip(session.rows, listed, is_eos)):
            if not eos:
                session.tokens[row].append(token)
            if eos or len(session.tokens[row]) >= cap:
                done.append(i)
        session.finished.update(session.rows[i] for i in done)
        return done

    def _select(self, session: _Session, keep: list[int]) -> None:
        """Keep batch positions ``keep``: the batch, the KV cache and the samplers shrink together."""
        self._keep(session, keep, session.batch.select(keep))

    @staticmethod
    def _keep(session: _Session, keep: list[int], index: torch.Tensor) -> None:
        """The per-row state of ``_select`` (rows, samplers, pending tokens), without the batch."""
        session.last_token = session.last_token[index]
        session.rows = [session.rows[i] for i in keep]
        session.generators = [session.generators[i] for i in keep]

    # -- Generator protocol ----------------------------------------------------------------

    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams) -> None:
        if not self.merged:
            check_open(self.sessions, session, prompts, num_samples, seeds)
            self.sessions[session] = self._prefill(prompts, num_samples, seeds, sampling)
            return
        with self._cond:
            check_open(self.sessions, session, prompts, num_samples, seeds)
        state = self._between_steps(lambda: self._prefill(prompts, num_samples, seeds, sampling))
        with self._cond:
            check_open(self.sessions, session, prompts, num_samples, seeds)  # a concurrent open of the same id
            self.sessions[session] = state

    @torch.inference_mode()
    def _prefill(self, prompts: list[list[int]], num_samples: int, seeds: list[int],
                 sampling: SamplingParams) -> _Session:
        """A new session: each prompt prefilled once, fanned out to its rows, first tokens sampled."""
        generators = []
        for s in seeds:
            g = torch.Generator(device=self.device)
            g.manual_seed(s)
            generators.append(g)
        batch, out = RowBatch.prefill(self.model, prompts, self.pad_id, self.device, counted_by=(self,),
                                      logits_to_keep=1)  # once per prompt
        batch.fan_out(num_samples)
        state = _Session(sampling=sampling, batch=batch, rows=list(range(len(seeds))), generators=generators,
                         tokens={r: [] for r in range(len(seeds))}, forward_passes=1, prompts=prompts,
                         num_samples=num_samples)
        self._append(state, out.logits[:, -1, :].repeat_interleave(num_samples, 0))  # [R, V]
        return state

    @torch.inference_mode()
    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]:
        if not self.merged:
            state = self._session(session)
            reported = self._prune(state, session, keep)
            state.until = min(until, state.sampling.max_new_tokens)
            while not state.extended():
                if self._speculates(state):
                    self._speculative_step(state)
                    continue
                out = state.batch.feed(state.last_token[:, None], logits_to_keep=1)
                state.forward_passes += 1
                self._append(state, out.logits[:, -1, :])  # [B, V]
            state.until = None
            return self._report(state, reported)
        with self._cond:
            state = self._session(session)
            if state.until is not None:
                raise ValueError(f"session {session}: extend while another extend of it is under way")
            reported = self._prune(state, session, keep)
            state.until = min(until, state.sampling.max_new_tokens)
            speculate = self._speculates(state)
            if not speculate:
                try:
                    if not state.extended():
                        state.in_loop = True
                        self._joining.append(state)
                        self._serve(lambda: not state.in_loop)
                        if state.error is not None:
                            raise state.error
                finally:
                    state.until, state.error = None, None
        if speculate:  # its own steps, each between two of the shared loop's
            try:
                while not state.extended():
                    self._between_steps(lambda: self._speculative_step(state))
            finally:
                with self._cond:
                    state.until = None
        return self._report(state, reported)

    def _speculates(self, state: _Session) -> bool:
        """This extend decodes speculatively: it runs to the cap, with at most max_rows live rows."""
        return (self.speculative is not None and state.until == state.sampling.max_new_tokens
                and 0 < len(state.rows) <= self.speculative.max_rows)

    @torch.inference_mode()
    def _speculative_step(self, state: _Session) -> None:
        """One draft-and-verify step of the session's live rows (see the module docstring): each
        row gains its accepted draft tokens and one token its sampler drew; rows that hit EOS or
        the cap finish and leave the batch."""
        spec, sampling = self.speculative, state.sampling
        cap = sampling.max_new_tokens
        pending = state.last_token.tolist()  # sampled, not yet cached: each chain's root
        trees = []
        for i, row in enumerate(state.rows):
            tokens = state.tokens[row]
            room = min(spec.num_speculative_tokens, cap - len(tokens) - 1)  # the step's last token is a sample
            draft = prompt_lookup(state.prompts[row // state.num_samples] + tokens, room,
                                  spec.prompt_lookup_min, spec.prompt_lookup_max)
            trees.append(TokenTree.chain([pending[i]] + draft))
        logits = state.batch.verify(trees)  # [B, N, V]
        state.forward_passes += 1
        eos = set() if sampling.ignore_eos else self.eos_ids
        kept, last, done = [], [], []
        for i, (row, tree) in enumerate(zip(state.rows, trees)):
            _, accepted, token = accept_tokens(tree, logits[i], sampling, state.generators[i], eos)
            tokens = state.tokens[row]
            tokens.extend(accepted)
            if token not in eos:
                tokens.append(token)
            state.generated_tokens += len(accepted) + 1
            self.generated_tokens += len(accepted) + 1
            if token in eos or len(tokens) >= cap:
                done.append(i)
            kept.append(len(accepted) + 1)  # the root (the old pending token) and the accepted drafts
            last.append(token)
        state.batch.commit_prefixes(kept)
        state.last_token = torch.tensor(last, dtype=state.last_token.dtype, device=state.last_token.device)
        if done:
            state.finished.update(state.rows[i] for i in done)
            retired = set(done)
            self._select(state, [i for i in range(len(state.rows)) if i not in retired])

    def _prune(self, state: _Session, session: str, keep: list[int] | None) -> list[int]:
        """Keep only rows ``keep`` (all when None); the rows the extend reports: those kept, or the
        live and finished ones."""
        if keep is None:
            live = set(state.rows)
            return [r for r in state.tokens if r in state.finished or r in live]
        keep_set = set(keep)
        unknown = keep_set - set(state.tokens)
        if unknown:
            raise ValueError(f"session {session}: unknown rows {sorted(unknown)[:5]}")
        self._select(state, [i for i, r in enumerate(state.rows) if r in keep_set])
        return [r for r in state.tokens if r in keep_set]

    def _report(self, state: _Session, reported: list[int]) -> list[RowState]:
        decode = self.tokenizer.batch_decode([state.tokens[r] for r in reported], skip_special_tokens=True)
        return [RowState(row=r, token_ids=list(state.tokens[r]), text=text, finished=r in state.finished)
                for r, text in zip(reported, decode)]

    def close(self, session: str) -> dict:
        with self._cond:
            state = self.sessions.pop(session, None)
        if state is None:
            return {"generated_tokens": 0, "forward_passes": 0}
        return {"generated_tokens": state.generated_tokens, "forward_passes": state.forward_passes}

    # -- merged decoding -------------------------------------------------------------------------

    def _between_steps(self, run: Callable[[], Any]) -> Any:
        """Run ``run`` (model work) in the next gap between two steps of the loop; its result."""
        job = _Job(run)
        with self._cond:
            self._jobs.append(job)
            self._serve(lambda: job.done)
        if job.error is not None:
            raise job.error
        return job.result

    def _serve(self, done: Callable[[], bool]) -> None:
        """Return once ``done()``, the lock held on entry and exit. Meanwhile, if no other thread
        drives the step loop, drive it: run the waiting jobs, then one step, and again, until
        ``done()``; then hand the loop to a thread still waiting. Each waiting thread sleeps on its
        own condition and is woken only when its call is done or the loop needs a new driver (a
        wake-up per step for every batch in flight would cost more than the step's bookkeeping)."""
        if self._driving == threading.get_ident():
            raise RuntimeError("merged decoding: an engine call from inside the engine's own model work "
                               "(a model-side method calling open, extend or search) would wait for itself")
        waiter = (done, threading.Condition(self._cond))
        self._waiters.append(waiter)
        try:
            while not done():
                if self._driving is not None:
                    waiter[1].wait()
                    continue
                self._driving = threading.get_ident()
                try:
                    while not done():
                        self._drive()
                finally:
                    self._driving = None
                    self._wake(lambda d: d is not done and not d())  # the next driver: a call not done
        finally:
            self._waiters.remove(waiter)

    def _wake(self, which: Callable[[Callable[[], bool]], bool], first: bool = True) -> None:
        """Notify the waiting threads (or only the first) whose done-test ``which`` accepts."""
        for done, condition in self._waiters:
            if which(done):
                condition.notify()
                if first:
                    return

    def _drive(self) -> None:
        """One turn of the loop, the lock held on entry and exit but released for the model's work:
        the waiting jobs, then the sessions waiting to join, then one decoding step."""
        jobs, self._jobs = self._jobs, []
        joining, self._joining = self._joining, []
        if not jobs and not joining and not self._members:
            raise RuntimeError("merged decoding: a call waits, but no work is queued")
        self._cond.release()
        try:
            for job in jobs:
                try:
                    job.result = job.run()
                except Exception as exc:  # noqa: BLE001 - it belongs to the job's caller
                    job.error = exc
            try:
                left = self._step(joining)
            except Exception as exc:  # noqa: BLE001 - the step's callers each get the error
                left = self._members + joining
                for state in left:
                    state.error, state.rows = exc, []
                self._members, self._merged = [], None
        finally:
            self._cond.acquire()
        for job in jobs:
            job.done = True
        for state in left:
            state.in_loop = False
        if jobs or left:
            self._wake(lambda d: d(), first=False)

    @torch.inference_mode()
    def _step(self, joining: list[_Session]) -> list[_Session]:
        """Join ``joining``, decode one token for every member's live rows in one forward pass,
        then cut out the members whose extend is done (returned). Rows that finish stay in the
        merged batch, fed a placeholder token and never sampled, until they make up an eighth of
        it or a member leaves: cutting them out at once would copy the whole KV cache at almost
        every step."""
        if joining:
            width = len(self._merged.next_position) if self._merged is not None else 0
            for state in joining:
                state.positions = list(range(width, width + len(state.rows)))
                width += len(state.rows)
            self._members += joining
            self._merged = RowBatch.concat(([self._merged] if self._merged is not None else [])
                                           + [s.batch for s in joining], counted_by=(self,))
            for state in joining:
                state.batch = None  # its rows live in the merged batch until they leave
        if not self._members:
            return []
        width = len(self._merged.next_position)
        live = [p for s in self._members for p in s.positions]  # ascending: members in batch order
        pending = torch.cat([s.last_token for s in self._members])  # [live]
        if len(live) == width:
            tokens = pending
        else:  # finished rows ride along on a placeholder token
            index = torch.tensor(live, dtype=torch.long, device=pending.device)
            tokens = torch.zeros(width, dtype=pending.dtype, device=pending.device).index_copy_(0, index, pending)
        logits = self._merged.feed(tokens[:, None], logits_to_keep=1).logits[:, -1, :]  # [width, V]
        if len(live) < width:
            logits = logits[index]  # [live, V]
        sampling = self._members[0].sampling
        shared = all(s.sampling == sampling for s in self._members)
        if shared:  # the usual case: one draw for all rows
            sampled = sample_next(logits, sampling, [g for s in self._members for g in s.generators])  # [live]
            listed, is_eos = self._listed(sampled, sampling)
        stay: list[_Session] = []
        leave: list[_Session] = []
        offset = 0
        for state in self._members:
            rows = slice(offset, offset + len(state.rows))
            offset += len(state.rows)
            state.forward_passes += 1
            if shared:
                retired = set(self._record(state, sampled[rows], listed[rows], is_eos[rows]))
            else:  # rows sample independently, so a member's slice may sample on its own
                retired = set(self._sample(state, logits[rows]))
            if retired:
                keep = [i for i in range(len(state.positions)) if i not in retired]
                self._keep(state, keep, torch.tensor(keep, dtype=torch.long, device=state.last_token.device))
                state.positions = [state.positions[i] for i in keep]
            (leave if state.extended() else stay).append(state)
        finished = width - sum(len(s.positions) for s in self._members)
        if not leave and finished * 8 < width:
            return []
        parts = self._merged.split([[p for s in stay for p in s.positions]] + [s.positions for s in leave])
        for state, part in zip(leave, parts[1:]):
            part.counted_by = ()
            state.batch, state.positions = part, []
        position = 0
        for state in stay:
            state.positions = list(range(position, position + len(state.positions)))
            position += len(state.positions)
        self._members = stay
        self._merged = parts[0] if stay else None
        return leave

    def stats(self) -> dict:
        return {"generated_tokens": self.generated_tokens, "forward_passes": self.forward_passes,
                "open_sessions": len(self.sessions)}

    def _session(self, session: str) -> _Session:
        try:
            return self.sessions[session]
        except KeyError:
            raise ValueError(f"unknown session {session}") from None

    @property
    def search_host(self):
        """This engine as every model-side method's host (pipeline.engines.adapters.HFSearchHost);
        it keeps the methods' per-engine state."""
        if self._search_host is None:
            from pipeline.engines.adapters import HFSearchHost

            self._search_host = HFSearchHost(self)
        return self._search_host

    def search(self, method: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
               sampling: SamplingParams, params) -> list:
        """Run a model-side method (its pipeline.strategies record's ``search``) on this engine's model."""
        from pipeline.strategies import STRATEGIES

        record = STRATEGIES.get(method)
        if record is None or record.search is None:
            known = sorted(name for name, m in STRATEGIES.items() if m.search is not None)
            raise ValueError(f"unknown model-side method {method!r}; known: {known}")
        run = lambda: record.search(self.search_host, prompts, num_samples, seeds, sampling, params)  # noqa: E731
        if not self.merged:
            return run()
        # Model-side methods keep state on the engine and run their own forward passes: one at a
        # time, between steps, outside inference mode as when called directly.
        return self._between_steps(lambda: _without_inference_mode(run))

    # -- convenience -------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], num_samples: int, seeds: list[int],
                 sampling: SamplingParams) -> list[RowState]:
        """Sample every row to the end in one session (what Best-of-N needs)."""
        session = f"generate-{uuid.uuid4().hex}"
        self.open(session, prompts, num_samples, seeds, sampling)
        try:
            return self.extend(session, until=sampling.max_new_tokens)
        finally:
            self.close(session)


def _without_inference_mode(run: Callable[[], Any]) -> Any:
    with torch.inference_mode(False):
        return run()
