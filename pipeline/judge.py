"""A rubric judge: a fixed, deterministic score of (prompt, response) computed with a frozen causal
LM (here, the generator itself), used to label preference pairs and to evaluate win rates. It is
not trained on anything; the reward model (pipeline.training.reward_model) learns from its labels.

For a prompt x and response y (the text, cut to ``max_response_tokens`` tokens):

    score = relevance + COMPLETENESS_WEIGHT * max(log p_end, COMPLETENESS_FLOOR)
            - REPETITION_WEIGHT * repetition - BREVITY_PENALTY * [words < MIN_WORDS]

- relevance: pointwise mutual information of the prompt and the response, read in the reverse
  direction, per prompt token: (log p(x | "Answer: y\\n\\nQuestion:") - log p(x | "Answer: \\n\\nQuestion:")) / |x|.
  A response that makes its question predictable is about it; generic or off-topic text earns
  about 0 (the "MMI-bidi" reranking of Li et al., 2016, "A Diversity-Promoting Objective Function
  for Neural Conversation Models", section 4.2: p(source | target) reranks candidates).
- completeness: p_end, the LM's probability of ending its turn (any EOS id) right after y, read in
  the chat-formatted conversation (user x, assistant y). A response cut at the token cap ends
  mid-sentence and gets p_end near 0 (log p_end about -20 on SmolLM2); a finished one about 1.
  The judge reads text only, so it judges any method's output the same way.
- repetition: the fraction of repeated word 3-grams, 1 - distinct / total (lowercased ``\\w+``
  words; 0 with fewer than three words).
- brevity: a fixed penalty for empty or near-empty answers (fewer than MIN_WORDS words).

Every term is a pure function of the two texts and the frozen LM: no sampling, and batches are
formed by length in a fixed order, so the same inputs always get the same score.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

import torch

COMPLETENESS_WEIGHT = 0.1
COMPLETENESS_FLOOR = -20.0
REPETITION_WEIGHT = 2.0
BREVITY_PENALTY = 1.0
MIN_WORDS = 3
RELEVANCE_FRAME = ("Answer: {response}\n\nQuestion:", " {prompt}")
"""The reverse-direction frame: (context, target); the baseline context has an empty response."""
DESCRIPTION = (
    f"score = relevance + {COMPLETENESS_WEIGHT} * max(log p_end, {COMPLETENESS_FLOOR}) - {REPETITION_WEIGHT} * "
    f"repetition - {BREVITY_PENALTY} * [words < {MIN_WORDS}]; relevance = per-token PMI of the prompt given the "
    "response, (log p(x | 'Answer: y\\n\\nQuestion:') - log p(x | 'Answer: \\n\\nQuestion:')) / |x|; p_end = "
    "probability of EOS right after the response in the chat-formatted conversation; repetition = 1 - distinct / "
    "total word 3-grams; all log-probabilities from the frozen generator (pipeline/judge.py)"
)


@dataclass(frozen=True)
class Rating:
    """One judged response: the rubric's terms and their total."""

    relevance: float
    """Per-token PMI of the prompt given the response (nats)."""
    log_p_end: float
    """log p(EOS | conversation up to the end of the response)."""
    repetition: float
    """Fraction of repeated word 3-grams, in [0, 1)."""
    words: int
    score: float


def repetition(text: str, n: int = 3) -> float:
    """1 - distinct / total word n-grams (0 when the text has fewer than n words)."""
    words = re.findall(r"\w+", text.lower())
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def rubric_score(relevance: float, log_p_end: float, repeated: float, words: int) -> float:
    """The rubric's total (module docstring)."""
    return (relevance + COMPLETENESS_WEIGHT * max(log_p_end, COMPLETENESS_FLOOR) - REPETITION_WEIGHT * repeated
            - BREVITY_PENALTY * (words < MIN_WORDS))


class RubricJudge:
    """Scorer implementation (pipeline.decoding.protocols.Scorer: ``score(prompts, responses)``)
    over a frozen causal LM and its tokenizer (it needs a chat template for the completeness term;
    without one the conversation is prompt then response)."""

    def __init__(self, model, tokenizer, batch_size: int = 16, max_response_tokens: int = 256):
        from pipeline.engines.hf import eos_token_ids

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_response_tokens = max_response_tokens
        self.end_ids = sorted(eos_token_ids(model, tokenizer))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_ids[0]
        self.device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", **kwargs) -> RubricJudge:
        from transformers import AutoModelForCausalLM

        from pipeline.engines.hf import load_tokenizer

        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32).to(device)
        return cls(model, load_tokenizer(name_or_path), **kwargs)

    def score(self, prompts: list[str | list[dict]], responses: list[str]) -> list[float]:
        return [r.score for r in self.rate(prompts, responses)[0]]

    @torch.inference_mode()
    def rate(self, prompts: list[str | list[dict]], responses: list[str]) -> tuple[list[Rating], torch.Tensor]:
        """Every response's Rating, and the LM's final hidden state at the last token of each
        conversation ([N, H]: what a sequence-classification head on the same backbone reads)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        responses = [self._cut(r) for r in responses]
        relevance = self._relevance(prompts, responses)
        log_p_end, states = self._conversation_pass(prompts, responses)
        ratings = []
        for rel, end, response in zip(relevance, log_p_end, responses):
            words = len(re.findall(r"\w+", response))
            rep = repetition(response)
            ratings.append(Rating(rel, end, rep, words, rubric_score(rel, end, rep, words)))
        return ratings, states

    def conversation(self, prompt: str | list[dict], response: str) -> str:
        """The chat-formatted text (the prompt's turns, then the response as the assistant's), as a
        reward model reads it (pipeline.engines.rewards.RewardScorer.format)."""
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": response}],
                                                      tokenize=False)
        return "\n\n".join(m["content"] for m in turns) + response

    def _cut(self, response: str) -> str:
        ids = self.tokenizer(response, add_special_tokens=False).input_ids
        return response if len(ids) <= self.max_response_tokens else self.tokenizer.decode(ids[:self.max_response_tokens])

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _relevance(self, prompts: list[str | list[dict]], responses: list[str]) -> list[float]:
        context, target = RELEVANCE_FRAME
        # A conversation's question is its last user turn.
        asked = [p if isinstance(p, str) else next((m["content"] for m in reversed(p) if m["role"] == "user"), "")
                 for p in prompts]
        targets = {p: self._ids(target.format(prompt=p)) for p in asked}
        empty = self._ids(context.format(response=""))
        baseline = dict(zip(targets, self._target_logp([(empty, targets[p]) for p in targets])))
        conditional = self._target_logp([(self._ids(context.format(response=r)), targets[p])
                                         for p, r in zip(asked, responses)])
        return [(c - baseline[p]) / max(len(targets[p]), 1) for p, c in zip(asked, conditional)]

    def _target_logp(self, rows: list[tuple[list[int], list[int]]]) -> list[float]:
        """Sum of log p(target tokens | context) for each (context ids, target ids)."""
        out = [0.0] * len(rows)
        for batch in self._batches([len(c) + len(t) for c, t in rows]):
            ids, mask = _right_padded([rows[i][0] + rows[i][1] for i in batch], self.pad_id, self.device)  # [B, L]
            hidden = self._base(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
            for b, i in enumerate(batch):
                context, target = rows[i]
                # The vocabulary projection only where a target token is predicted: [T, V], not [L, V].
                logp = self._head(hidden[b, len(context) - 1:len(context) + len(target) - 1]).float().log_softmax(-1)
                out[i] = float(logp[torch.arange(len(target)), torch.tensor(target)].sum())
        return out

    def _conversation_pass(self, prompts: list[str | list[dict]], responses: list[str]) -> tuple[list[float], torch.Tensor]:
        """log p(EOS) right after each response, and the final hidden state at the conversation's
        last token, from one forward pass over the conversation."""
        tail = self._template_tail()
        texts = [self.conversation(p, r) for p, r in zip(prompts, responses)]
        full = [self._ids(t) for t in texts]
        heads = [self._ids(t[:len(t) - len(tail)] if tail and t.endswith(tail) else t) for t in texts]
        log_p_end = [0.0] * len(texts)
        states = torch.zeros(len(texts), self.model.config.hidden_size)
        for batch in self._batches([len(f) for f in full]):
            ids, mask = _right_padded([full[i] for i in batch], self.pad_id, self.device)  # [B, L]
            hidden = self._base(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
            rows = torch.arange(len(batch), device=self.device)
            last = torch.tensor([len(full[i]) - 1 for i in batch], device=self.device)
            states[batch] = hidden[rows, last].float().cpu()
            # The response ends where the conversation's tokens stop agreeing with its text cut
            # right after the response (a BPE merge across that boundary moves the read back a token).
            ends = torch.tensor([max(len(os.path.commonprefix([heads[i], full[i]])), 1) - 1 for i in batch],
                                device=self.device)
            logp = self._head(hidden[rows, ends]).float().log_softmax(-1)  # [B, V]
            for i, v in zip(batch, logp[:, self.end_ids].logsumexp(-1).tolist()):
                log_p_end[i] = max(v, -1e4) if math.isfinite(v) else -1e4
        return log_p_end, states

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices in batches of similar length (less padding), in a fixed order for fixed inputs."""
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        return [order[k:k + self.batch_size] for k in range(0, len(order), self.batch_size)]

    def _template_tail(self) -> str:
        """What the chat template writes after the assistant's content (the same for every response)."""
        sentinel = "\u2063response\u2063"
        text = self.conversation("question", sentinel)
        return text[text.index(sentinel) + len(sentinel):] if sentinel in text else ""

    @property
    def _base(self):
        return getattr(self.model, self.model.base_model_prefix)

    @property
    def _head(self):
        return self.model.get_output_embeddings()


def _right_padded(seqs: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)

