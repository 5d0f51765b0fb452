"""The adapters that present a Hugging Face generator engine to the decoding algorithms, each
through the small Protocol its algorithm declares, and the per-engine state those algorithms
keep (tri-gram matrices, ULTS's Dirichlet beliefs). ULTS keeps here only what is a function of
its configuration; its empirical prior depends on the prompt, so ULTS makes it per prompt and does
not keep it.

    host = HFSearchHost(engine)      # engine.search_host: one per HFEngine
    host.tree_target()               # ADED's TreeVerifier            (TreeTarget)
    host.forest_target()             # DSBD's ForestTarget             (TreeSession)
    host.node_expander()             # ULTS's NodeExpander             (PathCacheExpander)
    host.self_rewarding_lm()         # SLA's SelfRewardingLM           (SelfRewardDecoder)
    host.remember(key, make)         # per-engine state, made once

A model-side strategy's search function receives the host, never the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from pipeline.decoding.tree import TokenTree
from pipeline.engines.reward_transformer import CHANNEL_WEIGHTS, RewardTransformer
from pipeline.engines.rows import RowBatch
from pipeline.engines.trigram import load_trigram


class HFSearchHost:
    """One HFEngine as every model-side method's host (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.eos_ids: set[int] = engine.eos_ids
        self.device = engine.device
        self.vocab_size = int(engine.model.config.vocab_size)
        self._state: dict[tuple, Any] = {}

    @property
    def drafter(self):
        """The engine's configured draft model (a Drafter), or None (DSBD then drafts with ADED)."""
        return self.engine.drafter

    def remember(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key not in self._state:
            self._state[key] = make()
        return self._state[key]

    def load_trigram(self, path: str, top_t: int = 12):
        return load_trigram(path, top_t)

    def decode(self, token_lists: list[list[int]]) -> list[str]:
        return self.engine.tokenizer.batch_decode(token_lists, skip_special_tokens=True)

    def tree_target(self) -> TreeTarget:
        return TreeTarget(self.engine.model, self.device, self.engine.pad_id)

    def forest_target(self) -> TreeSession:
        return TreeSession(self.engine.model, self.device)

    def node_expander(self) -> PathCacheExpander:
        return PathCacheExpander(self.engine.model, self.device)

    def self_rewarding_lm(self) -> SelfRewardDecoder:
        """ValueError when the model has no trained reward channel."""
        return SelfRewardDecoder(self.engine)


class TreeTarget:
    """A batch of decoding rows verified tree by tree: the target side of ADED (and any drafter that
    returns a TokenTree per row). A thin layer over RowBatch (its verify and commit).

        target = TreeTarget(model, device)
        logits = target.open(prompts, num_samples)   # [R, V]: prefill once per prompt, fan out to rows
        logits = target.verify(trees)                # [R, N, V]: one forward pass over every row's tree
        target.commit(sources)                       # keep (row, path) per surviving row

    Rows are indexed by their position in the current batch; commit may drop rows (finished ones).
    """

    def __init__(self, model, device: str | torch.device = "cpu", pad_id: int = 0):
        self.model = model
        self.device = torch.device(device)
        self.pad_id = pad_id
        self.rows: RowBatch | None = None
        self.forward_passes = 0

    def open(self, prompts: list[list[int]], num_samples: int) -> torch.Tensor:
        """Prefill the left-padded prompts once, then repeat each for its num_samples rows. [R, V]."""
        self.rows, out = RowBatch.prefill(self.model, prompts, self.pad_id, self.device, counted_by=(self,),
                                          logits_to_keep=1)
        self.rows.fan_out(num_samples)
        return out.logits[:, -1].repeat_interleave(num_samples, 0)  # [R, V]

    def verify(self, trees: list[TokenTree]) -> torch.Tensor:
        """Next-token logits after every node of every row's tree, one forward pass: [R, N, V]."""
        return self.rows.verify(trees)

    def commit(self, sources: list[tuple[int, list[int]]]) -> None:
        """Cut the cache to the accepted path of each surviving row (rows not listed are dropped)."""
        self.rows.commit(sources)

    def select(self, keep: list[int]) -> None:
        """Keep batch positions ``keep`` (between verifications, e.g. rows that ended at the first token)."""
        self.rows.select(keep)


class TreeSession:
    """One growing batch of rows over a causal LM for tree-verifying decoders (DSBD, speculative
    decoding, beam sampling): each row's cache holds its sequence except the last token, which the
    caller passes as the root of the row's next tree (pipeline.decoding.dsbd.ForestTarget)."""

    def __init__(self, model, device: str | torch.device = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.rows: RowBatch | None = None
        self.forward_passes = 0

    def open(self, prompt: list[int]) -> None:
        self.rows = RowBatch.empty(self.model, 1, self.device, counted_by=(self,))
        if len(prompt) > 1:
            self.rows.feed(torch.tensor([prompt[:-1]], dtype=torch.long, device=self.device), logits_to_keep=1)

    def verify(self, trees: list[TokenTree]) -> torch.Tensor:
        """Log-probs [B, N, V] (float32) after every node of every row's tree, from one forward pass."""
        return self.rows.verify(trees).float().log_softmax(-1)

    def commit(self, sources: list[tuple[int, list[int]]]) -> None:
        self.rows.commit(sources)


@dataclass
class TreeBatch:
    """Rows of a search tree batch (pipeline.decoding.sla.TreeRows): their KV rows, and what the
    last fed token gave, kept aligned with them."""

    rows: RowBatch
    logits: torch.Tensor  # [B, V] next-token logits
    rewards: torch.Tensor  # [B] R' of each row's sequence so far


def _logits_and_rewards(out) -> tuple[torch.Tensor, torch.Tensor]:
    """A Reward Transformer's output at each row's last token: logits [B, V], reward R' [B]."""
    return out.logits[:, -1, :].float(), out.rewards[:, -1].float()


class SelfRewardDecoder:
    """The SelfRewardingLM protocol of pipeline.decoding.sla over an HFEngine whose model is a
    trained RewardTransformer: one forward pass gives each row's next-token logits and its reward."""

    def __init__(self, engine):
        model = engine.model
        if not isinstance(model, RewardTransformer) or not model.channel_config.trained:
            raise ValueError("strategy 'sla' needs a generator with a trained reward channel "
                             f"({CHANNEL_WEIGHTS}); train one with python -m jobs.train_reward_transformer")
        self.engine = engine
        self.runner = engine.runner  # the engine's counters count this decoder's work too
        self.model = model
        self.eos_ids = engine.eos_ids
        self.device = engine.device
        self.forward_passes = 0

    def prefill(self, prompts: list[list[int]]) -> TreeBatch:
        rows, out = RowBatch.prefill(self.model, prompts, self.engine.pad_id, self.device,
                                     counted_by=(self, self.runner), logits_to_keep=1, with_rewards=True)
        return TreeBatch(rows, *_logits_and_rewards(out))

    def feed(self, batch: TreeBatch, tokens: torch.Tensor) -> None:
        out = batch.rows.feed(tokens.to(self.device)[:, None], logits_to_keep=1, with_rewards=True)
        batch.logits, batch.rewards = _logits_and_rewards(out)
        self.runner.generated_tokens += len(tokens)

    def select(self, batch: TreeBatch, index: list[int]) -> None:
        """Keep, drop, reorder or repeat rows (repeats fan a node out into its children)."""
        index = batch.rows.select(index)
        batch.logits, batch.rewards = batch.logits[index], batch.rewards[index]

    def decode(self, token_lists: list[list[int]]) -> list[str]:
        return self.engine.tokenizer.batch_decode(token_lists, skip_special_tokens=True)


class PathCacheExpander:
    """KV reuse along the paths of a search tree (used by ULTS and its beam-search baseline).

    Every expanded node keeps the key/value entries of its own token, one per layer; the prompt (the
    root) keeps the prompt's. To expand a batch of nodes at different depths of different trees, each
    row's cache is the prompt's entries followed by those of the nodes on its path, left-padded to a
    common length, and the forward pass feeds one token per row: the node's own. So an expansion costs
    one token of compute however deep the node is, instead of re-running the prefix (the ULTS authors'
    code does), and many nodes share one forward pass.

        expander = PathCacheExpander(model, device)
        logprobs = expander.roots(prompts)                      # [P, V] after each prompt
        logprobs = expander.expand([(tree, node, parent, tok)])  # [B, V] after each node's path

    Entries are stored unpadded and per node, so memory is one token's KV per expanded node.
    Implements pipeline.decoding.ults.NodeExpander.
    """

    def __init__(self, model, device: str | torch.device = "cpu"):
        self.model = model
        self.device = torch.device(device)
        self.entries: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = {}
        """(tree, node) -> per layer (keys [kv_heads, n, head_dim], values): n = prompt length at the root, else 1."""
        self.parent: dict[tuple[int, int], int] = {}
        self.forward_passes = 0

    @torch.inference_mode()
    def roots(self, prompts: list[list[int]]) -> torch.Tensor:
        """Prefill each prompt alone (no padding in the stored entries); [P, V] log-probabilities."""
        logprobs = []
        for tree, prompt in enumerate(prompts):
            rows, out = RowBatch.prefill(self.model, [prompt], 0, self.device, counted_by=(self,), logits_to_keep=1)
            self.entries[(tree, 0)] = rows.entries(0)
            self.parent[(tree, 0)] = -1
            logprobs.append(out.logits[0, -1].float().log_softmax(-1))
        return torch.stack(logprobs)

    def _path(self, tree: int, node: int) -> list[int]:
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parent[(tree, node)]
        return nodes[::-1]  # root first

    @torch.inference_mode()
    def expand(self, items: list[tuple[int, int, int, int]]) -> torch.Tensor:
        """items: (tree, node, parent, token); the parent must be expanded already."""
        paths = []
        for tree, node, parent, _ in items:
            self.parent[(tree, node)] = parent
            paths.append(self._path(tree, parent))
        per_row = [[self.entries[(tree, n)] for n in path] for (tree, *_), path in zip(items, paths)]
        rows = RowBatch.from_entries(self.model, per_row, self.device, counted_by=(self,))
        out = rows.feed(torch.tensor([[tok] for *_, tok in items], device=self.device))  # tokens [B, 1]
        for i, (tree, node, _, _) in enumerate(items):
            self.entries[(tree, node)] = rows.entries(i, last=1)
        return out.logits[:, -1].float().log_softmax(-1)  # [B, V]

    def release(self, tree: int) -> None:
        for key in [k for k in self.entries if k[0] == tree]:
            del self.entries[key]
        for key in [k for k in self.parent if k[0] == tree]:
            del self.parent[key]
