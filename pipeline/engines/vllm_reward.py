"""The reward model on vLLM's pooling runner (``models.reward_backend: vllm``): a
sequence-classification reward model (one label; ``LlamaForSequenceClassification`` and the like)
served by ``vllm.LLM(runner="pooling")``, each text scored with ``LLM.classify`` and the pooler's
activation turned off (``PoolingParams(use_activation=False)``), so a score is the model's raw
logit, as RewardScorer's is.

The same Scorer protocol and the same text as the HF scorer (pipeline.engines.rewards.RewardScorer):
``format`` and ``encode`` are RewardScorer's own functions, over the reward model's HF tokenizer, so
the chat template, the response as the assistant's turn, prompts encoded as plain text and the cut
from the left past the context are the same; vLLM gets the token ids, never the text. A non-finite
score is NaN. ``finished`` (a partial response at a decision token) changes nothing: a reward model
reads the text alone, as in RewardScorer. Scores equal RewardScorer's to float tolerance
(tests/test_vllm_reward.py measures it on the tiny and the real reward model).

Streaming sessions (``open`` / ``extend`` / ``close``) are stateless here: ``extend`` scores the
listed rows' whole texts. The KV cache RewardScorer keeps per row is vLLM's automatic prefix cache
(``enable_prefix_caching=True``; vLLM 0.32 serves it for decoder pooling models with LAST pooling,
which sequence classifiers use, and reads cached blocks for the classify task): the template and
prompt shared by a prompt's N rows, and a row's text up to its previous decision token, are found
in the cache, so the partial reward at a decision token recomputes only the tokens past the last
full cached block. On vLLM's CPU backend a block is 128 tokens (``block_size`` in
models.reward_vllm changes it; the CPU backend wants a multiple of 32).

Stats, as RewardScorer reports them: ``forward_passes`` counts ``LLM.classify`` calls (vLLM runs each
in as many engine steps as its scheduler takes, which it does not report), ``scored`` the texts,
``tokens_read`` the tokens the model computed (prompt tokens less prefix-cache hits, from each
request's ``num_cached_tokens``), and ``tokens_cached`` the hits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.engines.hf import load_tokenizer
from pipeline.engines.rewards import RewardScorer
from pipeline.engines.rows import timed_forward
from pipeline.engines.vllm_engine import _environment, cpu_defaults


@dataclass
class _Session:
    prompts: list[str | list[dict]]
    num_samples: int
    tokens_read: int = 0

    def prompt_of(self, row: int) -> str | list[dict]:
        if not 0 <= row < len(self.prompts) * self.num_samples:
            raise ValueError(f"row {row} is outside this reward session")
        return self.prompts[row // self.num_samples]


class VLLMRewardScorer:
    """Scorer implementation (see pipeline.decoding.domain.Scorer) over a ``vllm.LLM`` built with
    ``runner="pooling"`` for a one-label sequence classifier. See the module docstring."""

    format = RewardScorer.format
    """RewardScorer.format: the reward model's text of (prompt, response)."""
    encode = RewardScorer.encode
    """RewardScorer.encode: the token ids of that text, prompts encoded as plain text."""

    streaming = False
    """No reward-side cache of our own: ``extend`` re-scores whole texts and vLLM's prefix cache
    skips what it has seen (jobs.counterfactual reports this flag)."""

    def __init__(self, llm: Any, tokenizer, pooling_params: Any = None):
        """``llm``: a pooling ``vllm.LLM`` whose model classifies into one label; ``tokenizer``: the
        reward model's HF tokenizer (its chat template formats the texts); ``pooling_params``: the
        requests' ``vllm.PoolingParams`` (activation off: raw logits)."""
        if "classify" not in llm.supported_tasks:
            raise ValueError(f"vLLM serves this reward model for {sorted(llm.supported_tasks)}, not classify: "
                             "models.reward must be a sequence-classification model")
        labels = int(getattr(llm.model_config.hf_config, "num_labels", 1))
        if labels != 1:
            raise ValueError(f"reward model must have one output label, has {labels}")
        if pooling_params is None:
            from vllm import PoolingParams

            pooling_params = PoolingParams(use_activation=False)
        self.llm = llm
        self.tokenizer = tokenizer
        self.pooling_params = pooling_params
        self.max_length = min(int(llm.model_config.max_model_len), int(tokenizer.model_max_length or 10**9))
        """Longest text scored; longer ones are cut from the left (the response stays), as RewardScorer does."""
        self.forward_passes = 0
        self.scored = 0
        self.tokens_read = 0
        """Tokens the model computed: the texts' tokens less the prefix cache's hits."""
        self.tokens_cached = 0
        """Tokens of the texts vLLM's prefix cache served instead."""
        self.sessions: dict[str, _Session] = {}

    @classmethod
    def from_options(cls, name_or_path: str, options) -> VLLMRewardScorer:
        """The vLLM backend's reward scorer (pipeline.engines.backends: EngineOptions; its
        ``settings`` are models.reward_vllm)."""
        return cls.from_pretrained(name_or_path, dtype=options.dtype, num_threads=options.num_threads,
                                   batch_size=options.batch_size, **(options.settings or {}))

    @classmethod
    def from_pretrained(cls, name_or_path: str, dtype: str = "float32", num_threads: int | None = None,
                        batch_size: int | None = None, **llm_kwargs) -> VLLMRewardScorer:
        """A pooling ``vllm.LLM`` for the reward model, with prefix caching, under
        pipeline.engines.vllm_engine.cpu_defaults on a machine without a GPU (``num_threads``: the
        reward actor's CPUs). ``batch_size`` (runtime.reward_batch_size: sequences per forward pass)
        is vLLM's ``max_num_seqs`` unless ``llm_kwargs`` names one. ``llm_kwargs`` (models.reward_vllm)
        go to ``vllm.LLM`` over the defaults; the tokenizer is the model's HF tokenizer at the same
        ``tokenizer_revision`` / ``revision``."""
        from vllm import LLM

        if batch_size is not None:
            llm_kwargs.setdefault("max_num_seqs", batch_size)
        llm_kwargs.setdefault("enable_prefix_caching", True)
        llm_kwargs, env = cpu_defaults(llm_kwargs, num_threads)
        revision = llm_kwargs.get("tokenizer_revision") or llm_kwargs.get("revision")
        tokenizer = load_tokenizer(name_or_path, {"revision": revision,
                                                  "trust_remote_code": bool(llm_kwargs.get("trust_remote_code"))})
        with _environment(env):  # vLLM's engine and worker processes start inside LLM()
            llm = LLM(model=name_or_path, runner="pooling", dtype=dtype, **llm_kwargs)
        return cls(llm, tokenizer)

    def score(self, prompts: list[str | list[dict]], responses: list[str], finished: list[bool] | None = None,
              columns: list[dict] | None = None) -> list[float]:
        """A reward model reads the text alone: ``finished`` and ``columns`` are not used."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        # Cut from the left past the context: the response, which the score is about, stays.
        return self._classify([self.encode(p, r)[-self.max_length:] for p, r in zip(prompts, responses)])

    def _classify(self, token_ids: list[list[int]]) -> list[float]:
        """One ``LLM.classify`` call over the texts' token ids; the raw logit of each."""
        if not token_ids:
            return []
        # classify returns when every score is back: the actor's timeline counts it as one forward pass.
        with timed_forward(torch.device("cpu")):
            outputs = self.llm.classify([{"prompt_token_ids": ids} for ids in token_ids],
                                        pooling_params=self.pooling_params, use_tqdm=False)
        if len(outputs) != len(token_ids):
            raise RuntimeError(f"vLLM returned {len(outputs)} scores for {len(token_ids)} texts")
        scores = []
        for ids, out in zip(token_ids, outputs):
            if out.error is not None:
                raise RuntimeError(f"vLLM failed to score a {len(ids)}-token text: {out.error}")
            value = float(out.outputs.probs[0])
            scores.append(value if math.isfinite(value) else math.nan)
            cached = int(out.num_cached_tokens or 0)
            self.tokens_cached += cached
            self.tokens_read += len(ids) - cached
        self.forward_passes += 1
        self.scored += len(token_ids)
        return scores

    def stats(self) -> dict:
        return {"forward_passes": self.forward_passes, "scored": self.scored, "tokens_read": self.tokens_read,
                "tokens_cached": self.tokens_cached, "open_sessions": len(self.sessions)}

    # -- streaming sessions: bookkeeping only, the prefix cache is vLLM's ------------------------

    def open(self, session: str, prompts: list[str | list[dict]], num_samples: int,
             columns: list[dict] | None = None) -> None:
        """Start a session for rows ``prompt index * num_samples + sample`` (the generator's row ids)."""
        if session in self.sessions:
            raise ValueError(f"reward session {session} is already open")
        self.sessions[session] = _Session(prompts=list(prompts), num_samples=num_samples)

    def extend(self, session: str, rows: list[int], responses: list[str],
               finished: list[bool] | None = None) -> list[float]:
        """Scores of (prompt of row, response so far) for each row: ``score`` on the same texts."""
        try:
            state = self.sessions[session]
        except KeyError:
            raise ValueError(f"unknown reward session {session}") from None
        if len(rows) != len(responses):
            raise ValueError(f"{len(rows)} rows but {len(responses)} responses")
        prompts = [state.prompt_of(r) for r in rows]
        before = self.tokens_read
        try:
            return self.score(prompts, responses)
        finally:
            state.tokens_read += self.tokens_read - before

    def close(self, session: str) -> dict:
        state = self.sessions.pop(session, None)
        return {"tokens_read": state.tokens_read if state else 0}

    def shutdown(self) -> None:
        """Stop vLLM's engine and worker processes now and free the KV cache they hold (see
        pipeline.engines.vllm_engine.VLLMEngine.shutdown). The scorer serves nothing afterwards."""
        self.llm.llm_engine.engine_core.shutdown()
