"""SLA through Ray: a GeneratorActor loads a Reward Transformer directory and serves the
model-side search; the candidates equal the in-process ones."""

import pytest

ray = pytest.importorskip("ray")

from actors import start_workers  # noqa: E402
from actors.factory import local_generator, local_scorer  # noqa: E402
from pipeline.config import config_from_dict  # noqa: E402
from pipeline.coordinator import Coordinator  # noqa: E402
from pipeline.decoding.domain import PromptInput  # noqa: E402
from pipeline.decoding.sampling import SamplingParams  # noqa: E402
from pipeline.engines.hf import HFEngine, load_tokenizer  # noqa: E402
from pipeline.engines.reward_transformer import RewardTransformer  # noqa: E402
from pipeline.training.reward_channel import train_reward_channel  # noqa: E402
from tests.conftest import GOOD_PROMPTS  # noqa: E402
from tests.test_reward_transformer import synthetic_pairs  # noqa: E402

pytestmark = pytest.mark.integration


def test_sla_on_ray_actors_matches_in_process(cluster, tiny_models, scorer, tmp_path):
    tok = load_tokenizer(str(tiny_models["generator"]))
    rt = RewardTransformer.from_pretrained(str(tiny_models["generator"]), hidden_size=16)
    train_reward_channel(rt, synthetic_pairs(tok, 8), tok.pad_token_id, epochs=1, batch_size=4, progress=False)
    rt.save_pretrained(str(tmp_path / "rt"), tok)

    cfg = config_from_dict({
        "models": {"generator": str(tmp_path / "rt"), "reward": str(tiny_models["reward"])},
        "strategy": {"name": "sla", "step_size": 3},
        "sampling": {"num_samples": 2, "max_new_tokens": 10},
        "runtime": {"generator": {"num_cpus": 1}, "reward": {"num_cpus": 1}, "prompts_per_batch": 2},
    })
    sampling = SamplingParams(max_new_tokens=10)
    prompts = [PromptInput(f"id{i}", t, t, tok(t).input_ids) for i, t in enumerate(GOOD_PROMPTS[:3])]
    engine = HFEngine.from_pretrained(str(tmp_path / "rt"))
    local = Coordinator("sla", cfg.strategy.params, sampling, 2, 0, [local_generator(engine, timed=False)],
                        [local_scorer(scorer, timed=False)], 2, 1)
    expected = {r.prompt.prompt_id: [c.text for c in r.candidates] for r in local.run(prompts)}
    workers = start_workers(cfg)
    try:
        remote = Coordinator("sla", cfg.strategy.params, sampling, 2, 0, workers.generators, workers.scorers, 2, 1)
        results = list(remote.run(prompts))
    finally:
        workers.shutdown()
    assert {r.prompt.prompt_id: [c.text for c in r.candidates] for r in results} == expected
    assert all(r.generated_tokens > 0 and len(r.candidates) == 2 for r in results)
