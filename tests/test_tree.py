"""Tree-attention verification (pipeline.engines.tree): one forward pass over a forest per row
gives every branch's logits, and cutting the cache to the accepted paths leaves a cache that
decodes exactly like a fresh run on the accepted prefix."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
from transformers import DynamicCache

from pipeline.decoding.tree import TokenTree
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.reward_transformer import RewardTransformer
from pipeline.engines.tree import cache_argument, commit_paths, tree_inputs, verify_tree

ATOL = 1e-4

PROMPTS = [[1, 40, 41, 42, 43, 44, 45], [1, 50, 51]]  # different lengths: row 1 is left-padded


def prefill(model, prompts):
    """Left-padded prefill as HFEngine.open does it: (cache, attention_mask [B, L], next_position [B])."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0),
              use_cache=True, **cache_argument(model, cache))
    return cache, mask, mask.sum(-1)


def fresh_logits(model, tokens):
    """Next-token logits after ``tokens``, from an unpadded run with no cache: [V]."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


# Row 0: one tree, a root with two children and a grandchild. Row 1: a forest of two trees of
# different depths (fewer nodes than row 0, so it is padded in the node dimension too).
TREES = [
    TokenTree(tokens=[60, 61, 62, 63, 64], parents=[-1, 0, 0, 1, 3]),
    TokenTree(tokens=[70, 71, 72], parents=[-1, -1, 1]),
]


def test_tree_logits_equal_each_branch_run_separately(engine):
    model = engine.model
    cache, mask, next_position = prefill(model, PROMPTS)
    out = verify_tree(model, cache, mask, next_position, TREES)
    assert out.logits.shape[:2] == (2, 5)
    assert cache.get_seq_length() == mask.shape[1] + 5
    for b, tree in enumerate(TREES):
        for node in range(len(tree.tokens)):
            branch = [tree.tokens[i] for i in tree.path_to(node)]
            expected = fresh_logits(model, PROMPTS[b] + branch)
            torch.testing.assert_close(out.logits[b, node], expected, atol=ATOL, rtol=0)


def test_sibling_branches_do_not_see_each_other(engine):
    """Same node tokens, different parent structure: a node's logits change only with its ancestors."""
    model = engine.model
    cache, mask, next_position = prefill(model, PROMPTS[:1])
    chain = verify_tree(model, cache, mask, next_position, [TokenTree.chain([60, 61, 62])]).logits
    cache, mask, next_position = prefill(model, PROMPTS[:1])
    siblings = verify_tree(model, cache, mask, next_position, [TokenTree([60, 61, 62], [-1, 0, 0])]).logits
    torch.testing.assert_close(chain[0, :2], siblings[0, :2], atol=ATOL, rtol=0)
    assert not torch.allclose(chain[0, 2], siblings[0, 2], atol=1e-3)  # 62 after 61 vs 62 after 60


def test_tree_inputs_mask_and_positions():
    mask = torch.tensor([[0, 1, 1]])
    inputs = tree_inputs([TokenTree([5, 6, 7], [-1, 0, -1])], mask, torch.tensor([2]))
    assert inputs.position_ids.tolist() == [[2, 3, 2]]
    visible = (inputs.attention_mask[0, 0] == 0).int().tolist()
    assert visible == [[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 1]]


def test_commit_paths_then_decoding_matches_fresh_run(engine):
    model = engine.model
    cache, mask, next_position = prefill(model, PROMPTS)
    out = verify_tree(model, cache, mask, next_position, TREES)
    # Output rows: row 0 along 0-1-3, row 1 along its second tree (1-2), row 0 again along 0-2
    # (one input row feeding two outputs, as beams do), and row 1 with nothing accepted.
    sources = [(0, [0, 1, 3]), (1, [1, 2]), (0, [0, 2]), (1, [])]
    new_mask, new_next = commit_paths(cache, out, sources)
    assert new_mask.shape == (4, mask.shape[1] + 3)
    assert cache.get_seq_length() == new_mask.shape[1]
    assert new_next.tolist() == [7 + 3, 3 + 2, 7 + 2, 3]
    prefixes = [PROMPTS[r] + [TREES[r].tokens[i] for i in path] for r, path in sources]
    # Decode two more steps with the ordinary 2D mask + explicit positions (what HFEngine does).
    steps = [[80, 81, 82, 83], [90, 91, 92, 93]]
    for step in steps:
        new_mask = torch.cat([new_mask, torch.ones((4, 1), dtype=new_mask.dtype)], dim=1)
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor(step)[:, None], attention_mask=new_mask,
                           position_ids=new_next[:, None], use_cache=True, **cache_argument(model, cache)).logits[:, -1]
        new_next = new_next + 1
        for j in range(4):
            prefixes[j] = prefixes[j] + [step[j]]
            torch.testing.assert_close(logits[j], fresh_logits(model, prefixes[j]), atol=ATOL, rtol=0)


def test_commit_then_second_tree_matches_fresh_run(engine):
    """Cut, then verify another tree on the gapped cache: speculative decoding's loop."""
    model = engine.model
    cache, mask, next_position = prefill(model, PROMPTS)
    out = verify_tree(model, cache, mask, next_position, TREES)
    mask, next_position = commit_paths(cache, out, [(0, [0, 2]), (1, [0])])
    second = [TokenTree([100, 101, 102], [-1, 0, 0]), TokenTree.chain([110, 111])]
    out = verify_tree(model, cache, mask, next_position, second)
    prefixes = [PROMPTS[0] + [60, 62], PROMPTS[1] + [70]]
    for b, tree in enumerate(second):
        for node in range(len(tree.tokens)):
            branch = [tree.tokens[i] for i in tree.path_to(node)]
            torch.testing.assert_close(out.logits[b, node], fresh_logits(model, prefixes[b] + branch),
                                       atol=ATOL, rtol=0)


def test_bad_trees_and_paths_are_rejected(engine):
    with pytest.raises(ValueError, match="parent"):
        TokenTree([1, 2], [-1, 1])
    cache, mask, next_position = prefill(engine.model, PROMPTS)
    out = verify_tree(engine.model, cache, mask, next_position, TREES)
    with pytest.raises(ValueError, match="not a root-to-node path"):
        commit_paths(cache, out, [(0, [0, 3])])  # skips node 1
    with pytest.raises(ValueError, match="not in the batch"):
        commit_paths(cache, out, [(2, [])])


def test_cache_argument_names_the_keyword_each_model_takes(engine, scorer):
    """transformers 5.24 renamed forward's past_key_values to cache (the old name warns, and goes in
    5.40); older releases and remote-code models take only past_key_values. The engine must hand each
    model its cache under the name it takes, through wrappers, and decode without the warning."""

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None): ...

    class Wrapper(torch.nn.Module):  # forwards **kwargs to its policy, as RewardTransformer does
        def __init__(self, policy):
            super().__init__()
            self.policy = policy

        def forward(self, *args, **kwargs): ...

    assert cache_argument(Old(), "c") == {"past_key_values": "c"}
    assert cache_argument(Wrapper(Old()), "c") == {"past_key_values": "c"}
    assert cache_argument(Wrapper(torch.nn.Identity()), "c") == {"past_key_values": "c"}  # neither: the old name
    names = inspect.signature(type(engine.model).forward).parameters
    installed = "cache" if "cache" in names else "past_key_values"
    assert cache_argument(engine.model, "c") == {installed: "c"}
    assert cache_argument(RewardTransformer.wrap(engine.model), "c") == {installed: "c"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a deprecated keyword fails here
        engine.open("kw", [[1, 40, 41], [1, 50]], 2, list(range(4)),
                    SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True))
        try:
            rows = engine.extend("kw", until=4)
        finally:
            engine.close("kw")
        assert all(len(r.token_ids) == 4 for r in rows)
        cache, mask, next_position = prefill(engine.model, PROMPTS)
        verify_tree(engine.model, cache, mask, next_position, TREES)
        scorer.open("kw", ["Say a word.", "Count to two."], 2)
        try:
            scores = scorer.extend("kw", [0, 1, 2, 3], ["Hello", "One", "One, two", "Hi"])
        finally:
            scorer.close("kw")
        assert len(scores) == 4
