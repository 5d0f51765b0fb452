"""Batched reward scoring of prompt plus (partial) response with an HF sequence classifier.

The text is built with the reward tokenizer's chat template when it has one (user turn, then
assistant turn), else as prompt followed by response. Sequences longer than the model's context
are cut from the left, so the response, which the score is about, is always seen. A non-finite
score is returned as NaN, never turned into 0: for a final response the caller marks that candidate
as failed; for a partial one it is no signal at that decision token.

Two ways to score:
- ``score(prompts, responses)``: stateless, every call reads prompt and response in full.
- Streaming sessions, mirroring the generator's (``open`` / ``extend`` / ``close``): a session's
  rows keep their reward-side KV in the scorer's block pool (pipeline.engines.kv_cache, blocks of
  STREAM_BLOCK_SIZE tokens, runtime.reward_cache_mb; a prompt's head read once and its whole blocks
  shared by its samples), and ``extend`` feeds only the tokens that are new since the row was last
  scored, so a partial reward at a decision token costs one chunk, not a re-read (the paper's
  "multiple decision tokens" direction, section 7: decoder reward models can keep a KV cache).
  Rows not passed to ``extend`` give their blocks back at once.
  Encoder reward models (and any model whose incremental scores do not match full re-scoring,
  checked once at load) fall back to full re-scoring inside the same API.

How a row stays exact: the row's formatted text (template head + response + template tail) is
tokenized in full at every call; the longest common prefix with the tokens already cached is
kept, the cached tokens after it are cut off (a BPE merge across the old boundary, or the template
tail of the previous call), and only the rest is fed, at its true position ids; the cut and the
feed are one pass (``KVCache.feeding`` with ``keep``), so a pass that raises leaves the row's blocks
and its cached ids as they were, and its next call works. The score is read at the last token, as
full re-scoring reads it, so the two agree to float tolerance (tests/test_rewards.py).

``FunctionScorer`` serves the same protocol from a Python reward function instead of a model
(``models.reward: module:function``), with the signature of TRL's GRPOTrainer reward functions.
``CompositeScorer`` serves it from several rewards at once (``models.reward`` as a list, weighted by
``models.reward_weights``, as TRL's ``reward_funcs`` and ``reward_weights``).
"""

from __future__ import annotations

import importlib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers import AutoModelForSequenceClassification

from pipeline.data.chat import encode_chat, encode_text
from pipeline.decoding.domain import Scores
from pipeline.engines.hf import for_inference, load_pretrained, load_tokenizer
from pipeline.engines.kv_cache import WATERMARK, KVCache, bound_heap, trim_heap
from pipeline.engines.rows import RowBatch, timed_forward


BATCH_TOKENS = {"cpu": 1024, "cuda": 65536}
"""The most padded tokens in one reward pass (``RewardScorer._batches``), beside
runtime.reward_batch_size's sequences, per device unless runtime.reward_pass_tokens sets it: on a
CPU a pass's cost grows with its tokens anyway, and a bounded pass keeps its activations small; a
GPU runs a pass of many sequences in about the time of one, within its memory."""


STREAM_BLOCK_SIZE = 16
"""Tokens per block of the streaming sessions' pool: its attention gathers the rows' blocks (no
kernel wants 128-token pages), and a row's last block is its own, so small blocks waste little."""


def default_pass_tokens(device: str | torch.device) -> int:
    """BATCH_TOKENS for ``device`` (a device type not listed takes the GPU's)."""
    return BATCH_TOKENS.get(torch.device(device).type, BATCH_TOKENS["cuda"])


class _StreamingSessions:
    """RewardScorer's streaming sessions (``open`` / ``extend`` / ``close``; see the module
    docstring): each session's rows keep their reward-side KV in the scorer's block pool (``kv``),
    a prompt's head once for its samples. It reads the scorer's ``streaming``, ``cache_bytes``,
    ``device``, ``tokenizer``, ``model`` and counters, and its ``score``, ``encode`` and ``_batches``."""

    @property
    def kv(self) -> KVCache | None:
        """The streaming sessions' block pool (pipeline.engines.kv_cache): ``cache_bytes`` of blocks of
        STREAM_BLOCK_SIZE tokens over the base model, made at the first streamed row; None before,
        and for a scorer that does not stream or keeps no cache."""
        if self._kv is None and self.streaming and self.cache_bytes != 0:
            self._kv = KVCache(self._base_model(), self.device, self.cache_bytes, STREAM_BLOCK_SIZE,
                               counted_by=(self,), decode=False)
            self._kv.open_rows(0)  # allocates the pool
        return self._kv

    def open(self, session: str, prompts: list[str | list[dict]], num_samples: int,
             columns: list[dict] | None = None) -> None:
        """Start a session for rows ``prompt index * num_samples + sample`` (the generator's row ids)."""
        if session in self.sessions:
            raise ValueError(f"reward session {session} is already open")
        self.sessions[session] = _StreamSession(prompts=list(prompts), num_samples=num_samples)

    @torch.inference_mode()
    def extend(self, session: str, rows: list[int], responses: list[str],
               finished: list[bool] | None = None) -> list[float]:
        """Scores of (prompt of row, response so far) for each row. Rows of the session not listed
        here leave its cache. Equal to ``score`` on the same texts, to float tolerance."""
        state = self._stream(session)
        if len(rows) != len(responses):
            raise ValueError(f"{len(rows)} rows but {len(responses)} responses")
        prompts = [state.prompt_of(r) for r in rows]
        self._release(state, [r for r in state.handles if r not in set(rows)])  # rejected and finished rows
        before = self.tokens_read
        self._calls += 1
        state.last_call = self._calls
        try:
            return self._extend_rows(state, rows, prompts, responses, finished)
        finally:
            state.tokens_read += self.tokens_read - before

    def _extend_rows(self, state: _StreamSession, rows: list[int], prompts: list[str],
                     responses: list[str], finished: list[bool] | None = None) -> list[float]:
        """The streaming scores of ``rows``. A cached row keeps the longest common prefix of its tokens
        and the cache's, and reads the rest. An uncached row that goes on (not ``finished``) gets
        blocks: its prompt's shared head (template + prompt: the common prefix of the prompt's new
        rows' tokens) is read once and its whole blocks shared by those rows, as the generator's
        prefill shares a prompt; each row then reads its own tokens. A finished row without a cache
        is read in full without one (nothing will extend it again), and so is a row past the model's
        context (cut from the left). Passes hold at most batch_size rows and batch_tokens tokens
        (``_batches``). Where the pool lacks blocks, the sessions scored least recently give theirs
        back first (their rows are read in full at their next score), then this call's own rows read
        without a cache."""
        kv = self.kv if self.streaming else None
        if kv is None:
            return self.score(prompts, responses)
        token_ids = [self.encode(p, r) for p, r in zip(prompts, responses)]
        done = set() if finished is None else {r for r, f in zip(rows, finished) if f and r not in state.handles}
        full = [i for i, ids in enumerate(token_ids) if len(ids) > self.max_length or rows[i] in done]
        self._release(state, [rows[i] for i in full])
        full += self._admit(state, [i for i in range(len(rows)) if i not in set(full) and rows[i] not in state.handles],
                            rows, token_ids)
        scores: dict[int, float] = {}
        cached = [i for i in range(len(rows)) if rows[i] in state.handles]
        kept = {i: self._kept(state, rows[i], token_ids[i]) for i in cached}  # the tokens each row's blocks keep
        for group in self._batches([len(token_ids[i]) - kept[i] for i in cached]):
            picked = [cached[j] for j in group]
            keep = [kept[i] for i in picked]
            handles = [state.handles[rows[i]] for i in picked]
            chunks = [token_ids[i][k:] for i, k in zip(picked, keep)]
            if not self._make_room(kv.blocks_to_extend(handles, keep, [len(c) for c in chunks]), state):
                self._release(state, [rows[i] for i in picked])
                full += picked
                continue
            # The cut, the feed and the score are one (atomic): a pass that raises leaves each row's
            # blocks holding its cached ids, so the row's next call keeps what they say.
            with kv.feeding(handles, chunks, int(self.tokenizer.pad_token_id), keep=keep) as inputs:
                with timed_forward(self.device):
                    out = self._base_model()(**inputs)
                values = self.model.score(out.last_hidden_state[:, -1])[:, 0].float().tolist()  # [B]
            self.tokens_read += sum(len(c) for c in chunks)
            for i, v in zip(picked, values):
                state.ids[rows[i]] = token_ids[i]
                scores[rows[i]] = float(v) if math.isfinite(v) else math.nan
        if full:
            full = sorted(set(full))
            for i, v in zip(full, self.score([prompts[i] for i in full], [responses[i] for i in full])):
                scores[rows[i]] = v
            self.scored -= len(full)  # counted once, below
        self.scored += len(rows)
        return [scores[r] for r in rows]

    @staticmethod
    def _kept(state: _StreamSession, row: int, ids: list[int]) -> int:
        """The cached tokens row ``row`` keeps: its common prefix with ``ids``, less one when nothing
        is new (the last token is read again, where the score is read)."""
        common = common_prefix(state.ids[row], ids)
        return common - 1 if common == len(ids) else common

    def _admit(self, state: _StreamSession, picked: list[int], rows: list[int], token_ids: list[list[int]]) -> list[int]:
        """Blocks for the new rows ``picked`` (indexes into ``rows``): each prompt's head read once,
        its whole blocks shared by all its new rows (``shared_heads``), every row left at least one
        token to read; the heads are read in passes of ``_batches``. Returns the picked rows the
        pool cannot hold (read in full)."""
        kv = self.kv
        prompts = [rows[i] // state.num_samples for i in picked]
        heads = shared_heads([token_ids[i] for i in picked], prompts)
        refused: list[int] = []
        with_head = [p for p in sorted(heads) if heads[p]]
        for batch_of in self._batches([len(heads[p]) for p in with_head]):
            order = [with_head[j] for j in sorted(batch_of)]
            members = [i for i, p in zip(picked, prompts) if p in order]
            need = kv.blocks_for([len(heads[p]) for p in order], [prompts.count(p) for p in order]) + \
                math.ceil(WATERMARK * kv.num_blocks)
            if not self._make_room(need, state):
                refused += members
                continue
            batch, _ = RowBatch.prefill(self._base_model(), [heads[p] for p in order],
                                        int(self.tokenizer.pad_token_id), self.device, counted_by=(self,))
            self.tokens_read += sum(len(heads[p]) for p in order)
            handles = kv.admit(batch, [order.index(rows[i] // state.num_samples) for i in members])
            if handles is None:  # _make_room counted the watermark; a pool of one block may still refuse
                refused += members
                continue
            for i, handle in zip(members, handles):
                state.handles[rows[i]], state.ids[rows[i]] = handle, heads[rows[i] // state.num_samples]
        bare = [i for i, p in zip(picked, prompts) if not heads[p]]
        for i, handle in zip(bare, kv.open_rows(len(bare))):
            state.handles[rows[i]], state.ids[rows[i]] = handle, []
        return refused

    def _make_room(self, need: int, state: _StreamSession) -> bool:
        """At least ``need`` free blocks, freed where needed from the other sessions' rows, those
        scored least recently first (each read in full at its next score). False when even that
        does not make room."""
        kv = self.kv
        kv.collect()
        if need > kv.num_blocks:
            return False
        for other in sorted(self.sessions.values(), key=lambda s: s.last_call):
            if kv.free_blocks >= need:
                break
            if other is not state and other.handles:
                self.dropped_rows += len(other.handles)
                self._release(other, list(other.handles))
        return kv.free_blocks >= need

    def _release(self, state: _StreamSession, rows: list[int]) -> None:
        """Rows of ``state`` leave the pool."""
        handles = [state.handles.pop(r) for r in rows if r in state.handles]
        for r in rows:
            state.ids.pop(r, None)
        if handles:
            self.kv.release(handles)
            self.kv.collect()

    def close(self, session: str) -> dict:
        state = self.sessions.pop(session, None)
        if state is not None:
            self._release(state, list(state.handles))
        trim_heap()
        return {"tokens_read": state.tokens_read if state else 0}

    def _stream(self, session: str) -> _StreamSession:
        try:
            return self.sessions[session]
        except KeyError:
            raise ValueError(f"unknown reward session {session}") from None

    def _base_model(self):
        """The reward model without its score head: the rows' hidden states are what it returns."""
        return getattr(self.model, self.model.base_model_prefix)


class RewardScorer(_StreamingSessions):
    """Scorer implementation (see pipeline.decoding.domain.Scorer)."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu", batch_size: int = 32,
                 batch_tokens: int | None = None, cache_bytes: int | None = None):
        """``cache_bytes``: the streaming sessions' block pool, in bytes (runtime.reward_cache_mb; 0:
        no cache, every row read in full; None: pipeline.engines.kv_cache's default per device)."""
        if getattr(model.config, "num_labels", 1) != 1:
            raise ValueError(f"reward model must have one output label, has {model.config.num_labels}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.truncation_side = "left"
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.batch_tokens = batch_tokens or default_pass_tokens(device)
        """runtime.reward_pass_tokens (None: ``default_pass_tokens``)."""
        self.cache_bytes = cache_bytes
        self.dropped_rows = 0
        """Rows whose blocks were given back to make room for another session's (each read in full at
        its next score)."""
        self._calls = 0  # streaming calls so far: each session's last one orders the drops
        self.max_length = min(int(getattr(model.config, "max_position_embeddings", 0) or 10**9),
                              int(tokenizer.model_max_length or 10**9))
        self.forward_passes = 0
        self.scored = 0
        self.tokens_read = 0
        """Reward-model tokens run through the model (stateless and streaming): its compute."""
        self.sessions: dict[str, _StreamSession] = {}
        self._kv: KVCache | None = None
        self.streaming = streams_exactly(model, tokenizer, self.device)
        """True for decoder reward models whose cached scores match full re-scoring."""

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32",
                        batch_size: int = 32, prepack: bool = True, load: dict | None = None) -> RewardScorer:
        """``prepack``: see pipeline.engines.hf.for_inference; ``load``: models.hf's keywords."""
        tokenizer = load_tokenizer(name_or_path, load)
        model = load_pretrained(AutoModelForSequenceClassification, name_or_path, dtype, load)
        return cls(for_inference(model, device, dtype, prepack), tokenizer, device, batch_size)

    @classmethod
    def from_options(cls, name_or_path: str, options) -> RewardScorer:
        """The HF backend's reward scorer (pipeline.engines.backends: EngineOptions)."""
        scorer = cls.from_pretrained(name_or_path, device=options.device, dtype=options.dtype,
                                     batch_size=options.batch_size, prepack=options.prepack, load=options.load)
        scorer.cache_bytes = options.reward_cache_bytes
        if options.reward_pass_tokens:
            scorer.batch_tokens = options.reward_pass_tokens
        if options.bound_heap:
            bound_heap()
        return scorer

    def format(self, prompt: str | list[dict], response: str) -> str:
        """The reward model's text: the conversation (a string prompt is one user turn) plus the
        response as the assistant's turn, through the chat template when the tokenizer has one;
        without one, the turns' contents, one per paragraph, then the response."""
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": response}],
                                                      tokenize=False)
        if isinstance(prompt, str):
            return prompt + response
        return "\n\n".join(m["content"] for m in turns) + "\n\n" + response

    def encode(self, prompt: str | list[dict], response: str) -> list[int]:
        """Token ids of ``format(prompt, response)``, the prompt's and the response's text encoded as
        plain text (pipeline.data.chat.encode_chat): a special token's string inside a prompt
        cannot forge a turn the reward model reads. The chat template holds BOS when the model
        wants it; without one the tokenizer adds its own."""
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.tokenizer.chat_template:
            return encode_chat(self.tokenizer, turns + [{"role": "assistant", "content": response}],
                               add_generation_prompt=False)[1]
        return encode_text(self.tokenizer, self.format(prompt, response), add_special_tokens=True)

    @torch.inference_mode()
    def score(self, prompts: list[str | list[dict]], responses: list[str], finished: list[bool] | None = None,
              columns: list[dict] | None = None) -> list[float]:
        """A reward model reads the text alone: ``finished`` and ``columns`` are not used."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        # Cut from the left past the context: the response, which the score is about, stays.
        token_ids = [self.encode(p, r)[-self.max_length:] for p, r in zip(prompts, responses)]
        scores: list[float] = [math.nan] * len(token_ids)
        for group in self._batches([len(ids) for ids in token_ids]):
            batch = self.tokenizer.pad({"input_ids": [token_ids[i] for i in group]}, return_tensors="pt")
            with timed_forward(self.device):  # the streaming path's passes are timed by RowBatch
                logits = self.model(**batch.to(self.device)).logits  # [B, 1]
            self.forward_passes += 1
            self.tokens_read += int(batch["attention_mask"].sum())
            for i, v in zip(group, logits[:, 0].float().tolist()):
                scores[i] = float(v) if math.isfinite(v) else math.nan
        self.scored += len(token_ids)
        trim_heap()
        return scores

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """The sequences of these lengths in forward passes: longest first, so a pass pads little,
        each of at most ``batch_size`` sequences and ``batch_tokens`` padded tokens (one sequence
        alone may exceed it). A pass's activations grow with its padded tokens (its attention with
        their square), so the token bound is what bounds a scorer's memory."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        for i in order:
            if batches and len(batches[-1]) < self.batch_size and \
                    (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= self.batch_tokens:
                batches[-1].append(i)
            else:
                batches.append([i])
        return batches

    def stats(self) -> dict:
        """Counters; with the streaming sessions' pool, its ``kv_`` figures (KVCache.stats)."""
        return {"forward_passes": self.forward_passes, "scored": self.scored, "tokens_read": self.tokens_read,
                "open_sessions": len(self.sessions), "cached_bytes": self.cached_bytes(),
                "dropped_rows": self.dropped_rows, **(self._kv.stats() if self._kv is not None else {})}

    def cached_bytes(self) -> int:
        """Bytes of reward-side KV the open sessions hold (a prompt's shared blocks once)."""
        return self.kv.held_bytes() if self.kv is not None else 0

def streams_exactly(model, tokenizer, device: torch.device) -> bool:
    """Whether ``model`` scores exactly when streamed (RewardScorer.streaming): a decoder whose score
    computed in two cached chunks equals its one-pass score, and whose cache layers the block pool
    holds (full attention)."""
    score_head = getattr(model, "score", None)
    base_model = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if score_head is None or base_model is None:
        return False
    ids = torch.tensor([[int(tokenizer.pad_token_id or 0) + 1 + i for i in range(6)]], device=device)
    try:
        if not KVCache.supports(base_model):
            return False
        with torch.inference_mode():
            full = score_head(base_model(input_ids=ids).last_hidden_state[:, -1])
            rows = RowBatch.empty(base_model, 1, device)
            rows.feed(ids[:, :4])
            inc = score_head(rows.feed(ids[:, 4:]).last_hidden_state[:, -1])
    except Exception:  # an encoder that takes no cache
        return False
    # Half precision reorders sums between the one-pass and cached paths: a looser tolerance.
    tolerance = 1e-3 if next(model.parameters()).dtype == torch.float32 else 5e-2
    return bool(torch.allclose(full.float(), inc.float(), atol=tolerance, rtol=tolerance))


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_heads(token_ids: list[list[int]], prompts: list[int]) -> dict[int, list[int]]:
    """Per prompt, the head its rows share (template + prompt): the common prefix of its rows'
    tokens, less at least each row's last token, so every row has one to read. A prompt with one
    row shares nothing (an empty head): its row reads its whole text."""
    heads: dict[int, list[int]] = {}
    for ids, p in zip(token_ids, prompts):
        head = ids[:-1] if p not in heads else heads[p][:common_prefix(heads[p], ids)]
        heads[p] = head[:len(ids) - 1]
    return {p: head if prompts.count(p) > 1 else [] for p, head in heads.items()}


@dataclass
class _StreamSession:
    prompts: list[str]
    num_samples: int
    handles: dict[int, int] = field(default_factory=dict)  # row id -> its block-pool row
    ids: dict[int, list[int]] = field(default_factory=dict)  # row id -> the tokens its blocks hold
    tokens_read: int = 0
    last_call: int = 0  # the scorer's call count at this session's last extend

    def prompt_of(self, row: int) -> str:
        if not 0 <= row < len(self.prompts) * self.num_samples:
            raise ValueError(f"row {row} is outside this reward session")
        return self.prompts[row // self.num_samples]


FUNCTION_SPEC = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def is_reward_function(spec: str) -> bool:
    """Whether ``models.reward`` names a Python reward function (``module:function``, e.g.
    ``pipeline.judge:ifeval_reward``) rather than a model directory or Hub id."""
    return bool(FUNCTION_SPEC.match(spec or ""))


def load_reward_function(spec: str) -> Callable[..., list]:
    """The function ``module:function`` names; ValueError with one line when it cannot be had."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix, in one line
        raise ValueError(f"cannot import {module_name!r} ({type(exc).__name__}: {exc})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{module_name!r} has no function {name!r}")
    return fn


class FunctionScorer:
    """Scorer implementation over a reward function with the signature of TRL's GRPOTrainer reward
    functions (TRL docs, "Using a custom reward function"): ``fn(prompts=..., completions=...,
    **columns) -> list[float]``, one value per completion. Prompts are strings, or message lists for
    a conversation, whose completions are then ``[{"role": "assistant", "content": text}]`` as TRL
    passes them; each of the input row's other columns arrives as a keyword list (one value per
    completion), and so does ``partial``: True where the response is cut short (a partial reward
    at a speculative-rejection decision token), False where it is final. A function that ignores
    ``partial`` scores a prefix as if it were the whole response. None (TRL's convention for "no
    reward for this one"), NaN and inf all become NaN, and mean: for a partial response, no signal
    at that decision token (speculative rejection keeps the row live and leaves it out of the
    ranking); for a final response, a failed score (the candidate is quarantined, never paired).

    Sessions (``open`` / ``extend`` / ``close``) mirror RewardScorer's so speculative rejection runs
    unchanged; a function has no cache, so ``extend`` scores the listed rows' texts in full."""

    def __init__(self, spec: str):
        self.spec = spec
        self.fn = load_reward_function(spec)
        self.sessions: dict[str, tuple[list, list[dict], int]] = {}
        self.calls = 0
        self.scored = 0
        self.streaming = False

    def score(self, prompts: list[str | list[dict]], responses: list[str], finished: list[bool] | None = None,
              columns: list[dict] | None = None) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        if not responses:
            return []
        columns = columns if columns is not None else [{}] * len(responses)
        finished = finished if finished is not None else [True] * len(responses)
        names = sorted({name for c in columns for name in c})
        extra: dict[str, Any] = {name: [c.get(name) for c in columns] for name in names}
        extra["partial"] = [not f for f in finished]
        completions = [r if isinstance(p, str) else [{"role": "assistant", "content": r}]
                       for p, r in zip(prompts, responses)]
        values = self.fn(prompts=list(prompts), completions=completions, **extra)
        self.calls += 1
        if values is None or len(values) != len(responses):
            got = "None" if values is None else f"{len(values)} values"
            raise ValueError(f"reward function {self.spec} returned {got} for {len(responses)} completions")
        self.scored += len(responses)
        return [_finite(v) for v in values]

    def open(self, session: str, prompts: list[str | list[dict]], num_samples: int,
             columns: list[dict] | None = None) -> None:
        if session in self.sessions:
            raise ValueError(f"reward session {session} is already open")
        self.sessions[session] = (list(prompts), list(columns) if columns is not None else [{}] * len(prompts),
                                  num_samples)

    def extend(self, session: str, rows: list[int], responses: list[str],
               finished: list[bool] | None = None) -> list[float]:
        try:
            prompts, columns, num_samples = self.sessions[session]
        except KeyError:
            raise ValueError(f"unknown reward session {session}") from None
        if any(not 0 <= r < len(prompts) * num_samples for r in rows):
            raise ValueError(f"a row of {rows[:5]}... is outside this reward session")
        owner = [r // num_samples for r in rows]
        return self.score([prompts[i] for i in owner], responses, finished, [columns[i] for i in owner])

    def close(self, session: str) -> dict:
        self.sessions.pop(session, None)
        return {"tokens_read": 0}

    def stats(self) -> dict:
        return {"forward_passes": self.calls, "scored": self.scored, "tokens_read": 0,
                "open_sessions": len(self.sessions)}


def _finite(value: Any) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        return math.nan
    return v if math.isfinite(v) else math.nan


class CompositeScorer:
    """Scorer implementation over several rewards (``models.reward`` as a list): each component a
    RewardScorer, a VLLMRewardScorer or a FunctionScorer, and the score their weighted sum
    sum_k w_k r_k with ``weights`` (models.reward_weights), as TRL's GRPOTrainer sums its
    ``reward_funcs`` with ``reward_weights``. The sum is raw: no per-prompt standardization. A
    final score must not depend on which other candidates share its call (speculative rejection
    scores a prompt's candidates at different times: those that end early at a decision token, the
    others at the end), and the weights carry the scales. Measured (docs/benchmarks.md, "Composite
    rewards"): beside IFEval's checker, the real reward model at weight 0.02-0.1 chose as well raw as
    standardized per prompt.

    No signal (``combine``): a final response needs every component's score (any NaN fails it, as a
    single reward's NaN does). At a decision token, a component that has no score (None, NaN or inf)
    for one of a prompt's partial responses in the call is left out for all of that prompt's partial
    responses in it, so they are ranked on the same rewards; when every component is left out, the
    rows have no signal there (NaN: speculative rejection keeps them live). So a reward function that
    says nothing about prefixes leaves the decision to the others, and a tie in one reward (IFEval's
    checker scores every prefix that has broken nothing alike) is broken by the others.

    Like with like (``combine``'s ranks): a response that ended before a decision token is ranked
    there beside its prompt's partial responses, on the rewards their sums use, not on its full sum;
    else a reward silent on prefixes but high on finished responses would lift the cutoff (Eq. 3) by
    a term no partial response can have, and the rows stopped would not be those its scoring rewards
    rank lowest. Its score stays the full sum, which the output records.

    Sessions open one session per component, so a streaming reward model keeps its KV cache behind
    the composite as it does alone. ``score`` and ``extend`` return Scores: with each response's
    score, each reward's own from the same call (``combine``), which the candidates carry to the
    output's ``chosen_scores`` and ``rejected_scores``."""

    def __init__(self, scorers: list, weights: list[float], names: list[str]):
        if not scorers or len(scorers) != len(weights) or len(names) != len(scorers):
            raise ValueError(f"{len(scorers)} rewards, {len(weights)} weights and {len(names)} names")
        self.scorers, self.weights, self.names = list(scorers), [float(w) for w in weights], list(names)
        self.sessions: dict[str, int] = {}  # session -> its num_samples (row // it is the prompt)
        self.streaming = any(getattr(s, "streaming", False) for s in self.scorers)

    def components(self, prompts: list[str | list[dict]], responses: list[str], finished: list[bool] | None = None,
                   columns: list[dict] | None = None) -> list[list[float]]:
        """Each response's scores, one per component, in ``names``' order (stateless): ``score``'s components."""
        return self.score(prompts, responses, finished=finished, columns=columns).components

    def score(self, prompts: list[str | list[dict]], responses: list[str], finished: list[bool] | None = None,
              columns: list[dict] | None = None) -> Scores:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        groups = [p if isinstance(p, str) else json.dumps(p, sort_keys=True) for p in prompts]
        return combine(self._parts(prompts, responses, finished, columns), self.weights, finished, groups)

    def _parts(self, prompts, responses, finished, columns) -> list[list[float]]:
        """Each component's stateless scores of the responses (one list per component)."""
        return [s.score(prompts, responses, finished=finished, columns=columns) for s in self.scorers]

    def open(self, session: str, prompts: list[str | list[dict]], num_samples: int,
             columns: list[dict] | None = None) -> None:
        if session in self.sessions:
            raise ValueError(f"reward session {session} is already open")
        opened = []
        try:
            for scorer in self.scorers:
                scorer.open(session, prompts, num_samples, columns=columns)
                opened.append(scorer)
        except BaseException:
            for scorer in opened:
                scorer.close(session)
            raise
        self.sessions[session] = num_samples

    def extend(self, session: str, rows: list[int], responses: list[str],
               finished: list[bool] | None = None) -> Scores:
        if session not in self.sessions:
            raise ValueError(f"unknown reward session {session}")
        parts = [s.extend(session, rows, responses, finished=finished) for s in self.scorers]
        return combine(parts, self.weights, finished, [r // self.sessions[session] for r in rows])

    def close(self, session: str) -> dict:
        self.sessions.pop(session, None)
        out = [s.close(session) for s in self.scorers]
        return {"tokens_read": sum(int(o.get("tokens_read", 0)) for o in out)}

    def stats(self) -> dict:
        parts = [s.stats() for s in self.scorers]
        totals = {key: sum(int(p.get(key, 0)) for p in parts)
                  for key in ("forward_passes", "tokens_read", "cached_bytes", "dropped_rows")}
        return {**totals, "scored": max(int(p.get("scored", 0)) for p in parts), "open_sessions": len(self.sessions),
                "components": [{"reward": n, "weight": w, **p} for n, w, p in zip(self.names, self.weights, parts)]}

    def shutdown(self) -> None:
        for scorer in self.scorers:
            if hasattr(scorer, "shutdown"):
                scorer.shutdown()


def combine(parts: list[list[float]], weights: list[float], finished: list[bool] | None, groups: list) -> Scores:
    """The composite score of each response from its components' ``parts`` (one list per component):
    sum_k weights[k] * parts[k][i]. A finished response (``finished`` None: all are) needs every
    component finite (else NaN); partial responses of one group (a prompt) sum the components finite
    for all of them, the group's speaking components (none: NaN). See CompositeScorer. Each response's
    components come with its score (Scores): a final response's as its rewards gave them, a partial
    one's with NaN for each component its group's sum left out, so a score is the weighted sum of its
    finite components.

    Each response also gets its rank in this call (Scores.ranks), the value a decision compares: its score,
    except for a finished response of a group that also has partial responses here, whose rank is
    the weighted sum over that group's speaking components only (NaN when none speaks, or when one of
    them has no score for it). Speculative rejection ranks a prompt's rows that ended before the
    decision token beside its partial ones (the quantile r_cut, Eq. 3); a finished row's full sum
    counts components the partial sums leave out (a checker silent on prefixes), which would set the
    cutoff on a different scale from the rows it stops. Its score, the full sum, is what the output
    records."""
    n = len(groups)
    finished = [True] * n if finished is None else finished
    if any(len(p) != n for p in parts) or len(finished) != n:
        raise ValueError(f"component scores of lengths {[len(p) for p in parts]} for {n} responses")
    summed: list[list[int]] = [[] for _ in range(n)]  # per response, the components its score sums
    partial: dict[object, list[int]] = {}
    for i in range(n):
        if not finished[i]:
            partial.setdefault(groups[i], []).append(i)
        elif all(math.isfinite(p[i]) for p in parts):
            summed[i] = list(range(len(parts)))
    speaks: dict[object, list[int]] = {}  # per group with partial responses, its speaking components
    for group, members in partial.items():
        speaks[group] = [k for k, p in enumerate(parts) if all(math.isfinite(p[i]) for i in members)]
        for i in members:
            summed[i] = speaks[group]

    def weighted(i: int, ks: list[int]) -> float:
        return sum(weights[k] * parts[k][i] for k in ks) if ks else math.nan

    scores = [weighted(i, ks) for i, ks in enumerate(summed)]
    ranks = list(scores)
    for i in range(n):
        if finished[i] and groups[i] in speaks:  # like with like: the group's partial sums' components
            ks = speaks[groups[i]]
            ranks[i] = weighted(i, ks) if all(math.isfinite(parts[k][i]) for k in ks) else math.nan
    return Scores(scores, [[p[i] if finished[i] or k in summed[i] else math.nan for k, p in enumerate(parts)]
                           for i in range(n)], ranks)


def load_rewards(specs: list[str], weights: list[float] | None, load_model: Callable[[str], Any]):
    """The scorer of ``models.reward``: one reward's own scorer (a FunctionScorer for ``module:function``,
    ``load_model(spec)`` for a model) when there is one reward at weight 1, else a CompositeScorer
    over each of them with ``weights`` (None: 1 each)."""
    weights = [1.0] * len(specs) if weights is None else [float(w) for w in weights]
    scorers = []
    try:
        for spec in specs:
            scorers.append(FunctionScorer(spec) if is_reward_function(spec) else load_model(spec))
    except BaseException:
        for scorer in scorers:
            if hasattr(scorer, "shutdown"):
                scorer.shutdown()
        raise
    if len(scorers) == 1 and weights == [1.0]:
        return scorers[0]
    return CompositeScorer(scorers, weights, list(specs))
