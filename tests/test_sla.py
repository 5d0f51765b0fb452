"""SLA (Algorithm 2) against a fake self-rewarding model, and on a tiny real Reward Transformer."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.sla import SLAParams, streaming_looking_ahead

V, EOS, GOOD = 5, 4, 2


@dataclass
class FakeRows:
    seqs: list[list[int]]
    logits: torch.Tensor
    rewards: torch.Tensor


class FakeSelfRewardingLM:
    """Uniform next-token distribution over 0..3 (EOS with logit ``eos_logit``); R' of a sequence is
    the number of GOOD tokens in its response, so lookahead has something to find."""

    def __init__(self, eos_logit: float = float("-inf")):
        self.eos_ids = {EOS}
        self.eos_logit = eos_logit
        self.feeds = 0
        self.max_rows = 0

    def _refresh(self, rows: FakeRows) -> None:
        rows.logits = torch.zeros((len(rows.seqs), V))
        rows.logits[:, EOS] = self.eos_logit
        rows.rewards = torch.tensor([float(sum(t == GOOD for t in s[1:])) for s in rows.seqs])

    def prefill(self, prompts):
        rows = FakeRows([list(p[-1:]) for p in prompts], None, None)
        self._refresh(rows)
        return rows

    def feed(self, rows, tokens):
        self.feeds += 1
        self.max_rows = max(self.max_rows, len(rows.seqs))
        rows.seqs = [s + [int(t)] for s, t in zip(rows.seqs, tokens)]
        self._refresh(rows)

    def select(self, rows, index):
        rows.seqs = [list(rows.seqs[i]) for i in index]
        rows.logits, rows.rewards = rows.logits[index], rows.rewards[index]

    def decode(self, token_lists):
        return [" ".join(map(str, t)) for t in token_lists]


def run(model, prompts=([9],), num_samples=2, max_new_tokens=12, seeds=None, **params):
    seeds = seeds or list(range(len(prompts) * num_samples))
    return streaming_looking_ahead(model, [list(p) for p in prompts], num_samples, seeds,
                                   SamplingParams(max_new_tokens=max_new_tokens), SLAParams(**params))


def test_counts_rows_and_streaming_cost():
    model = FakeSelfRewardingLM()
    out = run(model, prompts=([9], [8]), num_samples=3, max_new_tokens=12, search_depth=2, search_width=2, step_size=3)
    assert [sorted(r.row for r in o.rows) for o in out] == [[0, 1, 2], [3, 4, 5]]
    assert all(len(r.token_ids) == 12 and r.finished for o in out for r in o.rows)
    # Streaming: one token of depth per forward pass, so the whole search costs as many passes
    # as the response has tokens (greedy's count), with at most k^d rows per search in the batch.
    assert model.feeds == 12
    assert model.max_rows <= 2 * 3 * 2 ** 2
    # Explored tokens: the tree is refilled one level (k^d leaves x n tokens) per commit.
    assert out[0].generated_tokens > 3 * 12


def test_lookahead_finds_higher_reward_than_sampling():
    out = run(FakeSelfRewardingLM(), num_samples=8, max_new_tokens=20, search_depth=2, search_width=4, step_size=2)
    good = sum(r.token_ids.count(GOOD) for r in out[0].rows) / sum(len(r.token_ids) for r in out[0].rows)
    # Plain sampling gives GOOD a quarter of the time; the max-Q commits pick it far more often.
    assert good > 0.6


class TrapLM(FakeSelfRewardingLM):
    """Tokens 1 and 2 only. The reward needs two steps of lookahead and a max backup (Alg. 2 lines
    4-5): after one token, 2 looks better (R' = 1 against 0); after two, the leaf (1, 1) is worth 10
    but (1, 2) is -100. Depth 1 commits 2; a mean backup over a's leaves commits 2 too (a 1-subtree
    holding a (1, 2) leaf averages far below any 2-subtree); only d = 2 with Q = max commits 1."""

    VALUES = {(1,): 0.0, (2,): 1.0, (1, 1): 10.0, (1, 2): -100.0, (2, 1): 1.0, (2, 2): 2.0}

    def _refresh(self, rows):
        rows.logits = torch.full((len(rows.seqs), V), float("-inf"))
        rows.logits[:, 1:3] = 0.0
        rows.rewards = torch.tensor([self.VALUES.get(tuple(s[1:3]), 0.0) for s in rows.seqs])


@pytest.mark.parametrize("depth,first_one", [(2, True), (1, False)])
def test_lookahead_is_depth_d_with_a_max_backup(depth, first_one):
    out = run(TrapLM(), num_samples=16, max_new_tokens=3, search_depth=depth, search_width=4, step_size=1,
              seeds=list(range(100, 116)))
    first = [r.token_ids[0] for r in out[0].rows]
    share = first.count(1) / len(first)
    # d = 2, max: a root child 1 with a (1, 1) leaf below it exists in ~99% of searches
    assert share > 0.8 if first_one else share < 0.2, first


def test_width_one_is_plain_sampling_with_the_same_seed():
    sla = run(FakeSelfRewardingLM(), num_samples=1, search_width=1, search_depth=3, step_size=2, seeds=[5])
    g = torch.Generator().manual_seed(5)
    expected = [int(torch.searchsorted(torch.linspace(0.25, 1, 4), torch.rand((), generator=g) * 1.0, right=True))
                for _ in range(12)]
    assert sla[0].rows[0].token_ids == expected


def test_searches_do_not_depend_on_their_batch():
    alone = run(FakeSelfRewardingLM(), prompts=([9],), num_samples=2, seeds=[11, 12])
    batched = run(FakeSelfRewardingLM(), prompts=([7], [9]), num_samples=2, seeds=[1, 2, 11, 12])
    assert [r.token_ids for r in alone[0].rows] == [r.token_ids for r in batched[1].rows]


def test_eos_ends_responses_and_every_search_returns():
    out = run(FakeSelfRewardingLM(eos_logit=0.0), num_samples=6, max_new_tokens=40, step_size=3)
    rows = out[0].rows
    assert len(rows) == 6 and all(EOS not in r.token_ids for r in rows)
    assert any(len(r.token_ids) < 40 for r in rows)


def test_params_are_validated():
    from pipeline.config import ConfigError

    with pytest.raises(ConfigError, match="strategy.search_width"):
        SLAParams(search_width=0)


def test_sla_refuses_a_model_without_trained_channel(engine):
    from pipeline.decoding import sla

    with pytest.raises(ValueError, match="trained reward channel"):
        engine.search(sla.search, [[1, 5, 6]], 2, [0, 1], SamplingParams(max_new_tokens=4), SLAParams())


def test_sla_benchmark_prompt_files(tmp_path, capsys):
    """benchmarks.sla on real models reads its prompts from JSONL files: the first rows of each,
    an overlap between the two sets refused, a bad row or too few rows one line naming the file and exit 2."""
    import json

    from benchmarks.sla import bench_prompts

    train, held = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("".join(json.dumps({"prompt": f"t{i}"}) + "\n" for i in range(5)))
    held.write_text(json.dumps({"prompt": "e0"}) + "\n\n" + json.dumps({"prompt": "e1"}) + "\n")
    assert bench_prompts(3, 2, 0, str(train), str(held)) == (["t0", "t1", "t2"], ["e0", "e1"])
    with pytest.raises(SystemExit) as e:
        bench_prompts(3, 3, 0, str(train), str(held))
    assert e.value.code == 2 and f"{held}: 2 prompts, 3 asked for" in capsys.readouterr().err
    held.write_text(json.dumps({"prompt": "t1"}) + "\n")
    with pytest.raises(SystemExit) as e:
        bench_prompts(3, 1, 0, str(train), str(held))
    assert e.value.code == 2 and "1 prompts also in" in capsys.readouterr().err
    held.write_text(json.dumps({"text": "no prompt"}) + "\n")
    with pytest.raises(SystemExit) as e:
        bench_prompts(3, 1, 0, str(train), str(held))
    assert e.value.code == 2 and f"{held}: row 1:" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        bench_prompts(3, 1, 0, str(train), None)
    assert e.value.code == 2 and "go together" in capsys.readouterr().err
    tiny_train, tiny_eval = bench_prompts(4, 2, 0)  # the tiny grammar, disjoint
    assert len(tiny_train) == 4 and len(tiny_eval) == 2 and not set(tiny_train) & set(tiny_eval)


def test_sla_benchmark_keeps_and_reuses_its_pair_build(tiny_models, tmp_path, monkeypatch, capsys):
    """--pairs DIR: the first run builds there, a run with the same settings reuses it without building,
    changed settings rebuild, and a directory that holds no pair build of the benchmark is refused (exit 2)."""
    import argparse
    import os
    from pathlib import Path

    import benchmarks.sla as bench

    args = argparse.Namespace(pairs=str(tmp_path / "pairs"), num_samples=2, max_new_tokens=8, temperature=1.0,
                              seed=0, device="cpu")
    gen, rew = str(tiny_models["generator"]), str(tiny_models["reward"])
    prompts = ["Write a review of the lamp.", "Describe the kettle."]
    built, how = bench.pair_build(gen, rew, prompts, tmp_path / "work", args)
    assert how.startswith("built") and (built / "_SUCCESS").exists() and not (tmp_path / "pairs-prompts.jsonl").exists()
    first = sorted(p.read_bytes() for p in built.glob("train-*.parquet"))

    def no_build(*_):
        raise AssertionError("rebuilt although the settings are the same")

    with monkeypatch.context() as m:
        m.setattr(bench, "build_pairs", no_build)
        again, how = bench.pair_build(gen, rew, prompts, tmp_path / "work", args)
    assert how.startswith("reused") and again == built
    assert sorted(p.read_bytes() for p in again.glob("train-*.parquet")) == first
    args.max_new_tokens = 6
    _, how = bench.pair_build(gen, rew, prompts, tmp_path / "work", args)
    assert how.startswith("built") and "settings changed" in capsys.readouterr().out
    weights = next(Path(rew).glob("*.safetensors"))  # a retrained reward model at the same path
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    _, how = bench.pair_build(gen, rew, prompts, tmp_path / "work", args)
    assert how.startswith("built") and "settings changed" in capsys.readouterr().out
    (tmp_path / "other").mkdir()
    args.pairs = str(tmp_path / "other")
    with pytest.raises(SystemExit) as e:
        bench.pair_build(gen, rew, prompts, tmp_path / "work", args)
    assert e.value.code == 2 and "holds no pair build" in capsys.readouterr().err
