"""Speculative rejection on vLLM (rounds and continuous batching) against Best-of-N on vLLM and on
our HF engine, end to end through the build job on the real models.

    .venv-vllm/bin/python -m benchmarks.vllm_sbon [--config configs/real.yaml] [--num-prompts 8]
        [--runs bon_vllm,sbon_rounds,sbon_continuous,bon_hf] [--set KEY=VALUE ...] [--no-judge]
        [--throughput] [--output out/bench/vllm-sbon] [--json FILE]

    make bench-vllm    # the same, in .venv-vllm (make install-vllm, make real-models)

Each run is one ``jobs.build_dataset`` build of configs/real.yaml (SmolLM2-135M-Instruct, the
composite of IFEval's checkers and its reward model, N 32, 256 tokens, tau 64, alpha 0.75) on the
first ``--num-prompts`` prompts, same seed,
Ray actors as the config places them; only these differ:

- ``bon_vllm``: Best-of-N, models.backend vllm, continuous batching (runtime.continuous_batching: every
  row of every batch in flight in one vLLM engine: what LLM.generate over all prompts does);
- ``sbon_rounds``: speculative rejection on vLLM, runtime.continuous_batching false: each batch
  (``--rounds-batch`` prompts, default all of them) decodes every row to tau with one
  LLM.generate, scores, and continues the survivors with another (their prefix re-read through
  vLLM's prefix cache): synchronous rounds with a barrier;
- ``sbon_continuous``: speculative rejection on vLLM with continuous batching
  (pipeline.engines.vllm_engine.ContinuousVLLMEngine), one prompt per batch, 16 batches in flight:
  every candidate is its own request, each prompt prunes at its own tau, pruned requests are
  aborted and the next prompts' requests take their place;
- ``bon_hf``: Best-of-N on our HF engine (continuous batching), the pipeline's default backend;
- ``sbon_continuous_spec``: ``sbon_continuous`` with vLLM's ngram speculative decoding
  (models.speculative: k = ``--spec-tokens`` draft tokens while at most ``--spec-rows`` requests
  decode, pipeline.decoding.speculative.SpeculativeDecoding): the survivors finish speculatively
  once the batch has thinned;
- ``sbon_hf`` / ``sbon_hf_spec``: speculative rejection on the HF engine (continuous batching), without
  and with the same speculative decoding of each batch's finish (prompt lookup verified with
  ADED's exact acceptance: the same candidates as ``sbon_hf``, up to float rounding).
- ``sbon_continuous_vllm_reward`` / ``bon_vllm_vllm_reward``: ``sbon_continuous`` / ``bon_vllm`` with
  the reward model on vLLM's pooling runner too (models.reward_backend vllm,
  pipeline.engines.vllm_reward.VLLMRewardScorer: prefix caching instead of our reward-side KV
  cache; its KV cache ``--reward-kv-fraction`` of the node's memory, weights included), against
  the same run with the reward model on our HF scorer.

Each ``X_vllm_reward`` run next to its ``X`` also gets ``X_vllm_reward_over_X`` (X's run seconds over
its own: above 1, the reward model on vLLM is faster), both runs' reward-actor seconds (inside
their calls, and in the model), and how far their pairs agree (same chosen and rejected sample per
prompt, largest chosen-score difference): the two scorers read the same tokens, so their choices
differ only where scores tie within float tolerance (or, in sbon, where that changes which rows go
on, and so what the generator samples next).

Printed per run: run seconds (first batch to last commit; engine start left out), generated tokens,
tokens/s; the run-time ratios against ``bon_vllm``; the normalized score (Eq. 5 of the speculative
rejection paper, over Best-of-N on vLLM's max and min reward per prompt: both sbon runs sample
their first tau tokens from the same seeds, and the continuous one samples exactly Best-of-N's
candidates) and, unless ``--no-judge``, IFEval's strict accuracy of each run's chosen responses
and its pair accuracy (benchmarks.real_sbon.ifeval; the prompts need IFEval's columns, e.g.
``--set data.prompts=configs/prompts/ifeval-eval.jsonl``), over the prompts both runs paired.

``--throughput`` also times raw decoding at 128 rows x 128 tokens (EOS ignored, both cores): vLLM's
LLM.generate in this process, then our HFEngine (benchmarks.hf_throughput) in a process of its own
on ``--hf-python`` (default .venv/bin/python: the HF engine as users run it; in .venv-vllm, whose
transformers is pinned below 5.20, the same engine measured 2.3x slower), tokens/s and their ratio.

Targets: sbon on vLLM >= 2.5x faster than Best-of-N on vLLM at normalized score >= 98;
continuous >= 1.2x over rounds; HFEngine >= 0.9x vLLM's tokens/s at 128 x 128.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import bench_parser, fail, job_argv, parse, read_prompts, run_job, write_json, write_prompts
from benchmarks.real_sbon import ifeval, quality, read_pairs

RUNS = {
    "bon_vllm": ("best_of_n", ["models.backend=vllm", "runtime.continuous_batching=true"]),
    "sbon_rounds": ("sbon", ["models.backend=vllm", "runtime.continuous_batching=false", "runtime.batches_in_flight=1"]),
    "sbon_continuous": ("sbon", ["models.backend=vllm", "runtime.continuous_batching=true", "runtime.prompts_per_batch=1",
                                 "runtime.batches_in_flight=16"]),
    "bon_hf": ("best_of_n", ["models.backend=hf", "runtime.continuous_batching=true"]),
    "sbon_continuous_spec": ("sbon", ["models.backend=vllm", "runtime.continuous_batching=true", "runtime.prompts_per_batch=1",
                                      "runtime.batches_in_flight=16", "SPEC"]),
    "sbon_hf": ("sbon", ["models.backend=hf", "runtime.continuous_batching=true"]),
    "sbon_hf_spec": ("sbon", ["models.backend=hf", "runtime.continuous_batching=true", "SPEC"]),
    "sbon_continuous_vllm_reward": ("sbon", ["models.backend=vllm", "runtime.continuous_batching=true",
                                             "runtime.prompts_per_batch=1", "runtime.batches_in_flight=16",
                                             "VLLM_REWARD"]),
    "bon_vllm_vllm_reward": ("best_of_n", ["models.backend=vllm", "runtime.continuous_batching=true", "VLLM_REWARD"]),
}
VLLM_REWARD_SUFFIX = "_vllm_reward"
DEFAULT_RUNS = ["bon_vllm", "sbon_rounds", "sbon_continuous", "bon_hf"]
BASELINE = "bon_vllm"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser("benchmarks.vllm_sbon", __doc__, config="configs/real.yaml",
                          num_prompts=dict(default=8, help="how many of the config's data.prompts (first ones)"),
                          set=dict(default=[], help="passed to every build (strategy.* ones to the sbon builds "
                                   "only), e.g. --set sampling.num_samples=16 --set strategy.decision_token=64"),
                          output="out/bench/vllm-sbon", json=None)
    parser.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated, of {', '.join(RUNS)}")
    parser.add_argument("--spec-tokens", type=int, default=4, help="the *_spec runs' draft tokens per step")
    parser.add_argument("--spec-rows", type=int, default=16, help="the *_spec runs' most live rows that speculate")
    parser.add_argument("--reward-kv-fraction", type=float, default=0.15,
                        help="the *_vllm_reward runs' models.reward_vllm.gpu_memory_utilization (on CPU: of the "
                             "node's memory, weights included)")
    parser.add_argument("--rounds-batch", type=int, help="sbon_rounds' prompts per batch (default: all of them)")
    parser.add_argument("--no-judge", action="store_true", help="skip the IFEval figures")
    parser.add_argument("--throughput", action="store_true", help="also time raw decoding at 128 rows x 128 tokens")
    parser.add_argument("--hf-python", default=".venv/bin/python" if Path(".venv/bin/python").exists() else sys.executable,
                        help="--throughput's Python for the HF engine (default: the product's .venv)")
    args = parse(parser, argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown:
        parser.error(f"--runs: unknown {unknown}; known: {', '.join(RUNS)}")
    return args


def build(name: str, args: argparse.Namespace, prompts: Path, count: int) -> dict:
    """One run through the build job; its run report."""
    strategy, overrides = RUNS[name]
    if name == "sbon_rounds":
        overrides = overrides + [f"runtime.prompts_per_batch={args.rounds_batch or count}"]
    if "SPEC" in overrides:
        overrides = [o for o in overrides if o != "SPEC"] + [
            f"models.speculative.num_speculative_tokens={args.spec_tokens}", f"models.speculative.max_rows={args.spec_rows}"]
    if "VLLM_REWARD" in overrides:
        overrides = [o for o in overrides if o != "VLLM_REWARD"] + [
            "models.reward_backend=vllm", f"models.reward_vllm.gpu_memory_utilization={args.reward_kv_fraction}"]
    output = Path(args.output) / name
    # --set data.prompts chose the file whose first --num-prompts rows are in ``prompts``; passed on, it
    # would replace them with the whole file.
    overrides = overrides + [o for o in args.overrides if (strategy == "sbon" or not o.startswith("strategy."))
                             and not o.startswith("data.prompts=")]
    start = time.perf_counter()
    report = run_job(name, job_argv(args.config, strategy, prompts, output, overrides), output)
    report["tokens_per_second"] = round(report["generated_tokens"] / report["run_seconds"], 1)
    report["overrides"] = overrides
    print(f"   {name}: run {report['run_seconds']:.2f}s, startup {report['startup_seconds']:.1f}s, "
          f"{report['generated_tokens']} tokens, {report['tokens_per_second']} tok/s "
          f"(wall {time.perf_counter() - start:.1f}s)", flush=True)
    return report


def vllm_tokens_per_second(model: str, rows: int, tokens: int, repeats: int) -> dict:
    """LLM.generate over ``rows`` rows of benchmarks.hf_throughput's chat prompts (the same rows
    HFEngine decodes there), ``tokens`` new tokens each (EOS ignored), on every core
    (pipeline.engines.vllm_engine.cpu_defaults); tokens/s per repeat after a warm-up call, and
    their median."""
    import statistics

    from vllm import SamplingParams as VLLMSamplingParams

    from benchmarks.hf_throughput import chat_prompts
    from pipeline.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine.from_pretrained(model, dtype="float32", max_model_len=1024)
    try:
        prompts = chat_prompts(engine.tokenizer, rows)
        requests = [{"prompt_token_ids": prompts[i // (rows // len(prompts))]} for i in range(rows)]
        params = [VLLMSamplingParams(max_tokens=tokens, temperature=1.0, ignore_eos=True, seed=i, detokenize=False)
                  for i in range(rows)]
        engine.llm.generate(requests[:8], sampling_params=params[:8], use_tqdm=False)  # warm-up
        rates = []
        for _ in range(repeats):
            start = time.perf_counter()
            outputs = engine.llm.generate(requests, sampling_params=params, use_tqdm=False)
            made = sum(len(o.outputs[0].token_ids) for o in outputs)
            rates.append(round(made / (time.perf_counter() - start), 1))
    finally:
        engine.shutdown()
    return {"tokens_per_s": rates, "median_tokens_per_s": round(statistics.median(rates), 1)}


def hf_in_its_venv(python: str, model: str, rows: int, tokens: int, repeats: int) -> dict:
    """benchmarks.hf_throughput in its own process, on ``python`` (the product's venv: the HF engine
    runs there, with the transformers our package resolves to; .venv-vllm pins an older one)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf.json"
        subprocess.run([python, "-m", "benchmarks.hf_throughput", "--generator", model, "--rows", str(rows),
                        "--max-new-tokens", str(tokens), "--repeats", str(repeats), "--json", str(out)], check=True)
        return {**json.loads(out.read_text()), "python": python}


def throughput(model: str, hf_python: str) -> dict:
    vllm = vllm_tokens_per_second(model, 128, 128, 3)
    hf = hf_in_its_venv(hf_python, model, 128, 128, 3)
    ratio = round(hf["median_tokens_per_s"] / vllm["median_tokens_per_s"], 3)
    print(f"\nraw decoding, 128 rows x 128 tokens (median of 3): vLLM {vllm['median_tokens_per_s']} tok/s "
          f"{vllm['tokens_per_s']}, HFEngine {hf['median_tokens_per_s']} tok/s {hf['tokens_per_s']} "
          f"({hf['python']}, transformers {hf['transformers']}): "
          f"HF / vLLM = {ratio} (target >= 0.9)")
    return {"vllm": vllm, "hf": hf, "hf_over_vllm": ratio}


def reward_seconds(report: dict) -> dict | None:
    """The reward actors' seconds inside their calls (``busy``) and in the model (``forward``),
    summed over the actors, from the run report's actor_time; None without it."""
    reward = (report.get("actor_time") or {}).get("reward")
    if reward is None:
        return None
    return {"busy": reward["busy_seconds"], "forward": reward["breakdown_seconds"]["forward"]}


def reward_backends(hf_report: dict, vllm_report: dict, hf_output: Path, vllm_output: Path) -> dict:
    """The same run with the reward model on HF and on vLLM: the reward actors' seconds, and how
    far the pairs agree (same chosen / rejected sample per prompt; largest chosen-score difference)."""
    hf, vllm = read_pairs(hf_output), read_pairs(vllm_output)
    common = sorted(set(hf) & set(vllm))
    figures = {
        "reward_seconds": {"hf": reward_seconds(hf_report), "vllm": reward_seconds(vllm_report)},
        "paired_prompts": {"hf": len(hf), "vllm": len(vllm), "both": len(common)},
        "same_chosen_sample": sum(hf[p]["chosen_sample"] == vllm[p]["chosen_sample"] for p in common),
        "same_rejected_sample": sum(hf[p]["rejected_sample"] == vllm[p]["rejected_sample"] for p in common),
        "max_chosen_score_difference": max((abs(hf[p]["chosen_score"] - vllm[p]["chosen_score"]) for p in common
                                            if hf[p]["chosen_sample"] == vllm[p]["chosen_sample"]), default=None),
    }
    print(f"reward on vLLM vs HF ({vllm_output.name}): reward actors' seconds {figures['reward_seconds']['vllm']} "
          f"vs {figures['reward_seconds']['hf']}; same chosen sample on {figures['same_chosen_sample']}/"
          f"{len(common)}, same rejected on {figures['same_rejected_sample']}/{len(common)}, largest chosen-score "
          f"difference {figures['max_chosen_score_difference']}")
    return figures


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import load_config

    args = parse_args(argv)
    config = load_config(args.config, args.overrides, strategy="sbon")
    from pipeline.engines.rewards import is_reward_function

    for path in (config.models.generator, *config.models.rewards):
        if not (path in config.models.rewards and is_reward_function(path)) and not Path(path).is_dir():
            fail(f"{path}: no model directory (make real-models)")
    rows = read_prompts(config.data.prompts, args.num_prompts)
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = write_prompts(rows, Path(tmp) / "prompts.jsonl")
        for name in args.runs:
            reports[name] = build(name, args, prompts, len(rows))

    params = config.strategy.params
    print(f"\n{len(rows)} prompts of {config.data.prompts}, N={config.sampling.num_samples}, "
          f"T={config.sampling.max_new_tokens}, tau={params.decision_token}, alpha={params.rejection_rate}, "
          f"seed {config.seed}; --set {' '.join(args.overrides) or '(none)'}")
    for name, report in reports.items():
        print(f"{name:<16} run {report['run_seconds']:8.2f}s  {report['generated_tokens']:8d} tokens  "
              f"{report['tokens_per_second']:7.1f} tok/s  (startup {report['startup_seconds']:.1f}s)")
    result = {"prompts": len(rows), "config": args.config, "overrides": args.overrides, "runs": reports, "ratios": {}}
    if BASELINE in reports:
        base = reports[BASELINE]
        for name, report in reports.items():
            if name != BASELINE:
                result["ratios"][f"{name}_speedup_over_{BASELINE}"] = round(base["run_seconds"] / report["run_seconds"], 3)
                result["ratios"][f"{name}_token_rate"] = round(report["generated_tokens"] / base["generated_tokens"], 3)
    if {"sbon_rounds", "sbon_continuous"} <= set(reports):
        result["ratios"]["continuous_over_rounds"] = round(
            reports["sbon_rounds"]["run_seconds"] / reports["sbon_continuous"]["run_seconds"], 3)
    for plain in ("sbon_continuous", "sbon_hf"):  # what speculative decoding of the finish adds
        if {plain, f"{plain}_spec"} <= set(reports):
            result["ratios"][f"{plain}_spec_over_{plain}"] = round(
                reports[plain]["run_seconds"] / reports[f"{plain}_spec"]["run_seconds"], 3)
    for name in [r for r in reports if r.endswith(VLLM_REWARD_SUFFIX)]:
        plain = name[:-len(VLLM_REWARD_SUFFIX)]
        if plain in reports:
            result["ratios"][f"{name}_over_{plain}"] = round(
                reports[plain]["run_seconds"] / reports[name]["run_seconds"], 3)
            result[f"{name}_vs_{plain}"] = reward_backends(reports[plain], reports[name], Path(args.output) / plain,
                                                           Path(args.output) / name)
    for key, value in result["ratios"].items():
        target = {"sbon_continuous_speedup_over_bon_vllm": "  (target >= 2.5)",
                  "sbon_rounds_speedup_over_bon_vllm": "  (target >= 2.5)",
                  "continuous_over_rounds": "  (target >= 1.2)"}.get(key, "")
        print(f"{key:<42} {value:.3f}{target}")

    if BASELINE in reports:
        bon = read_pairs(Path(args.output) / BASELINE)
        for name in [r for r in reports if r.startswith("sbon")]:
            if name not in reports:
                continue
            sbon = read_pairs(Path(args.output) / name)
            scores, common = quality(bon, sbon)
            result[f"{name}_quality"] = scores
            print(f"{name}: normalized score {scores['normalized_score']:.2f} over {scores['normalized_score_prompts']} "
                  f"prompts (target >= 98; min {scores['normalized_score_min']:.2f}); same chosen sample as Best-of-N "
                  f"on {scores['same_chosen_sample']}/{scores['paired_prompts']['both']}")
            if not args.no_judge:
                verdict = {"best_of_n": ifeval({p: bon[p] for p in common}),
                           "sbon": ifeval({p: sbon[p] for p in common})}
                result[f"{name}_ifeval"] = verdict
                print(f"   IFEval on the {len(common)} prompts both paired (prompt-level / instruction-level / pair "
                      f"accuracy): Best-of-N on vLLM "
                      f"{100 * verdict['best_of_n']['chosen']['prompt_level_strict']:.1f} / "
                      f"{100 * verdict['best_of_n']['chosen']['instruction_level_strict']:.1f} / "
                      f"{verdict['best_of_n']['pair_accuracy']}, {name} "
                      f"{100 * verdict['sbon']['chosen']['prompt_level_strict']:.1f} / "
                      f"{100 * verdict['sbon']['chosen']['instruction_level_strict']:.1f} / {verdict['sbon']['pair_accuracy']}")
    if args.throughput:
        result["throughput"] = throughput(config.models.generator, args.hf_python)
    write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
