"""Engine settings from config (issue 30, items 1 and 3): models.hf reaches every HF model load,
models.vllm / reward_vllm reach vLLM and size each actor's GPU request, plan-time checks refuse a
device or a setting the actors cannot have, and the workers get the driver's Hugging Face settings
(the token as an actor argument, never in a runtime_env)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pipeline.config import ConfigError, load_config
from tests.conftest import GOOD_PROMPTS, write_jsonl


def config(tiny_models, *overrides):
    """The demo config on the tiny models; an override ``strategy.name=X`` switches the strategy."""
    strategy = next((o.split("=", 1)[1] for o in overrides if o.startswith("strategy.name=")), None)
    return load_config("configs/demo.yaml", [f"models.generator={tiny_models['generator']}",
                                             f"models.reward={tiny_models['reward']}",
                                             *(o for o in overrides if not o.startswith("strategy.name="))],
                       strategy=strategy)


# -- models.hf --------------------------------------------------------------------------------

def test_hf_settings_become_from_pretrained_keywords_per_role():
    hf = load_config(None, ["models.hf={revision: {generator: v1, reward: abc123}, attn_implementation: eager, "
                            "trust_remote_code: true, kwargs: {low_cpu_mem_usage: true}}"]).models.hf
    assert hf.load_kwargs("generator") == {"revision": "v1", "attn_implementation": "eager", "trust_remote_code": True,
                                           "low_cpu_mem_usage": True}
    assert hf.load_kwargs("reward")["revision"] == "abc123"
    assert "revision" not in hf.load_kwargs("draft")  # a role left out loads the default branch
    assert load_config(None, ["models.hf.revision=main"]).models.hf.load_kwargs("draft")["revision"] == "main"
    assert load_config(None, []).models.hf.load_kwargs("generator") == {}  # trust_remote_code never on by default


@pytest.mark.parametrize("override, key", [
    ("models.hf.revision={policy: v1}", "models.hf.revision.policy"),
    ("models.hf.kwargs={trust_remote_code: true}", "models.hf.kwargs.trust_remote_code"),
    ("models.hf.kwargs={torch_dtype: float16}", "models.hf.kwargs.torch_dtype"),
    ("models.hf.attn=eager", "models.hf.attn"),
    ("models.dtype=fp8", "models.dtype"),
    ("models.reward_backend=tgi", "models.reward_backend"),
    ("models.vllm={model: x}", "models.vllm.model"),
    ("models.vllm={tensor_parallel_size: 0}", "models.vllm.tensor_parallel_size"),
    ("models.reward_vllm={pipeline_parallel_size: two}", "models.reward_vllm.pipeline_parallel_size"),
])
def test_bad_engine_settings_are_one_line_naming_the_key(override, key):
    with pytest.raises(ConfigError) as exc:
        load_config(None, [override])
    assert key in str(exc.value) and "\n" not in str(exc.value)


def test_hf_settings_reach_every_model_an_actor_loads(tiny_models):
    """attn_implementation and dtype auto, through the factory's actor plan, in the generator, its
    colocated draft and the reward model."""
    from actors.factory import _plan_actors

    cfg = config(tiny_models, "models.hf.attn_implementation=eager", "models.dtype=auto", "strategy.name=dsbd",
                 f"models.draft={tiny_models['draft']}", "runtime.local=true")
    plan = _plan_actors(cfg)
    generator = plan.generator_cls(*plan.generator_args, **plan.generator_kwargs)
    reward = plan.reward_cls(*plan.reward_args, **plan.reward_kwargs)
    models = [generator.engine.model, generator.engine.drafter.model, reward.scorer.model]
    assert [m.config._attn_implementation for m in models] == ["eager"] * 3
    assert [next(m.parameters()).dtype for m in models] == [torch.float32] * 3  # the checkpoints' own


def test_a_revision_that_does_not_exist_is_refused_at_plan_time(tiny_models, tmp_path, monkeypatch):
    """A local directory has no revisions, so transformers ignores one; a Hub id (here: offline, not
    cached) with any revision cannot be read and is refused before a worker starts."""
    from pipeline.build import plan_build

    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in GOOD_PROMPTS[:2]])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cfg = config(tiny_models, f"data.prompts={prompts}", f"data.output={tmp_path / 'out'}",
                 "models.generator=nobody-here/no-such-model", "models.hf.revision={generator: v9}")
    with pytest.raises(ConfigError, match="models.generator: cannot load 'nobody-here/no-such-model'"):
        plan_build(cfg)


# -- GPUs and the device ------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, generator_gpus, reward_gpus", [
    ([], 0, 0),  # cpu: nothing asked
    (["models.device=cuda", "runtime.generator.num_gpus=1", "runtime.reward.num_gpus=0.5"], 1, 0.5),
    (["models.backend=vllm", "strategy.name=sbon", "models.device=cuda", "models.vllm={tensor_parallel_size: 4}"], 4, 0),
    (["models.backend=vllm", "models.device=cuda", "models.vllm={tensor_parallel_size: 2, pipeline_parallel_size: 2}",
      "runtime.generator.num_gpus=8"], 8, 0),  # the config asks for more: kept
    (["models.reward_backend=vllm", "models.device=cuda", "runtime.generator.num_gpus=1",
      "models.reward_vllm={tensor_parallel_size: 2}"], 1, 2),
    (["models.backend=vllm", "models.vllm={tensor_parallel_size: 2}"], 0, 0),  # vLLM on CPU: no GPU
])
def test_each_actor_asks_ray_for_the_gpus_its_engine_spans(tiny_models, overrides, generator_gpus, reward_gpus):
    from actors.factory import actor_resources, engine_settings

    cfg = config(tiny_models, *overrides)
    assert actor_resources(cfg, "generator").num_gpus == generator_gpus
    assert actor_resources(cfg, "reward").num_gpus == reward_gpus
    settings = engine_settings(cfg, "generator")
    if cfg.models.backend == "vllm" and cfg.models.engine_gpus("generator") > 1:
        assert settings["distributed_executor_backend"] == "mp"  # never Ray's executor inside a Ray actor
    assert engine_settings(cfg, "reward") is None or cfg.models.reward_backend == "vllm"


@pytest.mark.parametrize("overrides, message", [
    (["models.device=cuda"], "runtime.generator.num_gpus is 0"),
    (["models.device=cuda", "runtime.generator.num_gpus=1"], "runtime.reward.num_gpus is 0"),
    (["models.device=cuda:1", "runtime.generator.num_gpus=1", "runtime.reward.num_gpus=1", "strategy.name=dsbd",
      "runtime.draft_placement=actor", "models.draft=DRAFT"], "runtime.draft.num_gpus is 0"),
    (["models.hf.attn_implementation=flash_attention_9"], "models.hf.attn_implementation: 'flash_attention_9'"),
])
def test_plan_time_refuses_a_device_or_setting_the_actors_cannot_have(tiny_models, overrides, message):
    from pipeline.preflight import check_engines

    overrides = [o.replace("DRAFT", str(tiny_models["draft"])) for o in overrides]
    with pytest.raises(ConfigError) as exc:
        check_engines(config(tiny_models, *overrides))
    assert message in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_plan_time_refuses_cuda_in_process_without_a_gpu(tiny_models):
    from pipeline.preflight import check_engines

    with pytest.raises(ConfigError, match="sees no GPU"):
        check_engines(config(tiny_models, "models.device=cuda", "runtime.local=true"))


def test_a_reward_function_needs_no_gpu_and_hub_kernels_pass(tiny_models):
    from pipeline.preflight import check_engines

    check_engines(config(tiny_models, "models.device=cuda", "runtime.generator.num_gpus=1",
                         "models.reward=pipeline.judge:ifeval_reward",
                         "models.hf.attn_implementation=kernels-community/flash-attn"))


def test_vllm_settings_are_left_to_the_actor_where_the_driver_has_no_vllm(tiny_models):
    from pipeline.engines.backends import _vllm_engine_keys
    from pipeline.preflight import check_engines

    if _vllm_engine_keys() is not None:
        pytest.skip("vLLM is installed here: test_vllm_settings_are_checked_against_vllms_engine_arguments runs")
    check_engines(config(tiny_models, "models.backend=vllm", "models.vllm={max_model_lenn: 4096}"))


@pytest.mark.vllm
def test_vllm_settings_are_checked_against_vllms_engine_arguments(tiny_models):
    from pipeline.engines.backends import _vllm_engine_keys
    from pipeline.preflight import check_engines

    if _vllm_engine_keys() is None:
        pytest.skip("vllm is not installed (make install-vllm)")
    with pytest.raises(ConfigError, match=r"models.vllm.max_model_lenn: not a vllm engine argument \(did you mean "
                                          r"max_model_len\?\)"):
        check_engines(config(tiny_models, "models.backend=vllm", "models.vllm={max_model_lenn: 4096}"))
    with pytest.raises(ConfigError, match=r"models.reward_vllm.runnerr"):
        check_engines(config(tiny_models, "models.reward_backend=vllm", "models.reward_vllm={runnerr: pooling}"))
    check_engines(config(tiny_models, "models.backend=vllm", "models.vllm={max_model_len: 4096, enforce_eager: true, "
                                      "gpu_memory_utilization: 0.8, max_num_seqs: 64, quantization: fp8, "
                                      "tensor_parallel_size: 2}"))


def test_vllm_settings_for_an_hf_engine_are_noted_as_unused(tiny_models, capsys):
    from pipeline.preflight import check_engines

    check_engines(config(tiny_models, "models.reward_vllm={max_model_len: 512}"))
    assert "models.reward_vllm is set but the reward model runs on backend hf" in capsys.readouterr().err


# -- the workers' environment ---------------------------------------------------------------------

HF_SECRET = "hf_FAKEtokenNOTREAL0123456789"


def test_runtime_env_carries_hugging_face_settings_but_never_the_token(monkeypatch):
    from actors.factory import ray_runtime_env, secret_env

    monkeypatch.setenv("HF_HOME", "/models/hf")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("TRANSFORMERS_CACHE", "/models/tf")
    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    monkeypatch.setenv("HUGGING_FACE_HUB_TOKEN", HF_SECRET)
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")
    env = ray_runtime_env()["env_vars"]
    assert env["MALLOC_MMAP_THRESHOLD_"] == "4194304"
    assert {k: env[k] for k in ("HF_HOME", "HF_HUB_OFFLINE", "HF_ENDPOINT", "TRANSFORMERS_CACHE")} == {
        "HF_HOME": "/models/hf", "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9",
        "TRANSFORMERS_CACHE": "/models/tf"}
    assert HF_SECRET not in json.dumps(env)
    secrets = secret_env()
    assert HF_SECRET not in repr(secrets) and HF_SECRET not in str(secrets) and "HF_TOKEN" in repr(secrets)


def test_secret_env_keeps_a_value_the_node_already_has(monkeypatch):
    from actors.remote import SecretEnv

    monkeypatch.setenv("HF_TOKEN", "the-node's-own")
    monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
    SecretEnv({"HF_TOKEN": HF_SECRET, "HUGGING_FACE_HUB_TOKEN": HF_SECRET}).install()
    assert os.environ["HF_TOKEN"] == "the-node's-own" and os.environ["HUGGING_FACE_HUB_TOKEN"] == HF_SECRET


@pytest.mark.integration
def test_ray_workers_get_the_token_and_hf_settings_but_no_ray_file_holds_the_token(cluster, tiny_models, tmp_path,
                                                                                 monkeypatch):
    """The cluster starts before the driver's environment holds the token (as a cluster started by
    `ray start` or KubeRay does), so only our argument can bring it. Then: the actors' process
    environment has it; no file of the Ray session (logs, runtime_env_agent.log, where each actor's
    runtime_env is written) does; HF_* settings reach them through the runtime_env."""
    import ray

    from actors import start_workers

    monkeypatch.setenv("HF_TOKEN", HF_SECRET)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4194304")  # actors.factory.MALLOC_ENV: set when the worker starts
    workers = start_workers(config(tiny_models))
    try:
        for handle in workers.handles:
            seen = ray.get(handle.__ray_call__.remote(
                lambda self: (os.environ.get("HF_TOKEN"), os.environ.get("HF_HUB_DISABLE_TELEMETRY"),
                              os.environ.get("MALLOC_MMAP_THRESHOLD_"))))
            assert seen == (HF_SECRET, "1", "4194304")
    finally:
        workers.shutdown()
    session = ray._private.worker._global_node.get_session_dir_path()
    from pathlib import Path

    leaked = [str(p) for p in Path(session).rglob("*") if p.is_file() and not p.is_symlink()
              and _holds(p, HF_SECRET.encode())]
    assert leaked == []


def _holds(path, needle: bytes) -> bool:
    try:
        return needle in path.read_bytes()
    except OSError:
        return False


def test_plan_time_reads_a_vllm_models_config_at_the_revision_vllm_loads(tiny_models):
    """A model on vLLM takes its revision from models.vllm / reward_vllm: plan time reads the same."""
    from pipeline.preflight import plan_load_kwargs

    cfg = config(tiny_models, "models.backend=vllm", "models.reward_backend=vllm", "models.hf.revision=main",
                 "models.vllm={revision: v2, trust_remote_code: true}", "models.reward_vllm={tokenizer_revision: t3}")
    assert plan_load_kwargs(cfg, "generator") == {"revision": "v2", "trust_remote_code": True}
    assert plan_load_kwargs(cfg, "reward") == {"revision": "t3"}
    assert plan_load_kwargs(cfg, "draft") == {"revision": "main"}
    hf = config(tiny_models, "models.hf.revision=main", "models.vllm={revision: v2}")  # HF backend: models.hf
    assert plan_load_kwargs(hf, "generator") == {"revision": "main"}


def test_the_dtype_benchmark_decodes_with_one_engine_per_dtype(tiny_models, capsys, monkeypatch):
    """benchmarks.hf_throughput --compare-dtype: each engine loads in its own dtype and the ratios
    are to float32's median (what jobs.fetch_models --sampling-dtype trades)."""
    from benchmarks import hf_throughput
    from pipeline.engines.hf import HFEngine

    loaded = []
    load = HFEngine.from_pretrained.__func__
    monkeypatch.setattr(HFEngine, "from_pretrained", classmethod(
        lambda cls, path, **kw: loaded.append(kw["dtype"]) or load(cls, path, **kw)))
    assert hf_throughput.main(["--generator", str(tiny_models["generator"]), "--compare-dtype", "--rows", "2",
                               "--max-new-tokens", "4", "--repeats", "2"]) == 0
    assert loaded == ["float32", "bfloat16"]
    out = capsys.readouterr().out
    assert "float32" in out and "1.00x float32" in out and "x float32" in out.split("bfloat16", 1)[1]
    result = hf_throughput.compare_dtype(str(tiny_models["generator"]), 2, 4, 1, 1)
    bf16 = result["bfloat16"]["median_tokens_per_s"] / result["float32"]["median_tokens_per_s"]
    assert result["throughput_ratio_over_float32"] == {"float32": 1.0, "bfloat16": pytest.approx(bf16, abs=5e-3)}


def test_the_contention_benchmark_scores_in_another_thread_during_the_contended_runs_only(tiny_models, monkeypatch):
    """benchmarks.hf_throughput --contend-reward: each decode kernel decodes alone, then while the
    reward model scores in another thread (calls made during the run), runs alternating; the
    slowdown is alone over contended."""
    import time

    from benchmarks import hf_throughput
    from pipeline.engines import attention_kernel, kv_cache

    calls, seen = [0], []
    score = hf_throughput.RewardScorer.score
    monkeypatch.setattr(hf_throughput.RewardScorer, "score",
                        lambda self, *a, **kw: calls.__setitem__(0, calls[0] + 1) or score(self, *a, **kw))

    def session(engine, prompts, rows, tokens):  # the reward thread, if any, scores while this runs
        before, deadline = calls[0], time.monotonic() + 5  # alone: nothing scores
        while tokens > 2 and calls[0] == before and time.monotonic() < deadline:
            time.sleep(0.05)
        seen.append((attention_kernel.gathers(), calls[0] > before))
        return rows * tokens

    monkeypatch.setattr(hf_throughput, "run_session", session)
    monkeypatch.setattr(hf_throughput, "_summary", lambda rates: {"tokens_per_s": rates,
                                                                  "median_tokens_per_s": rates[0]})
    result = hf_throughput.contend_reward(str(tiny_models["generator"]), str(tiny_models["reward"]), 2, 4, 1, 1,
                                          batch=2)
    # warm-up (no reward thread), then flex alone, flex contended, gather alone, gather contended
    assert [g for g, _ in seen] == [False, True, False, False, True, True]
    assert [c for _, c in seen[2:]] == [False, True, False, True]
    for kernel in ("flex", "sdpa+gather"):
        r = result[kernel]
        assert r["slowdown"] == round(r["alone"]["median_tokens_per_s"] / r["contended"]["median_tokens_per_s"], 2)
        assert r["reward_calls_per_s"] > 0


def test_the_attention_benchmark_measures_the_gather_decode_kernel_beside_the_default(tiny_models, monkeypatch):
    """benchmarks.hf_throughput --compare-attention: ``sdpa+gather`` decodes on the sdpa engine with
    the KV cache's blocks gathered (BON_KV_KERNEL=gather), every other path with the default kernel;
    the setting the caller had is back afterwards."""
    from benchmarks import hf_throughput
    from pipeline.engines import attention_kernel, kv_cache

    monkeypatch.setenv(kv_cache.KERNEL_ENV, "gather")  # as the test suite runs; the default path must unset it
    seen = []
    monkeypatch.setattr(hf_throughput, "_rate", lambda engine, *a: seen.append(
        (engine.model.config._attn_implementation, attention_kernel.gathers())) or 1.0)
    result = hf_throughput.compare_attention(str(tiny_models["generator"]), 2, 4, 1, 1,
                                             paths=("sdpa", "sdpa+gather", "eager"))
    assert seen == [("sdpa", False), ("sdpa", True), ("eager", False)] * 2  # warm-up, then one repeat
    assert all(result[p]["median_tokens_per_s"] == 1.0 for p in ("sdpa", "sdpa+gather", "eager"))
    assert attention_kernel.gathers()
    with hf_throughput.decode_kernel(False):
        assert not attention_kernel.gathers()
