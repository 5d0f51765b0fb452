"""The model runner: the model work of the HF engine's sessions (pipeline.engines.hf), with no
threads and no locks; the step loop (pipeline.engines.step_loop) decides when each piece runs.

A *session* (``Session``) holds a batch of candidate rows and their KV cache between calls, so an
algorithm can decode to a decision point, look at the partial responses, drop the unpromising rows
(from the batch and from the cache, which is where early termination saves compute), and continue
with the rest.

    state = runner.prefill(prompts, num_samples, seeds, sampling)  # each prompt once, first tokens
    finished = runner.step(batch, [state, other], live)            # one token for every live row of a shared batch
    runner.speculative_step(state)                                 # draft and verify the session's rows
    reported = runner.prune(state, keep, name)                     # drop rows (batch, cache, samplers)
    rows = runner.report(state, reported)                          # the rows as RowStates, texts decoded

Rows of several prompts share one batch (a pipeline.engines.rows.RowBatch): prompts are
left-padded, the attention mask hides the padding, and position ids count real tokens only, so a
row's logits match an unpadded run. Every row samples from its own counter-based random stream
(pipeline.decoding.sampling.RowStreams): its i-th token's uniform is a hash of (row seed, i), drawn
for all rows at once on the device. A step reads one tensor back from the device (the sampled
tokens and their EOS flags, together).

Speculative decoding (``speculative``, models.speculative, off by default): an extend to the length
cap (Best-of-N's rows, the candidates that survive speculative rejection's last decision token)
whose session has at most ``max_rows`` live rows when it starts decodes by drafting and verifying:
each row proposes up to k tokens by prompt lookup over its own prompt and response (vLLM's ngram
method, pipeline.decoding.speculative.prompt_lookup), one forward pass verifies every row's chain
(``RowBatch.verify``), and ADED's sampling acceptance (pipeline.decoding.aded.accept_tokens) keeps
the draft tokens the row's own sampler draws, one uniform per token in order, as plain decoding
would: the rows are the ones plain decoding makes (up to float rounding of the verification pass),
in fewer forward passes when drafts are accepted. The rejected drafts' cache columns stay, hidden
by the attention mask (``RowBatch.commit_prefixes``). Rows then advance unevenly, which is why only
extends to the cap speculate (an extend to a decision token needs every row at exactly tau).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from pipeline.decoding.aded import accept_tokens
from pipeline.decoding.domain import RowState
from pipeline.decoding.sampling import RowStreams, SamplingParams, sample_next
from pipeline.decoding.speculative import SpeculativeDecoding, prompt_lookup
from pipeline.decoding.tree import TokenTree
from pipeline.engines.backends import parse_memory
from pipeline.engines.attention_kernel import MAX_ROWS
from pipeline.engines.kv_cache import KVCache, bound_heap, trim_heap, unsupported_layers
from pipeline.engines.reward_transformer import RewardTransformer
from pipeline.engines.rows import RowBatch, timed_forward


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


@dataclass(eq=False)
class Session:
    """One open session's rows: the live ones' KV cache and samplers, every row's tokens, counters."""

    sampling: SamplingParams
    batch: RowBatch | None
    """The live rows' KV before their admission to the KV cache (one row per prompt while ``fan`` is
    set), or out of it for speculative decoding; None while the rows are in the KV cache (``kv``) or
    preempted."""
    rows: list[int]  # live row ids, aligned with the batch dimension
    streams: RowStreams  # the live rows' random streams, aligned with ``rows``
    tokens: dict[int, list[int]]  # row id -> response tokens (EOS excluded)
    last_token: torch.Tensor | None = None  # [B] sampled, not yet in the cache: the next step feeds it
    finished: set[int] = field(default_factory=set)
    generated_tokens: int = 0
    forward_passes: int = 0  # the passes that decoded this session's rows (its prefill included)
    until: int | None = None  # the target of the extend under way; None: none is
    prompts: list[list[int]] = field(default_factory=list)  # their token ids (speculative decoding drafts from them)
    num_samples: int = 1  # rows per prompt: row r answers prompts[r // num_samples]
    kv: list[int] | None = None
    """The live rows' handles in the runner's KV cache (pipeline.engines.kv_cache), aligned with
    ``rows``, from their admission until they finish or are pruned; None while the rows are in
    ``batch`` (not admitted yet) or preempted."""
    fan: list[int] | None = None
    """Before a session's rows are admitted: the row of ``batch`` (one per prompt, not fanned out)
    whose KV each live row starts from, aligned with ``rows``; the admission writes each prompt's
    whole blocks once and shares them (``KVCache.admit``), so the fanned-out copy is never made.
    None: ``batch`` holds one row per live row."""
    rewards: dict[int, float] | None = None
    """Row id -> the model's reward channel at the last token it read for the row (RowState.reward),
    kept by every pass that reads the rows (prefill, steps; a speculative step clears it, see
    ``speculative_step``); None: the session did not ask (``prefill``'s ``rewards``), and no pass
    computes it."""
    preempted: bool = False
    """The rows' blocks were taken back for others (``ModelRunner.preempt``); their KV is recomputed
    from their tokens when they are admitted again."""
    name: str = ""
    """The engine's name for the session (HFEngine.open), for the errors that name it."""
    closed: bool = False
    """Closed (``ModelRunner.close``): it holds nothing and is never admitted or stepped again."""
    fault: BaseException | None = None
    """An error raised for this session alone in the last pass (its sampler): the step loop ends the
    session with it and the pass's other sessions go on (ModelRunner._advance)."""

    @property
    def cache(self) -> DynamicCache:
        return self.batch.cache

    def extended(self) -> bool:
        """The pending extend is done: every live row holds ``until`` tokens (they advance in
        lockstep), or none is left."""
        return not self.rows or len(self.tokens[self.rows[0]]) >= self.until


class _Residency:
    """A ModelRunner's sessions in and out of its KV cache's blocks: admission (a prefill's rows, or
    a preempted session's recomputed), preemption, release, and a batch of their own for speculative
    decoding. Uses the runner's ``kv``, ``resident``, ``model``, ``pad_id`` and ``device``."""

    def blocks_needed(self, sessions: list[Session]) -> int:
        """Blocks the next step of ``sessions`` takes beyond the free ones (0: it fits)."""
        return max(0, self.kv.needed([h for s in sessions for h in s.kv]) - self.kv.free_blocks)

    def _resumed(self, state: Session) -> tuple[list[list[int]], list[int], list[list[int]]]:
        """A preempted session's recompute: its live rows' distinct prompts, each row's prompt (an
        index into them), and each row's response tokens but the pending one (what the KV held)."""
        order = sorted({r // state.num_samples for r in state.rows})
        prompts = [state.prompts[p] for p in order]
        sources = [order.index(r // state.num_samples) for r in state.rows]
        return prompts, sources, [state.tokens[r][:-1] for r in state.rows]

    def _resume_blocks(self, state: Session) -> int:
        """Blocks a preempted session's rows take when they come back: each prompt's whole blocks once,
        each row's own blocks past them (as they held before the preemption)."""
        prompts, sources, responses = self._resumed(state)
        bs = self.kv.block_size
        shared = sum(len(p) // bs for p in prompts)
        return shared + sum(-(-(len(prompts[p]) + len(t)) // bs) - len(prompts[p]) // bs
                            for p, t in zip(sources, responses))

    def _resume(self, state: Session) -> list[int]:
        """Recompute a preempted session's KV as its first admission shared it: each prompt prefilled
        once and admitted with its whole blocks shared by its rows (``KVCache.admit``), then each row's
        response tokens but the pending one fed in one chunked pass (``KVCache.feed``). Its handles;
        on an error every block goes back."""
        prompts, sources, responses = self._resumed(state)
        batch, _ = RowBatch.prefill(self.model, prompts, self.pad_id, self.device, counted_by=(self,),
                                    logits_to_keep=1)
        state.forward_passes += 1
        handles = self.kv.admit(batch, sources)
        if handles is None:
            return None
        try:
            fed = [i for i, t in enumerate(responses) if t]
            if fed:
                self.kv.feed([handles[i] for i in fed], [responses[i] for i in fed], self.pad_id, logits_to_keep=1)
                state.forward_passes += 1
        except BaseException:
            self.kv.release(handles)
            self.kv.collect()
            raise
        return handles

    @torch.inference_mode()
    def admit(self, state: Session) -> bool:
        """Write the session's rows into the KV cache (their one copy; a preempted session's
        recomputed first, its prompts' blocks shared again); False, nothing done, when their blocks
        do not fit now. Raises KVBudgetError when they could never fit."""
        if state.kv is not None:
            return True
        if not state.rows:
            state.kv, state.batch, state.fan, state.preempted = [], None, None, False
            return True
        if state.preempted:  # recompute only once the blocks fit
            if not self.kv.room_for(self._resume_blocks(state)):
                return False
            handles = self._resume(state)
        else:
            handles = self.kv.admit(state.batch, state.fan)
        if handles is None:
            return False
        state.kv, state.batch, state.fan, state.preempted = handles, None, None, False
        self.resident.append(state)
        return True

    def preempt(self, state: Session) -> None:
        """Give back the session's blocks (the newest session, when a step needs more than are free);
        its rows keep their tokens and samplers, and their KV is recomputed at their next admission."""
        if state.kv is None:
            return
        self.kv.release(state.kv)
        self.kv.collect()
        state.kv, state.preempted = None, True
        self.kv.preemptions += 1
        self._evict(state)

    def _evict(self, state: Session) -> None:
        if state in self.resident:
            self.resident.remove(state)

    def unpool(self, state: Session) -> None:
        """The session's rows in a batch of their own, one row each (speculative decoding verifies
        on it): out of the KV cache, fanned out from its prompts' KV, or recomputed (preempted)."""
        if state.kv is not None:
            state.batch = self.kv.take(state.kv) if state.kv else None
            state.kv = None
            self._evict(state)
        elif state.preempted:  # one row each, recomputed: speculative decoding verifies on its own batch
            texts = [state.prompts[r // state.num_samples] + state.tokens[r][:-1] for r in state.rows]
            state.batch, _ = RowBatch.prefill(self.model, texts, self.pad_id, self.device, counted_by=(self,),
                                              logits_to_keep=1)
            state.forward_passes += 1
            state.preempted = False
        elif state.fan is not None:
            state.batch.select(state.fan)
            state.fan = None

    def release(self, state: Session) -> None:
        """Free whatever the session's rows hold in the KV cache (a failed session), and the heap's
        free pages (kv_cache.trim_heap)."""
        if state.kv:
            self.kv.release(state.kv)
            self.kv.collect()  # the engine runs this between steps, on the loop's driver
        state.kv = [] if state.kv is not None else None
        self._evict(state)
        trim_heap()

    def close(self, state: Session) -> None:
        """End the session for good (HFEngine.close): its blocks, its own batch and its rows go, and
        it is never admitted again, preempted or not (the step loop takes it out of the step and of
        the waiting extends first: a member's rows are never freed under a step)."""
        self.release(state)
        state.closed, state.rows, state.batch, state.fan, state.preempted = True, [], None, None, False


class _Speculation:
    """A ModelRunner's speculative decoding of a session's rows (see the module docstring): whether an
    extend speculates, and one draft-and-verify step on the session's own batch. Uses the runner's
    ``speculative``, ``eos_ids``, ``generated_tokens`` and ``_select``."""

    def speculates(self, state: Session) -> bool:
        """An extend that starts now decodes speculatively: it runs to the cap, with at most
        max_rows live rows."""
        return (self.speculative is not None and state.until == state.sampling.max_new_tokens
                and 0 < len(state.rows) <= self.speculative.max_rows)

    @torch.inference_mode()
    def speculative_step(self, state: Session) -> None:
        """One draft-and-verify step of the session's live rows, on its own batch (see the module
        docstring): each row gains its accepted draft tokens and one token its sampler drew; rows
        that hit EOS or the cap finish and leave the batch."""
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
        kept, last, done, draws = [], [], [], []
        uniforms = state.streams.ahead(max(len(tree.tokens) for tree in trees)).to(logits.device)  # chains
        for i, (row, tree) in enumerate(zip(state.rows, trees)):
            path, accepted, token = accept_tokens(tree, logits[i], sampling, uniforms[i], eos)
            draws.append(len(path) if sampling.temperature else 0)
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
        state.streams.advance(draws)
        if state.rewards is not None:  # the verification pass reads no channel: no reward is current
            state.rewards.clear()
        state.batch.commit_prefixes(kept)
        state.last_token = torch.tensor(last, dtype=state.last_token.dtype, device=state.last_token.device)
        if done:
            state.finished.update(state.rows[i] for i in done)
            self._select(state, _without(len(state.rows), done))


class ModelRunner(_Residency, _Speculation):
    """The model, its tokenizer and the sessions' model work (see the module docstring)."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu", speculative: SpeculativeDecoding | None = None,
                 kv_cache_memory=None, heap: bool = False, kv_rows: int | None = None):
        """``speculative``: speculative decoding of extends to the cap; None or k = 0: off.
        ``kv_cache_memory``: runtime.kv_cache_memory (``parse_memory``'s forms; None: auto). ``heap``:
        runtime.bound_heap (glibc heap tuning). ``kv_rows``: runtime.rows_in_flight."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        self.eos_ids = eos_token_ids(model, tokenizer)
        self._eos = torch.tensor(sorted(self.eos_ids) or [-1], device=self.device)
        self.pad_id = tokenizer.pad_token_id
        self.speculative = speculative if speculative is not None and speculative.enabled else None
        self.generated_tokens = 0
        """Tokens sampled for every session and model-side search on this model."""
        self.forward_passes = 0
        """Forward passes over this model's sessions (a shared step counts once)."""
        if heap:
            bound_heap()
        kinds = ", ".join(sorted({type(layer).__name__ for layer in unsupported_layers(self.model)}))
        if kinds:
            raise ValueError(f"HF engine: {type(self.model).__name__} has cache layers that are not full attention "
                             f"({kinds}: sliding-window, chunked or other); use models.backend vllm")
        self.kv = KVCache(self.model, self.device, parse_memory(kv_cache_memory), counted_by=(self,),
                          max_rows=kv_rows or MAX_ROWS)
        """The sessions' KV from their admission (pipeline.engines.kv_cache)."""
        self.resident: list[Session] = []
        """Sessions holding blocks, in admission order (the newest is preempted first)."""
        self.reads_rewards = isinstance(self.model, RewardTransformer)
        """The model has a reward channel that a session may ask its passes to read (``prefill``)."""

    # -- a session's rows --------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], num_samples: int, seeds: list[int],
                sampling: SamplingParams, rewards: bool = False) -> Session:
        """A new session: each prompt prefilled once, its rows' first tokens sampled; each prompt's
        KV is written into the KV cache when the rows are admitted, shared by its samples.
        ``rewards``: the session's passes also read the Reward Transformer's channel
        (``Session.rewards``); ValueError when the model has none."""
        if rewards and not self.reads_rewards:
            raise ValueError(f"HF engine: rewards asked of {type(self.model).__name__}, which has no reward "
                             "channel (a Reward Transformer generator has one)")
        batch, out = RowBatch.prefill(self.model, prompts, self.pad_id, self.device, counted_by=(self,),
                                      logits_to_keep=1, **_with_rewards(rewards))  # once per prompt
        state = Session(sampling=sampling, batch=batch, rows=list(range(len(seeds))),
                        streams=RowStreams.seeded(seeds, self.device),
                        tokens={r: [] for r in range(len(seeds))}, forward_passes=1, prompts=prompts,
                        num_samples=num_samples, fan=[r // num_samples for r in range(len(seeds))],
                        rewards={} if rewards else None)
        if rewards:  # R' at each prompt's last token, shared by its samples
            _keep_rewards([state], out.rewards[:, -1].repeat_interleave(num_samples, 0))
        finished = self._sample(state, out.logits[:, -1, :].repeat_interleave(num_samples, 0))  # [R, V]
        if finished:
            self._select(state, _without(len(state.rows), finished))
        return state

    def prune(self, state: Session, keep: list[int] | None, name: str) -> list[int]:
        """Keep only rows ``keep`` (all when None) of session ``name``; the rows an extend reports:
        those kept, or the live and finished ones."""
        if keep is None:
            live = set(state.rows)
            return [r for r in state.tokens if r in state.finished or r in live]
        keep_set = set(keep)
        unknown = keep_set - set(state.tokens)
        if unknown:
            raise ValueError(f"session {name}: unknown rows {sorted(unknown)[:5]}")
        self._select(state, [i for i, r in enumerate(state.rows) if r in keep_set])
        return [r for r in state.tokens if r in keep_set]

    def report(self, state: Session, reported: list[int]) -> list[RowState]:
        decode = self.tokenizer.batch_decode([state.tokens[r] for r in reported], skip_special_tokens=True)
        rewards = state.rewards if state.rewards is not None else {}
        return [RowState(row=r, token_ids=list(state.tokens[r]), text=text, finished=r in state.finished,
                         reward=rewards.get(r)) for r, text in zip(reported, decode)]

    # -- decoding ----------------------------------------------------------------------------

    @torch.inference_mode()
    def step_kv(self, sessions: list[Session]) -> list[list[int]]:
        """One decoding step of ``sessions``' live rows, which are in the KV cache (``Session.kv``),
        in one forward pass over the blocks (KVCache.stepping): feed each row's pending token, sample its next one,
        record it; rows that hit EOS or the cap leave their session and free their blocks. The
        blocks the step takes must be free (``room``). Per session, the indices of those rows in
        its rows before the step."""
        pending = torch.cat([s.last_token for s in sessions])  # [live]
        handles = [h for s in sessions for h in s.kv]
        asked = any(s.rewards is not None for s in sessions)
        with self.kv.stepping(handles, pending) as inputs, timed_forward(self.device):
            out = self.model(**inputs, logits_to_keep=1, **_with_rewards(asked))
        _keep_rewards(sessions, out.rewards[:, -1] if asked else None)  # [live]
        return self._advance(sessions, out.logits[:, -1, :])  # logits [live, V]

    @torch.inference_mode()
    def step(self, batch: RowBatch, sessions: list[Session], live: list[int]) -> list[list[int]]:
        """One decoding step of ``sessions``' live rows in their shared ``batch``, one forward pass:
        feed each row's pending token, sample its next one from the row's own stream, record it.
        ``live``: the batch positions of the sessions' live rows, the sessions' rows one after
        another; the batch's other rows are finished rows that ride along on a placeholder token and
        are never sampled. Rows that hit EOS or the cap leave their session's per-row state (rows,
        samplers, pending tokens; the caller cuts the batch). Per session, the indices of those rows
        in its rows before the step."""
        width = len(batch.next_position)
        pending = torch.cat([s.last_token for s in sessions])  # [live]
        if len(live) == width:
            tokens = pending
        else:
            index = torch.tensor(live, dtype=torch.long, device=pending.device)
            tokens = torch.zeros(width, dtype=pending.dtype, device=pending.device).index_copy_(0, index, pending)
        asked = any(s.rewards is not None for s in sessions)
        out = batch.feed(tokens[:, None], logits_to_keep=1, **_with_rewards(asked))
        logits, rewards = out.logits[:, -1, :], out.rewards[:, -1] if asked else None  # [width, V], [width]
        if len(live) < width:
            logits, rewards = logits[index], None if rewards is None else rewards[index]  # [live, V], [live]
        _keep_rewards(sessions, rewards)
        finished = self._advance(sessions, logits)
        for state in sessions:  # no step loop here to end one session alone: the caller gets it
            if state.fault is not None:
                fault, state.fault = state.fault, None
                raise fault
        return finished

    def _advance(self, sessions: list[Session], logits: torch.Tensor) -> list[list[int]]:
        """Sample the next token of every live row of ``sessions`` from logits [live, V] (the
        sessions' rows one after another) and record it; rows that hit EOS or the cap leave their
        session's per-row state (and their blocks). Per session, their indices before the step."""
        sampling = sessions[0].sampling
        shared = all(s.sampling == sampling for s in sessions)
        if shared:  # the usual case: one draw for all rows
            try:
                streams = RowStreams.cat([s.streams for s in sessions])
                sampled = sample_next(logits, sampling, streams)  # [live]
            except Exception:  # noqa: BLE001 - whose it is: each session draws alone below
                if len(sessions) == 1:  # its own, and its streams may have moved: the step's error
                    raise
                shared = False  # the joined copy's counters moved, never the sessions' own
            else:
                if len(sessions) > 1 and sampling.temperature != 0:  # the draw moved the joined copy's counters
                    for state in sessions:
                        state.streams.counters.add_(1)
                listed, is_eos = self._listed(sampled, sampling)
        finished = []
        offset = 0
        for state in sessions:
            rows = slice(offset, offset + len(state.rows))
            offset += len(state.rows)
            state.forward_passes += 1
            if shared:
                done = self._record(state, sampled[rows], listed[rows], is_eos[rows])
            else:  # rows sample independently, so a session's slice may sample on its own
                try:
                    done = self._sample(state, logits[rows])
                except Exception as exc:  # noqa: BLE001 - this session's alone: the loop ends it
                    state.fault = exc
                    finished.append([])
                    continue
            if done:
                keep = _without(len(state.rows), done)
                if state.kv is not None:
                    self.kv.release([state.kv[i] for i in done])
                self._keep(state, keep, torch.tensor(keep, dtype=torch.long, device=state.last_token.device))
            finished.append(done)
        return finished

    def _sample(self, state: Session, logits: torch.Tensor) -> list[int]:
        """Sample one token per live row from logits [B, V]; the batch positions of the rows that
        hit EOS or the cap (now finished; the caller drops them)."""
        tokens = sample_next(logits, state.sampling, state.streams)  # [B]
        return self._record(state, tokens, *self._listed(tokens, state.sampling))

    def _listed(self, tokens: torch.Tensor, sampling: SamplingParams) -> tuple[list[int], list[bool]]:
        """Sampled tokens [B] as a list, and which of them are EOS: one read from the device."""
        if sampling.ignore_eos:
            return tokens.tolist(), [False] * len(tokens)
        listed, is_eos = torch.stack([tokens, torch.isin(tokens, self._eos).to(tokens.dtype)]).tolist()
        return listed, [bool(e) for e in is_eos]

    def _record(self, state: Session, tokens: torch.Tensor, listed: list[int], is_eos: list[bool]) -> list[int]:
        """Append each live row's sampled token (tokens [B], also as a list, with its EOS flags);
        the batch positions of the rows that hit EOS or the cap."""
        state.last_token = tokens
        state.generated_tokens += len(state.rows)
        self.generated_tokens += len(state.rows)
        cap = state.sampling.max_new_tokens
        done = []
        for i, (row, token, eos) in enumerate(zip(state.rows, listed, is_eos)):
            if not eos:
                state.tokens[row].append(token)
            if eos or len(state.tokens[row]) >= cap:
                done.append(i)
        state.finished.update(state.rows[i] for i in done)
        return done

    def _select(self, state: Session, keep: list[int]) -> None:
        """Keep batch positions ``keep``: the batch (or the KV cache's rows: the others' blocks are
        freed, no row moves), the KV cache and the samplers shrink together."""
        if state.kv is not None or state.preempted:
            kept = set(keep)
            if state.kv is not None:
                self.kv.release([h for i, h in enumerate(state.kv) if i not in kept])
            self._keep(state, keep, torch.tensor(keep, dtype=torch.long, device=self.device))
            return
        if state.fan is not None:  # the prompts' KV stays as it is; the rows drop their references
            state.fan = [state.fan[i] for i in keep]
            self._keep(state, keep, torch.tensor(keep, dtype=torch.long, device=self.device))
            return
        self._keep(state, keep, state.batch.select(keep))

    @staticmethod
    def _keep(state: Session, keep: list[int], index: torch.Tensor) -> None:
        """The per-row state of ``_select`` (rows, streams, pending tokens), without the batch."""
        state.last_token = state.last_token[index]
        state.rows = [state.rows[i] for i in keep]
        state.streams = state.streams.select(index.to(state.streams.device))
        if state.kv is not None:
            state.kv = [state.kv[i] for i in keep]


def _without(count: int, dropped: list[int]) -> list[int]:
    """The positions 0 .. count - 1 not in ``dropped``."""
    gone = set(dropped)
    return [i for i in range(count) if i not in gone]


def _with_rewards(asked: bool) -> dict:
    """The model keywords of a pass that reads the reward channel when ``asked``; none otherwise,
    so a pass no session asked of costs what a bare model's does."""
    return {"with_rewards": True} if asked else {}


def _keep_rewards(sessions: list[Session], rewards: torch.Tensor | None) -> None:
    """Record rewards [live] (the sessions' live rows one after another, before the pass's tokens are
    sampled) as each asking session's rows' latest reward; one read from the device."""
    if rewards is None:
        return
    values = rewards.float().tolist()
    offset = 0
    for state in sessions:
        if state.rewards is not None:
            state.rewards.update(zip(state.rows, values[offset:offset + len(state.rows)]))
        offset += len(state.rows)
