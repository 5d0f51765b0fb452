"""vLLM backend: bookkeeping against the Generator protocol with a fake LLM, and a build through
the public job on real vLLM (marker ``vllm``: ``make test-vllm`` runs it on CPU; tests/test_vllm_real.py
holds the engine-level tests on real vLLM)."""

import random
from types import SimpleNamespace

import pytest

from pipeline.decoding.best_of_n import BestOfNParams, best_of_n
from pipeline.decoding.protocols import PromptInput
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection
from pipeline.engines.vllm_engine import VLLMEngine, segment_seed

EOS = 0


class FakeLLM:
    """Stands in for vllm.LLM.generate: tokens from the request seed, EOS with probability 0.05."""

    def __init__(self):
        self.calls = []
        self.generated = 0

    def generate(self, requests, sampling_params, use_tqdm=True):
        self.calls.append([(list(r["prompt_token_ids"]), p) for r, p in zip(requests, sampling_params)])
        outputs = []
        for p in sampling_params:
            rng, tokens = random.Random(p.seed), []
            while len(tokens) < p.max_tokens:
                tokens.append(EOS if rng.random() < 0.05 else rng.randint(1, 50))
                if tokens[-1] in p.stop_token_ids and not p.ignore_eos:
                    break
            reason = "stop" if tokens[-1] == EOS else "length"
            self.generated += len(tokens)
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, finish_reason=reason)]))
        return outputs


class FakeTokenizer:
    def batch_decode(self, seqs, skip_special_tokens=True):
        return [" ".join(map(str, s)) for s in seqs]


def fake_engine():
    return VLLMEngine(FakeLLM(), FakeTokenizer(), {EOS}, lambda **kw: SimpleNamespace(**kw))


def test_extend_sends_prefix_plus_tokens_and_stops_at_the_decision_token():
    engine = fake_engine()
    engine.open("s", [[7, 8], [9]], 3, [11, 12, 13, 14, 15, 16], SamplingParams(max_new_tokens=20))
    rows = engine.extend("s", until=5)
    assert [r.row for r in rows] == list(range(6))
    assert all(len(r.token_ids) == 5 or r.finished for r in rows)
    first = engine.llm.calls[0]
    assert [req for req, _ in first] == [[7, 8]] * 3 + [[9]] * 3
    assert all(p.max_tokens == 5 and p.seed == segment_seed(s, 0) for (_, p), s in zip(first, range(11, 17)))
    unfinished = [r.row for r in rows if not r.finished]
    keep = unfinished[:2]
    later = engine.extend("s", until=12, keep=keep)
    assert [r.row for r in later] == keep
    second = engine.llm.calls[1]
    assert len(second) == 2
    for (req, p), r in zip(second, keep):
        prompt = [7, 8] if r < 3 else [9]
        assert req == prompt + rows[r].token_ids  # continued from its own tokens (prefix cache hit)
        assert p.max_tokens == 12 - 5 and p.seed == segment_seed(11 + r, 5)
        assert later[keep.index(r)].token_ids[:5] == rows[r].token_ids
    assert all(EOS not in r.token_ids for r in later)
    assert engine.close("s") == {"generated_tokens": engine.llm.generated, "forward_passes": 6 + 2}
    with pytest.raises(ValueError, match="unknown session"):
        engine.extend("s", until=3)


def test_speculative_rejection_and_best_of_n_run_on_the_vllm_backend():
    from tests.test_decoding import FakeScorer

    prompts = [PromptInput(f"p{i}", "x", "x", [1, 2]) for i in range(2)]
    sampling = SamplingParams(max_new_tokens=16)
    sbon = speculative_rejection(prompts, fake_engine(), FakeScorer(),
                                 SpeculativeRejectionParams([4, 8], 0.5, keep_lowest=False), sampling, 8, seed=1)
    bon = best_of_n(prompts, fake_engine(), FakeScorer(), BestOfNParams(), sampling, 8, seed=1)
    for a, b in zip(sbon, bon):
        assert len(a.candidates) == len(b.candidates) == 8
        assert a.generated_tokens < b.generated_tokens
        assert any(c.stopped_early for c in a.candidates)
        # Same seeds, same segment seeds: every row's first 4 tokens agree with Best-of-N's.
        assert [c.token_ids[:4] for c in a.candidates] == [c.token_ids[:4] for c in b.candidates]


@pytest.mark.vllm
def test_a_build_with_the_vllm_backend_writes_pairs(tiny_models, tmp_path):
    """The public job with models.backend vllm (in-process actors; make test-vllm runs it on CPU)."""
    pytest.importorskip("vllm", reason="vllm is not installed (make install-vllm, or pip install .[vllm] on a GPU)")
    import json

    import pyarrow.parquet as pq

    from jobs.build_dataset import main
    from jobs.make_tiny_models import make_vllm_model
    from tests.conftest import GOOD_PROMPTS, write_jsonl

    model = make_vllm_model(tmp_path / "vllm-model")
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:6]])
    out = tmp_path / "out"
    assert main(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(out),
                 "--set", f"models.generator={model}", "--set", f"models.reward={tiny_models['reward']}",
                 "--set", "models.draft=", "--set", "models.backend=vllm", "--set", "runtime.local=true",
                 "--num-samples", "4", "--max-new-tokens", "16", "--set", "strategy.decision_token=4",
                 "--no-progress"]) == 0
    manifest = json.loads((out / "_manifest.json").read_text())
    pairs = [r for part in sorted(out.glob("part-*.parquet")) for r in pq.read_table(part).to_pylist()]
    assert manifest["pairs"] + manifest["prompts_rejected"] == len(GOOD_PROMPTS[:6]) == manifest["prompts_in"]
    assert len(pairs) == manifest["pairs"] >= 1
    assert all(p["chosen"] != p["rejected"] and p["chosen_score"] >= p["rejected_score"] for p in pairs)


def test_model_side_methods_are_refused_by_the_vllm_backend():
    with pytest.raises(ValueError, match="not the model-side method 'dsbd'"):
        fake_engine().search("dsbd", [[1, 2]], 2, [0, 1], None, None)
