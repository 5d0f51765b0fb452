"""The draft model's side of speculative decoding and DSBD: beam sampling of a draft forest
(DSBD Fig. 2a) over an HF causal LM. Implements pipeline.decoding.protocols.Drafter.

A call starts from the KV state of the previous call when every context extends a sequence the
draft already holds (the input beam, or a draft node, of the last forest) by the same number of
tokens (0-2: the output beams of a DSBD iteration are one new token past a verified node, two
after an extra layer); otherwise it prefills the contexts (left-padded, one batched forward).
Then it runs ``depth`` steps over the ``width`` draft beams, reordering the KV cache by parent.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from pipeline.decoding.dsbd import beam_distribution
from pipeline.decoding.protocols import DraftLayer
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import inverse_cdf
from pipeline.engines.hf import DTYPES, left_pad


class HFDrafter:
    def __init__(self, model, device: str | torch.device = "cpu", reuse_cache: bool = True):
        self.model = model.eval()
        self.device = torch.device(device)
        self.reuse_cache = reuse_cache
        self.forward_passes = 0
        self.drafted_tokens = 0
        # KV states of the last call: the next call's contexts mostly extend one of its rows.
        self._states: list = []
        self._known: dict[tuple[int, ...], tuple[int, int]] = {}

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32") -> HFDrafter:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=DTYPES[dtype]).to(device)
        return cls(model, device)

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        self.forward_passes += 1
        return out.logits[:, -1].float().log_softmax(-1)  # [B, V]

    def _remember(self, cache, mask, positions, logq, rows: list[tuple[int, ...]]) -> None:
        """Record that batch row i of this cache state holds the tokens rows[i] (and its logq)."""
        state = ([(layer.keys, layer.values) for layer in cache.layers], mask, positions, logq)
        self._states.append(state)
        for i, seq in enumerate(rows):
            self._known[seq] = (len(self._states) - 1, i)

    def _resume(self, contexts: list[list[int]]):
        """Rebuild (cache, mask, positions, logq) for ``contexts`` from the last call's states when
        each context extends a remembered sequence by the same number (0-2) of tokens; else None."""
        for back in range(3):
            found = [self._known.get(tuple(c[:len(c) - back])) for c in contexts]
            if all(f is not None for f in found):
                break
        else:
            return None
        states = {self._states[s][0][0][0].shape[-2] for s, _ in found}
        if len(states) != 1:  # remembered at different lengths
            return None
        def rows(tensor_of):  # noqa: E306
            return torch.cat([tensor_of(self._states[s])[r:r + 1] for s, r in found])
        cache = DynamicCache(config=self.model.config)
        for i in range(len(self._states[found[0][0]][0])):
            cache.update(rows(lambda st: st[0][i][0]), rows(lambda st: st[0][i][1]), i)
        mask, positions, logq = rows(lambda st: st[1]), rows(lambda st: st[2]), rows(lambda st: st[3])
        if back:
            fed = torch.tensor([c[len(c) - back:] for c in contexts], device=self.device)  # [B, back]
            mask = torch.cat([mask, torch.ones_like(fed)], dim=1)
            logq = self._forward(fed, mask, positions[:, None] + torch.arange(back, device=self.device), cache)
            positions = positions + back
        return cache, mask, positions, logq

    def _prefill(self, contexts: list[list[int]]):
        ids, mask, position_ids = left_pad(contexts, 0, self.device)
        cache = DynamicCache(config=self.model.config)
        logq = self._forward(ids, mask, position_ids, cache)  # [W_L, V]
        return cache, mask, mask.sum(-1), logq

    @torch.inference_mode()
    def draft(self, contexts: list[list[int]], prefix_logp: list[float], width: int, depth: int,
              sampling: SamplingParams, seed: int) -> list[DraftLayer]:
        g = torch.Generator().manual_seed(seed)
        resumed = self._resume(contexts) if self.reuse_cache else None
        cache, mask, positions, logq = resumed or self._prefill(contexts)  # positions: [B] of the next token
        self._states, self._known = [], {}
        rows = [tuple(c) for c in contexts]
        self._remember(cache, mask, positions, logq, rows)
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
            rows = [rows[p] + (t,) for p, t in zip(parents.tolist(), tokens.tolist())]
            self._remember(cache, mask, positions, logq, rows)
        return layers

    def stats(self) -> dict:
        return {"forward_passes": self.forward_passes, "drafted_tokens": self.drafted_tokens}
