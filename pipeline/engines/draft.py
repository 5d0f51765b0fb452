"""The draft model's side of speculative decoding and DSBD: beam sampling of a draft forest
(DSBD Fig. 2a) over an HF causal LM. Implements pipeline.decoding.protocols.Drafter.

Each call prefills its contexts afresh (left-padded, one batched forward), then runs ``depth``
single-token steps over the ``width`` draft beams, reordering the KV cache by parent between
steps. Re-reading the context costs one batched draft forward per iteration, which is what a
memory-bound small model spends on a single token anyway; a draft-side prefix cache would save
that on long contexts and is not built.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pipeline.decoding.dsbd import beam_distribution
from pipeline.decoding.protocols import DraftLayer
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import inverse_cdf
from pipeline.engines.hf import DTYPES


class HFDrafter:
    def __init__(self, model, device: str | torch.device = "cpu"):
        self.model = model.eval()
        self.device = torch.device(device)
        self.forward_passes = 0
        self.drafted_tokens = 0

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32") -> HFDrafter:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype]).to(device)
        return cls(model, device)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.forward_passes += 1
        return out.logits[:, -1].float().log_softmax(-1)  # [B, V]

    @torch.inference_mode()
    def draft(self, contexts: list[list[int]], prefix_logp: list[float], width: int, depth: int,
              sampling: SamplingParams, seed: int) -> list[DraftLayer]:
        g = torch.Generator().manual_seed(seed)
        longest = max(len(c) for c in contexts)
        ids = torch.zeros((len(contexts), longest), dtype=torch.long)
        mask = torch.zeros((len(contexts), longest), dtype=torch.long)
        for i, c in enumerate(contexts):
            ids[i, longest - len(c):] = torch.tensor(c)
            mask[i, longest - len(c):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        cache = DynamicCache(config=self.model.config)
        logq = self._forward(ids, mask, (mask.cumsum(-1) - 1).clamp(min=0), cache)  # [W_L, V]
        positions = mask.sum(-1)  # [W_L] position of the next token
        scores = torch.tensor(prefix_logp, dtype=torch.float32, device=logq.device)  # [W_L]
        vocab = logq.shape[-1]
        layers = []
        for step in range(depth):
            q_beam = beam_distribution(scores, logq, sampling)  # [W_prev * V]
            flat = inverse_cdf(q_beam[None].expand(width, -1), torch.rand(width, generator=g).to(q_beam.device))  # [W_S]
            parents, tokens = flat // vocab, flat % vocab
            layers.append(DraftLayer(parents.tolist(), tokens.tolist(), q_beam.cpu()))
            self.drafted_tokens += width
            if step + 1 == depth:
                break
            scores = scores[parents] + logq[parents, tokens]
            cache.batch_select_indices(parents)
            mask = torch.cat([mask[parents], torch.ones((width, 1), dtype=mask.dtype, device=self.device)], dim=1)
            positions = positions[parents]
            logq = self._forward(tokens[:, None], mask, positions[:, None], cache)
            positions = positions + 1
        return layers

    def stats(self) -> dict:
        return {"forward_passes": self.forward_passes, "drafted_tokens": self.drafted_tokens}
