"""The draft model's side of speculative decoding and DSBD: beam sampling of a draft forest
(DSBD Fig. 2a) over an HF causal LM. Implements pipeline.decoding.domain.Drafter.

A call starts from the KV state of the previous call when every context extends a sequence the
draft already holds (the input beam, or a draft node, of the last forest) by the same number of
tokens (0-2: the output beams of a DSBD iteration are one new token past a verified node, two
after an extra layer); otherwise it prefills the contexts (left-padded, one batched forward).
Then it runs ``depth`` steps over the ``width`` draft beams, reordering the KV cache by parent. The
rows are a pipeline.engines.rows.RowBatch.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from pipeline.decoding.dsbd import beam_distribution
from pipeline.decoding.domain import DraftLayer
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import inverse_cdf
from pipeline.engines.hf import for_inference, load_pretrained
from pipeline.engines.rows import RowBatch, RowSnapshot


def _logq(out) -> torch.Tensor:
    return out.logits[:, -1].float().log_softmax(-1)  # [B, V]


class HFDrafter:
    def __init__(self, model, device: str | torch.device = "cpu", reuse_cache: bool = True):
        self.model = model.eval()
        self.device = torch.device(device)
        self.reuse_cache = reuse_cache
        self.forward_passes = 0
        self.drafted_tokens = 0
        # Row states of the last call, with each row's log-probs: the next call's contexts mostly
        # extend one of its rows.
        self._states: list[tuple[RowSnapshot, torch.Tensor]] = []
        self._known: dict[tuple[int, ...], tuple[int, int]] = {}

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", dtype: str = "float32",
                        prepack: bool = True, load: dict | None = None) -> HFDrafter:
        """Any HF causal LM sharing the generator's tokenizer; ``load``: models.hf's keywords."""
        model = load_pretrained(AutoModelForCausalLM, name_or_path, dtype, load)
        return cls(for_inference(model, device, dtype, prepack), device)

    def _remember(self, rows: RowBatch, logq: torch.Tensor, seqs: list[tuple[int, ...]]) -> None:
        """Record that batch row i of this state holds the tokens seqs[i] (and its logq)."""
        self._states.append((rows.snapshot(), logq))
        for i, seq in enumerate(seqs):
            self._known[seq] = (len(self._states) - 1, i)

    def _resume(self, contexts: list[list[int]]) -> tuple[RowBatch, torch.Tensor] | None:
        """Rebuild (rows, logq) for ``contexts`` from the last call's states when each context
        extends a remembered sequence by the same number (0-2) of tokens; else None."""
        for back in range(3):
            found = [self._known.get(tuple(c[:len(c) - back])) for c in contexts]
            if all(f is not None for f in found):
                break
        else:
            return None
        if len({self._states[s][0].attention_mask.shape[1] for s, _ in found}) != 1:  # remembered at different lengths
            return None
        rows = RowBatch.gather(self.model, [(self._states[s][0], r) for s, r in found], counted_by=(self,))
        logq = torch.cat([self._states[s][1][r:r + 1] for s, r in found])  # [B, V]
        if back:
            fed = torch.tensor([c[len(c) - back:] for c in contexts], device=self.device)  # [B, back]
            logq = _logq(rows.feed(fed, logits_to_keep=1))
        return rows, logq

    def _prefill(self, contexts: list[list[int]]) -> tuple[RowBatch, torch.Tensor]:
        rows, out = RowBatch.prefill(self.model, contexts, 0, self.device, counted_by=(self,), logits_to_keep=1)
        return rows, _logq(out)  # [W_L, V]

    @torch.inference_mode()
    def draft(self, contexts: list[list[int]], prefix_logp: list[float], width: int, depth: int,
              sampling: SamplingParams, seed: int) -> list[DraftLayer]:
        g = torch.Generator().manual_seed(seed)
        resumed = self._resume(contexts) if self.reuse_cache else None
        rows, logq = resumed or self._prefill(contexts)
        self._states, self._known = [], {}
        seqs = [tuple(c) for c in contexts]
        self._remember(rows, logq, seqs)
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
            rows.select(parents)  # each beam continues its parent's cache
            logq = _logq(rows.feed(tokens[:, None], logits_to_keep=1))
            seqs = [seqs[p] + (t,) for p, t in zip(parents.tolist(), tokens.tolist())]
            self._remember(rows, logq, seqs)
        return layers

    def stats(self) -> dict:
        return {"forward_passes": self.forward_passes, "drafted_tokens": self.drafted_tokens}
