"""Batched reward scoring of prompt plus (partial) response with an HF sequence classifier.

The text is built with the reward tokenizer's chat template when it has one (user turn, then
assistant turn), else as prompt followed by response. Sequences longer than the model's context
are cut from the left, so the response, which the score is about, is always seen. A non-finite
score is returned as NaN: the caller marks that candidate as failed; it is never turned into 0.
"""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForSequenceClassification

from pipeline.engines.hf import DTYPES, load_tokenizer


class RewardScorer:
    """Scorer implementation (see pipeline.decoding.protocols.Scorer)."""

    def __init__(self, model, tokenizer, device: str | torch.device = "cpu", batch_size: int = 32):
        if getattr(model.config, "num_labels", 1) != 1:
            raise ValueError(f"reward model must have one output label, has {model.config.num_labels}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.tokenizer.truncation_side = "left"
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_length = min(int(getattr(model.config, "max_position_embeddings", 0) or 10**9),
                              int(tokenizer.model_max_length or 10**9))
        self.forward_passes = 0
        self.scored = 0

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32",
                        batch_size: int = 32) -> RewardScorer:
        tokenizer = load_tokenizer(name_or_path)
        model = AutoModelForSequenceClassification.from_pretrained(name_or_path, dtype=DTYPES[dtype]).to(device)
        return cls(model, tokenizer, device, batch_size)

    def format(self, prompt: str, response: str) -> str:
        if self.tokenizer.chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}]
            return self.tokenizer.apply_chat_template(messages, tokenize=False)
        return prompt + response

    @torch.inference_mode()
    def score(self, prompts: list[str], responses: list[str]) -> list[float]:
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        texts = [self.format(p, r) for p, r in zip(prompts, responses)]
        # The chat template already holds BOS when the model wants it.
        add_special = not bool(self.tokenizer.chat_template)
        scores: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            batch = self.tokenizer(texts[start:start + self.batch_size], return_tensors="pt", padding=True,
                                   truncation=True, max_length=self.max_length, add_special_tokens=add_special)
            logits = self.model(**batch.to(self.device)).logits  # [B, 1]
            self.forward_passes += 1
            scores.extend(float(v) if math.isfinite(v) else math.nan for v in logits[:, 0].float().tolist())
        self.scored += len(texts)
        return scores

    def stats(self) -> dict:
        return {"forward_passes": self.forward_passes, "scored": self.scored}
