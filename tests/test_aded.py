"""ADED: tri-gram matrix (Eq. 1, Algorithm 2), MCTS drafts (Eq. 2-3), tree verification with greedy
and sampling acceptance (exact output distribution), the build strategy."""

import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from scipy import stats
from transformers import LlamaConfig, LlamaForCausalLM

from jobs.build_dataset import main
from hypothesis import given, settings
from hypothesis import strategies as st_

from pipeline.decoding.aded import (ADEDDrafter, RetrievalDrafter, accept, aded_decode, exploration, mcts_drafts,
                                    merge_drafts)
from pipeline.decoding.sampling import RowStreams, SamplingParams, filter_logits
from pipeline.decoding.tree import TokenTree
from pipeline.decoding.trigram import TrigramMatrix
from pipeline.engines.adapters import TreeTarget
from pipeline.engines.trigram import load_trigram, save_trigram
from tests.conftest import GOOD_PROMPTS, write_jsonl


def test_trigram_matrix_eq1_top_t_and_round_trip(tmp_path):
    seqs = [[1, 2, 3, 1, 2, 4, 1, 2, 3], [1, 2, 5]]
    m = TrigramMatrix.from_sequences(seqs, top_t=2)
    # (1, 2) is followed by 3 twice, 4 once, 5 once: C(1,2,3) / C(1,2) = 2 / 4, top 2 kept
    assert m.continuations(1, 2) == [(3, 0.5), (4, 0.25)]
    assert m.continuations(2, 3) == [(1, 1.0)]
    save_trigram(m, str(tmp_path / "m.npz"))
    loaded = load_trigram(str(tmp_path / "m.npz"))
    assert loaded.table == m.table and loaded.top_t == 2
    with pytest.raises(ValueError, match="not a saved tri-gram matrix"):
        load_trigram(str(tmp_path / "missing.npz"))


def test_trigram_adaptive_update_increment_cap_insert():
    m = TrigramMatrix.from_sequences([[1, 2, 3, 1, 2, 4]], top_t=2)  # (1,2): 3 -> .5, 4 -> .5
    m.update([9, 9, 1, 2, 3], max_length=3, increment=0.3, max_prob=0.7)  # only the last 3 tokens: (1, 2, 3)
    assert m.probability(1, 2, 3) == pytest.approx(0.7)  # 0.5 + 0.3 capped at 0.7
    assert m.probability(9, 9, 1) == 0.0  # outside the window
    m.update([1, 2, 6], max_length=3, increment=0.3, max_prob=0.7)  # insert; the context is full (t=2)
    assert m.probability(1, 2, 6) == pytest.approx(0.3)
    assert set(m.table[(1, 2)]) == {3, 6}  # the least likely old continuation made room


def test_puct_exploration_term_eq3():
    assert exploration(0, 32, 8) == pytest.approx(32 + math.log(9 / 8))
    assert exploration(100, 32, 8) == pytest.approx(32 + math.log(109 / 8))


def test_mcts_drafts_follow_the_matrix_and_merge_into_a_trie():
    # a deterministic chain 1 2 -> 3 -> 4 -> 5 -> 6 plus a weak branch 1 2 -> 7
    m = TrigramMatrix.from_sequences([[1, 2, 3, 4, 5, 6]] * 9 + [[1, 2, 7, 8]])
    drafts = mcts_drafts(m, [0, 1, 2], iterations=50, depth=4, candidates=5)
    assert drafts[0] == [3, 4, 5, 6]
    assert [7, 8] in drafts
    tree = merge_drafts([[3, 4, 5], [3, 4, 9], [7]])
    assert tree.tokens == [3, 4, 5, 9, 7] and tree.parents == [-1, 0, 1, 1, -1]
    assert mcts_drafts(m, [0, 42, 43]) == []  # unseen context: no draft


def test_retrieval_drafter_uses_longest_suffix():
    d = RetrievalDrafter([[1, 2, 3, 4], [9, 2, 5, 6]], depth=2, max_suffix=2)
    assert d.propose([1, 2]).tokens == [3, 4]
    assert sorted(d.propose([7, 2]).tokens) == [3, 4, 5, 6]


def _tiny_vocab_model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=6, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # a peaked, far from uniform next-token distribution
    return model


class _FixedDrafter:
    """Always proposes the same tree: likely and unlikely branches, so both paths of acceptance run."""

    def propose(self, context):
        return merge_drafts([[0, 1, 2], [0, 3], [4, 4], [5]])

    def observe(self, context, new_tokens):
        pass


@pytest.mark.slow
@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=3, ignore_eos=True),
                                      SamplingParams(max_new_tokens=3, ignore_eos=True, temperature=0.7, top_k=4)])
def test_sampling_acceptance_leaves_the_output_distribution_unchanged(sampling):
    """Chi-square of 5000 sampled 3-token continuations against the exact target distribution
    (temperature / top-k warped), computed from the tiny-vocabulary model itself."""
    model = _tiny_vocab_model()
    prompt = [1, 2, 3]
    rows = 5000
    out, st = aded_decode(TreeTarget(model), _FixedDrafter(), [prompt], rows, list(range(rows)), sampling, set())
    assert st.emitted / len(st.accepted_per_step) > 1.2  # drafts were accepted, not only bonus tokens
    with torch.no_grad():
        def warped(contexts):
            return filter_logits(model(torch.tensor(contexts)).logits[:, -1], sampling).softmax(-1).double()

        p1 = warped([prompt])[0]  # [V]
        p2 = warped([prompt + [a] for a in range(6)])  # [V, V]
        p3 = warped([prompt + [a, b] for a in range(6) for b in range(6)])  # [V * V, V]
    exact = (p1[:, None, None] * p2[:, :, None] * p3.view(6, 6, 6)).flatten().numpy()
    counts = np.bincount([a * 36 + b * 6 + c for a, b, c in out], minlength=216)
    assert counts[exact == 0].sum() == 0  # nothing outside the (top-k) support
    keep = exact * rows >= 5  # pool the rare (non-zero) outcomes into one cell
    rare = ~keep & (exact > 0)
    observed, expected = counts[keep], exact[keep]
    if rare.any():
        observed, expected = np.append(observed, counts[rare].sum()), np.append(expected, exact[rare].sum())
    expected = expected / expected.sum() * rows
    assert stats.chisquare(observed, expected).pvalue > 1e-3


@settings(max_examples=40, deadline=None)
@given(parents=st_.lists(st_.integers(0, 30), min_size=0, max_size=12), seed=st_.integers(0, 2**63 - 1),
       temperature=st_.sampled_from([0.0, 0.5, 1.0]), top_k=st_.sampled_from([0, 2]))
def test_acceptance_with_uniforms_drawn_ahead_walks_as_the_row_stream_does(parents, seed, temperature, top_k):
    """The verifiers draw a step's uniforms for every row at once (RowStreams.ahead): the accepted
    path and token equal a walk that draws from the row's stream node by node, which moves its
    counter by the path's length (0 when greedy)."""
    generator = torch.Generator().manual_seed(seed % 2**31)
    parents = [-1] + [p % (i + 1) for i, p in enumerate(parents)]  # a tree: each node's parent before it
    tokens = torch.randint(0, 3, (len(parents),), generator=generator).tolist()  # 3 tokens: drafts get accepted
    logits = torch.randn(len(parents), 3, generator=generator) * 2
    tree, sampling = TokenTree(tokens, parents), SamplingParams(temperature=temperature, top_k=top_k)
    stream = RowStreams.seeded([seed])
    walked = accept(tree, logits, sampling, stream.row(0))
    ahead = RowStreams.seeded([seed]).ahead(1 + max(tree.depths()))[0]
    assert accept(tree, logits, sampling, ahead) == walked
    assert int(stream.counters[0]) == (len(walked[0]) if temperature else 0)


class _GreedyOracle:
    """Drafts the next three tokens of a fixed greedy continuation, whatever they are."""

    def __init__(self, prompt, continuation):
        self.prompt, self.continuation = prompt, continuation

    def propose(self, context):
        done = len(context) - len(self.prompt)
        return merge_drafts([self.continuation[done:done + 3]])

    def observe(self, context, new_tokens):
        pass


def test_a_response_ends_at_the_first_eos_inside_an_accepted_draft():
    """EOS as a draft token the target accepts (chat prompts put end-of-turn tokens into the
    tri-gram matrix): the response stops there, nothing after it is emitted."""
    model, prompt = _tiny_vocab_model(), [1, 2, 3]
    greedy = []
    with torch.no_grad():
        for _ in range(8):
            greedy.append(int(model(torch.tensor([prompt + greedy])).logits[0, -1].argmax()))
    end = next(j for j in range(2, 8) if greedy[j] not in greedy[:j])  # first new token past the 2nd
    sampling = SamplingParams(max_new_tokens=8, temperature=0.0)
    out, stats = aded_decode(TreeTarget(model), _GreedyOracle(prompt, greedy), [prompt], 1, [0], sampling,
                             {greedy[end]})
    assert out == [greedy[:end]]
    assert stats.forward_passes <= end  # the EOS came inside a verified draft, not as a bonus token


def test_greedy_acceptance_reproduces_plain_greedy_and_accepts_drafts(engine):
    sampling = SamplingParams(max_new_tokens=24, temperature=0.0)
    prompts = [engine.tokenizer(p).input_ids for p in GOOD_PROMPTS[:2]]
    plain = engine.generate(prompts, 1, [0, 1], sampling)
    # a representative that knows the model's own greedy continuations: drafts should be accepted
    matrix = TrigramMatrix.from_sequences([p + r.token_ids for p, r in zip(prompts, plain)])
    out, st = aded_decode(TreeTarget(engine.model), ADEDDrafter(matrix, adaptive=False), prompts, 1, [0, 1],
                          sampling, engine.eos_ids)
    assert out == [r.token_ids for r in plain]
    assert st.emitted / len(st.accepted_per_step) > 1.5
    assert st.forward_passes < max(len(r.token_ids) for r in plain)


def test_sampling_decode_matches_plain_sampling_with_the_same_seeds(engine):
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0)
    prompts = [engine.tokenizer(GOOD_PROMPTS[0]).input_ids]
    plain = engine.generate(prompts, 3, [5, 6, 7], sampling)
    matrix = TrigramMatrix.from_sequences([prompts[0] + r.token_ids for r in plain])
    out, _ = aded_decode(TreeTarget(engine.model), ADEDDrafter(matrix), prompts, 3, [5, 6, 7], sampling,
                         engine.eos_ids)
    assert out == [r.token_ids for r in plain]


def test_aded_drafter_is_a_tree_drafter():
    matrix = TrigramMatrix.from_sequences([[1, 2, 3, 4, 5]])
    drafter = ADEDDrafter(matrix, iterations=20)
    tree = drafter.propose([1, 2])
    assert isinstance(tree, TokenTree) and tree.tokens[:3] == [3, 4, 5]
    drafter.observe([7, 8, 9, 10], 2)  # learns (8, 9, 10)
    assert matrix.probability(8, 9, 10) > 0


def test_aded_build_strategy_in_process_with_a_built_trigram_matrix(tiny_models, tmp_path):
    from jobs.build_trigram import main as build_trigram

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The lamp works great, and I would keep it.\n\nThe app broke badly.\n")
    matrix_path = tmp_path / "m.npz"
    assert build_trigram(["--corpus", str(corpus), "--tokenizer", str(tiny_models["generator"]),
                          "--output", str(matrix_path)]) == 0
    assert len(load_trigram(str(matrix_path))) > 10
    assert build_trigram(["--corpus", str(tmp_path / "nope.txt"), "--tokenizer", str(tiny_models["generator"]),
                          "--output", str(matrix_path)]) == 2

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])

    def build(strategy, output, *extra):
        assert main(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(output),
                     "--set", f"models.generator={tiny_models['generator']}",
                     "--set", f"models.reward={tiny_models['reward']}", "--set", "runtime.local=true",
                     "--max-new-tokens", "12", "--num-samples", "3", "--strategy", strategy, *extra,
                     "--no-progress"]) == 0
        manifest = json.loads((output / "_manifest.json").read_text())
        rows = pq.read_table(output / "train-00000.parquet").to_pylist()
        return manifest, sorted((r["prompt_id"], r["chosen"], r["rejected"]) for r in rows)

    manifest, pairs = build("aded", tmp_path / "out", "--set", "strategy.iterations=30",
                            "--set", f"strategy.trigram={matrix_path}")
    assert manifest["pairs"] == 2 and manifest["config"]["strategy"]["name"] == "aded"
    # Best-of-N sampling, distribution unchanged: with the same seeds a real best_of_n build samples
    # the same candidates, so the same tokens and the same pairs.
    reference, reference_pairs = build("best_of_n", tmp_path / "bon")
    assert manifest["generated_tokens"] == reference["generated_tokens"] and pairs == reference_pairs



def test_aded_bad_trigram_file_is_a_config_error(tiny_models, tmp_path, capsys):
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": GOOD_PROMPTS[0]}])
    args = ["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(tmp_path / "out"),
            "--set", f"models.generator={tiny_models['generator']}", "--set", f"models.reward={tiny_models['reward']}",
            "--set", "runtime.local=true", "--strategy", "aded", "--set", f"strategy.trigram={bad}", "--no-progress"]
    assert main(args) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "strategy.trigram" in errors[0] and str(bad) in errors[0]
    assert not (tmp_path / "out" / "_markers").exists()
