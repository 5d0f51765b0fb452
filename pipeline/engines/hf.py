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
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from pipeline.decoding.protocols import RowState, check_open
from pipeline.decoding.sampling import SamplingParams, sample_next
from pipeline.engines.rows import RowBatch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(name_or_path: str):
    """Any HF tokenizer directory or hub id; a missing pad token falls back to EOS."""
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
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
    batch: RowBatch  # the live rows' KV cache, aligned with ``rows``
    rows: list[int]  # live row ids, aligned with the batch dimension
    generators: list[torch.Generator]
    tokens: dict[int, list[int]]  # row id -> response tokens (EOS excluded)
    last_token: torch.Tensor | None = None  # [B] sampled, not yet in the cache: the next step feeds it
    finished: set[int] = field(default_factory=set)
    generated_tokens: int = 0

    @property
    def cache(self) -> DynamicCache:
        return self.batch.cache


class HFEngine:
    """Generator implementation over an HF causal LM (see pipeline.decoding.protocols.Generator)."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu"):
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

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32") -> HFEngine:
        """Any HF causal LM; a Reward Transformer directory (pipeline.engines.reward_transformer)
        loads with its reward channel, which model-side methods such as SLA read."""
        from pipeline.engines.reward_transformer import RewardTransformer, has_reward_channel

        tokenizer = load_tokenizer(name_or_path)
        if has_reward_channel(name_or_path):
            model = RewardTransformer.from_pretrained(name_or_path, dtype=DTYPES[dtype], device=device)
        else:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype]).to(device)
        return cls(model, tokenizer, device)

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", None) or self.tokenizer.model_max_length)

    # -- decoding ---------------------------------------------------------------------------

    def _append(self, session: _Session, logits: torch.Tensor) -> None:
        """Sample one token per live row from logits [B, V]; retire rows that hit EOS or the cap."""
        tokens = sample_next(logits, session.sampling, session.generators)  # [B]
        session.last_token = tokens
        session.generated_tokens += len(session.rows)
        self.generated_tokens += len(session.rows)
        if session.sampling.ignore_eos:
            is_eos = [False] * len(session.rows)
        else:
            is_eos = torch.isin(tokens, self._eos).tolist()
        cap = session.sampling.max_new_tokens
        done = []
        for i, (row, token, eos) in enumerate(zip(session.rows, tokens.tolist(), is_eos)):
            if not eos:
                session.tokens[row].append(token)
            if eos or len(session.tokens[row]) >= cap:
                done.append(i)
        if done:
            session.finished.update(session.rows[i] for i in done)
            retired = set(done)
            self._select(session, [i for i in range(len(session.rows)) if i not in retired])

    def _select(self, session: _Session, keep: list[int]) -> None:
        """Keep batch positions ``keep``: the batch, the KV cache and the samplers shrink together."""
        index = session.batch.select(keep)
        session.last_token = session.last_token[index]
        session.rows = [session.rows[i] for i in keep]
        session.generators = [session.generators[i] for i in keep]

    # -- Generator protocol ----------------------------------------------------------------

    @torch.inference_mode()
    def open(self, session: str, prompts: list[list[int]], num_samples: int, seeds: list[int],
             sampling: SamplingParams) -> None:
        check_open(self.sessions, session, prompts, num_samples, seeds)
        generators = []
        for s in seeds:
            g = torch.Generator(device=self.device)
            g.manual_seed(s)
            generators.append(g)
        batch, out = RowBatch.prefill(self.model, prompts, self.pad_id, self.device, counted_by=(self,),
                                      logits_to_keep=1)  # once per prompt
        batch.fan_out(num_samples)
        state = _Session(sampling=sampling, batch=batch, rows=list(range(len(seeds))), generators=generators,
                         tokens={r: [] for r in range(len(seeds))})
        self.sessions[session] = state
        self._append(state, out.logits[:, -1, :].repeat_interleave(num_samples, 0))  # [R, V]

    @torch.inference_mode()
    def extend(self, session: str, until: int, keep: list[int] | None = None) -> list[RowState]:
        state = self._session(session)
        if keep is not None:
            keep_set = set(keep)
            unknown = keep_set - set(state.tokens)
            if unknown:
                raise ValueError(f"session {session}: unknown rows {sorted(unknown)[:5]}")
            self._select(state, [i for i, r in enumerate(state.rows) if r in keep_set])
            reported = [r for r in state.tokens if r in keep_set]
        else:
            live = set(state.rows)
            reported = [r for r in state.tokens if r in state.finished or r in live]
        until = min(until, state.sampling.max_new_tokens)
        # Live rows advance in lockstep, so they all hold the same number of tokens.
        while state.rows and len(state.tokens[state.rows[0]]) < until:
            out = state.batch.feed(state.last_token[:, None], logits_to_keep=1)
            self._append(state, out.logits[:, -1, :])  # [B, V]
        decode = self.tokenizer.batch_decode([state.tokens[r] for r in reported], skip_special_tokens=True)
        return [RowState(row=r, token_ids=list(state.tokens[r]), text=text, finished=r in state.finished)
                for r, text in zip(reported, decode)]

    def close(self, session: str) -> dict:
        state = self.sessions.pop(session, None)
        if state is None:
            return {"generated_tokens": 0, "forward_passes": 0}
        return {"generated_tokens": state.generated_tokens, "forward_passes": state.batch.forward_passes}

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
        """Run a model-side method (its pipeline.methods record's ``search``) on this engine's model."""
        from pipeline.methods import METHODS

        record = METHODS.get(method)
        if record is None or record.search is None:
            known = sorted(name for name, m in METHODS.items() if m.search is not None)
            raise ValueError(f"unknown model-side method {method!r}; known: {known}")
        return record.search(self.search_host, prompts, num_samples, seeds, sampling, params)

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
