"""The GPU engine benchmark (issue 38): a plain transformers script against best_of_n and sbon through
the build job, same prompts, N, T and seed, side by side in one run.

    python -m benchmarks.gpu_engine --shape smollm2-1.7b --device cuda --json out.json
    python -m benchmarks.gpu_engine --shape tiny --device cpu --num-prompts 4 --num-samples 2 --max-new-tokens 8

The three runs:

- ``plain``, the baseline: the script a user writes without this project. ``model.generate(do_sample=True,
  num_return_sequences=N, max_new_tokens=T)`` on --prompts-per-call left-padded prompts per call (the
  prompts' token ids are the build's own: its chat template and truncation), then the responses,
  decoded, in the reward model's chat template, one reward-model forward per --reward-batch-size
  responses;
- ``best_of_n`` and ``sbon`` through ``jobs.build_dataset`` in-process (``runtime.local=true``):
  configs/real.yaml with every setting that matters overridden (the random models, device, dtype, N,
  T, seed, temperature 1 with no top-k or top-p as in the baseline, runtime.prompts_per_batch,
  runtime.rows_in_flight, runtime.reward_batch_size = --reward-batch-size; sbon's tau and alpha), plus
  every --set.

Each run is a process of its own (the benchmark starts ``python -m benchmarks.gpu_engine --child``), so
that its peak memory is its own: peak device memory is ``torch.cuda.max_memory_allocated`` of that
process (reset before the models load, so weights, KV and activations of both models count; None on
CPU), peak RSS the kernel's high-water mark (VmHWM). With --repeats R the runs alternate R times and
the fastest of each, by run seconds, is kept.

Figures per run: ``seconds`` (run seconds: the baseline's generate and scoring, models loaded; a
build's run_seconds from its _report.json, first batch dispatched to last shard committed),
``wall_seconds`` (models loaded too; a build's own wall_seconds), ``process_seconds`` (the child
process, interpreter start included), generated tokens, ``tokens_per_second`` (generated tokens / run
seconds), ``ms_per_step`` (the baseline: generate seconds / decode steps, i.e. T per call; a build:
the generator's busy seconds / its forward passes, prefills included, from the report's actor_time) and
the peaks. The ratios against ``plain`` are printed: speed (plain's run seconds over the run's; sbon
generates fewer tokens, so this is the time to the same dataset), tokens/s, and memory.

The models are random weights of real shapes, built on the fly with transformers (LlamaConfig, then
LlamaForCausalLM and LlamaForSequenceClassification with one label), saved to a temporary directory
(--models-dir keeps them) so that the build job loads them by path like any checkpoint; nothing is
downloaded. --shape: ``smollm2-1.7b`` (SmolLM2-1.7B's shape; the reward model SmolLM2-360M's),
``llama3-8b`` (Llama-3-8B's; the reward model SmolLM2-1.7B's), ``tiny`` (the tiny test models' shape,
jobs.make_tiny_models, for CPU and CI). The tokenizer is SmolLM2's from .cache/real-models/generator
when it is there (``make real-models``), else the tiny models' (built when missing); the vocabulary is
the larger of the shape's and the tokenizer's. Prompts: the first --num-prompts rows of
configs/prompts/ifeval-eval.jsonl (the 64 held-out IFEval prompts of the issue's runs).

Sampling keeps EOS, as users do (ignoring it would measure a workload nobody runs); random weights
rarely sample it, so nearly every response runs to T tokens on every side, which is fine: the
generated-token counts are printed and the comparison stays fair.

The floor is an estimate, not a measurement: one decode step must read the generator's weights and
the live KV cache once, so at --bandwidth-gbs (default 3350, an H100 SXM's HBM3) a step takes at
least (weight bytes + rows x mean context x KV bytes per token) / bandwidth, with rows =
min(rows_in_flight, prompts x N) and the mean context = mean prompt tokens + (T + 1) / 2; its
tokens/s is rows / that time. The figure at the full context (prompt + T) is given too.

The run path needs neither ray nor datasets nor trl nor vllm (the GPU machines this runs on have none
of them; run from a checkout with PYTHONPATH=.): where installed, the build still imports ray (an
optional import); each run's ``heavy_imports`` lists which of them it imported.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import (bench_parser, fail, fastest, job_argv, model_dirs, parse, read_prompts, run_job, side_by_side,
                        write_json, write_prompts)

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ("plain", "best_of_n", "sbon")
REAL_TOKENIZER = Path(".cache/real-models/generator")
HEAVY_MODULES = ("ray", "datasets", "trl", "vllm")
"""Packages the GPU machines lack: a run records which of them it imported (there must be none)."""


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture model's dimensions."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    """The shape's own vocabulary; the built model's is max(this, the tokenizer's)."""
    tied: bool = False
    """Input embedding and output head share one matrix (SmolLM2's do)."""
    context: int = 8192
    """max_position_embeddings."""

    def kv_bytes_per_token(self, element_bytes: int) -> int:
        """K and V of one token in every layer."""
        return 2 * self.layers * self.kv_heads * (self.hidden // self.heads) * element_bytes


SMOLLM2_360M = Shape(layers=32, hidden=960, intermediate=2560, heads=15, kv_heads=5, vocab=49152, tied=True)
SMOLLM2_1_7B = Shape(layers=24, hidden=2048, intermediate=8192, heads=32, kv_heads=32, vocab=49152, tied=True)
LLAMA3_8B = Shape(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, vocab=128256)
TINY = Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=0, context=2048)
SHAPES = {"tiny": (TINY, TINY), "smollm2-1.7b": (SMOLLM2_1_7B, SMOLLM2_360M), "llama3-8b": (LLAMA3_8B, SMOLLM2_1_7B)}
"""--shape: (generator, reward model)."""
ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = bench_parser(
        "benchmarks.gpu_engine", __doc__, device="cpu",
        dtype=dict(help="torch dtype of both models, every run (default: bfloat16 on cuda, float32 on cpu)"),
        threads=None, prompts="configs/prompts/ifeval-eval.jsonl", num_prompts=64, num_samples=16,
        max_new_tokens=256, seed=0, repeats=1,
        set=dict(default=[], help="passed to both builds, e.g. --set models.hf.attn_implementation=eager"),
        output="out/bench/gpu-engine", json=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-1.7b",
                        help="the random models' shapes (module docstring)")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: .cache/real-models/generator when "
                                            "present, else the tiny models')")
    parser.add_argument("--models-dir", help="write the random models here and reuse them on the next run with "
                                             "the same shape, dtype and seed (default: a temporary directory)")
    parser.add_argument("--prompts-per-call", type=int, default=16, help="the baseline's prompts per generate call")
    parser.add_argument("--reward-batch-size", type=int, default=64,
                        help="responses per reward-model forward, the baseline's and the builds' "
                             "(runtime.reward_batch_size)")
    parser.add_argument("--rows-in-flight", type=int, default=256, help="runtime.rows_in_flight of the builds")
    parser.add_argument("--prompts-per-batch", type=int, default=16, help="runtime.prompts_per_batch of the builds")
    parser.add_argument("--decision-token", type=int,
                        help="sbon's tau (default: 64, or T // 4 when T < 256)")
    parser.add_argument("--rejection-rate", type=float, default=0.625, help="sbon's alpha")
    parser.add_argument("--attn-implementation",
                        help="attn_implementation of every run's models (the baseline's from_pretrained, the "
                             "builds' models.hf.attn_implementation; default: transformers')")
    parser.add_argument("--bandwidth-gbs", type=float, default=3350.0,
                        help="device memory bandwidth in GB/s for the floor estimate (3350: H100 SXM)")
    parser.add_argument("--child", nargs=2, metavar=("PLAN", "RUN"), help=argparse.SUPPRESS)
    args = parse(parser, argv)
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.num_prompts < 1 or args.prompts_per_call < 1:
        fail("--num-prompts, --num-samples, --max-new-tokens and --prompts-per-call must be >= 1")
    return args


# --- the runs, each in its own process ------------------------------------------------------------


def child(plan_path: str, run: str) -> int:
    """One run (``models``, ``plain``, ``best_of_n`` or ``sbon``) of the plan; its figures as JSON
    next to the plan, with this process's peaks and the heavy packages it imported."""
    import torch

    plan = json.loads(Path(plan_path).read_text())
    if plan["threads"]:
        torch.set_num_threads(plan["threads"])
    cuda = plan["device"].startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(plan["device"])
    figures = make_models(plan) if run == "models" else run_plain(plan) if run == "plain" else run_build(plan, run)
    figures["peak_memory_bytes"] = torch.cuda.max_memory_allocated(plan["device"]) if cuda else None
    figures["peak_rss_bytes"] = peak_rss_bytes()
    figures["heavy_imports"] = sorted(m for m in HEAVY_MODULES if m in sys.modules)
    Path(plan_path).with_name(f"{run}.json").write_text(json.dumps(figures, indent=1))
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set: VmHWM where /proc has it, else getrusage's max RSS."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def make_models(plan: dict) -> dict:
    """The random generator and reward model of the plan's shapes, each saved with the tokenizer;
    returns their parameter counts. Initialised on the run's device (an 8B model in seconds on a
    GPU), in the run's dtype."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, LlamaConfig

    from pipeline.engines.hf import load_tokenizer

    tokenizer = load_tokenizer(plan["tokenizer"])  # a missing pad token becomes EOS, as in the engines
    root = Path(plan["models_dir"])
    counts = {}
    for offset, (role, auto_cls) in enumerate((("generator", AutoModelForCausalLM),
                                               ("reward", AutoModelForSequenceClassification))):
        shape = Shape(**plan["shapes"][role])
        config = LlamaConfig(
            vocab_size=max(shape.vocab, len(tokenizer)), hidden_size=shape.hidden, intermediate_size=shape.intermediate,
            num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            max_position_embeddings=shape.context, tie_word_embeddings=shape.tied, bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
            **({"num_labels": 1} if role == "reward" else {}))
        torch.manual_seed(plan["seed"] * 1000 + offset)
        with torch.device(plan["device"]):
            model = auto_cls.from_config(config, dtype=getattr(torch, plan["dtype"])).eval()
        counts[role] = sum(p.numel() for p in model.parameters())
        model.save_pretrained(root / role)
        tokenizer.save_pretrained(root / role)
        del model
    return {"parameters": counts}


def run_plain(plan: dict) -> dict:
    """The baseline: transformers' generate, then the reward model, as a user writes it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from pipeline.engines.hf import load_tokenizer
    from pipeline.engines.model_runner import eos_token_ids

    device, dtype, models = plan["device"], getattr(torch, plan["dtype"]), plan["models"]
    load = {"attn_implementation": plan["attn_implementation"]} if plan["attn_implementation"] else {}
    n, t = plan["num_samples"], plan["max_new_tokens"]
    wall = time.perf_counter()
    tokenizer = load_tokenizer(models["generator"])
    model = AutoModelForCausalLM.from_pretrained(models["generator"], dtype=dtype, **load).to(device).eval()
    reward = AutoModelForSequenceClassification.from_pretrained(models["reward"], dtype=dtype, **load).to(device).eval()
    eos = sorted(eos_token_ids(model, tokenizer))
    pad = tokenizer.pad_token_id
    torch.manual_seed(plan["seed"])
    generate_seconds, steps, generated, scored = 0.0, 0, 0, 0
    sync(device)
    start = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(plan["prompt_token_ids"]), plan["prompts_per_call"]):
            prompts = plan["prompt_token_ids"][first:first + plan["prompts_per_call"]]
            texts = plan["prompt_texts"][first:first + plan["prompts_per_call"]]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)  # [P, L], left-padded
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)  # [P, L]
            called = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=t, num_return_sequences=n, pad_token_id=pad,
                                 eos_token_id=eos)  # [P * N, L + steps]
            sync(device)
            generate_seconds += time.perf_counter() - called
            new = out[:, width:]  # [P * N, steps]
            steps += new.shape[1]
            ended = torch.isin(new, torch.tensor(eos, device=device))  # [P * N, steps]
            lengths = torch.where(ended.any(1), ended.int().argmax(1) + 1, new.shape[1]).tolist()  # EOS counted
            generated += sum(lengths)
            responses = tokenizer.batch_decode([row[:length] for row, length in zip(new.tolist(), lengths)],
                                               skip_special_tokens=True)
            prompt_of = [texts[row // n] for row in range(len(responses))]  # generate repeats each prompt N times
            for b in range(0, len(responses), plan["reward_batch_size"]):
                scored += len(score(reward, tokenizer, prompt_of[b:b + plan["reward_batch_size"]],
                                    responses[b:b + plan["reward_batch_size"]], device))
    sync(device)
    seconds = time.perf_counter() - start
    if scored != len(plan["prompt_token_ids"]) * n:
        raise SystemExit(f"error: the baseline scored {scored} responses, not {len(plan['prompt_token_ids']) * n}")
    return {"seconds": seconds, "wall_seconds": time.perf_counter() - wall, "generate_seconds": generate_seconds,
            "generated_tokens": generated, "tokens_per_second": generated / seconds,
            "decode_steps": steps, "ms_per_step": 1000 * generate_seconds / steps, "responses": scored}


def score(reward, tokenizer, prompts: list[str], responses: list[str], device: str) -> list[float]:
    """One reward-model forward over (prompt, response) pairs in the chat template (text joined
    without one), padded."""
    if tokenizer.chat_template:
        chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in zip(prompts, responses)]
        batch = tokenizer.apply_chat_template(chats, tokenize=True, padding=True, return_tensors="pt", return_dict=True)
    else:
        batch = tokenizer([p + r for p, r in zip(prompts, responses)], padding=True, return_tensors="pt")
    return reward(**batch.to(device)).logits[:, 0].float().tolist()  # [B]


def run_build(plan: dict, strategy: str) -> dict:
    """One build through the build job, in-process; its report's figures."""
    output = Path(plan["output"]) / strategy
    overrides = [f"models.generator={plan['models']['generator']}", f"models.reward={plan['models']['reward']}",
                 "models.reward_weights=null", f"models.device={plan['device']}", f"models.dtype={plan['dtype']}",
                 f"sampling.num_samples={plan['num_samples']}", f"sampling.max_new_tokens={plan['max_new_tokens']}",
                 "sampling.temperature=1.0", "sampling.top_k=0", "sampling.top_p=1.0", f"seed={plan['seed']}",
                 "runtime.local=true", f"runtime.prompts_per_batch={plan['prompts_per_batch']}",
                 f"runtime.rows_in_flight={plan['rows_in_flight']}",
                 f"runtime.reward_batch_size={plan['reward_batch_size']}"]
    if plan["attn_implementation"]:
        overrides.append(f"models.hf.attn_implementation={plan['attn_implementation']}")
    if strategy == "sbon":
        overrides += [f"strategy.decision_token={plan['decision_token']}",
                      f"strategy.rejection_rate={plan['rejection_rate']}"]
    report = run_job(strategy, job_argv(plan["config"], strategy, plan["prompts_file"], output,
                                        overrides + plan["overrides"]), output)
    generator = (report.get("actor_time") or {}).get("generator") or {}
    passes = generator.get("forward_passes") or 0
    forward = (generator.get("breakdown_seconds") or {}).get("forward")
    return {"seconds": report["run_seconds"], "wall_seconds": report["wall_seconds"],
            "startup_seconds": report["startup_seconds"], "generated_tokens": report["generated_tokens"],
            "tokens_per_second": report["generated_tokens"] / report["run_seconds"],
            "forward_passes": passes,
            "ms_per_step": 1000 * generator["busy_seconds"] / passes if passes else None,
            "forward_ms_per_step": 1000 * forward / passes if passes and forward is not None else None,
            "pairs": report["pairs"], "report": report}


# --- the parent: plan, runs, figures ---------------------------------------------------------------


def spawn(plan_path: Path, run: str) -> dict:
    """``run`` in a fresh process (python -m benchmarks.gpu_engine --child); its figures."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_engine", "--child", str(plan_path), run], env=env)
    if done.returncode != 0:
        raise SystemExit(f"error: the {run} run failed (exit code {done.returncode})")
    return json.loads(plan_path.with_name(f"{run}.json").read_text())


def models_ready(root: Path, key: dict) -> dict | None:
    """The parameter counts of the models in ``root`` if they were built for ``key``, else None."""
    try:
        meta = json.loads((root / "bench-models.json").read_text())
    except (OSError, ValueError):
        return None
    return meta["parameters"] if meta.get("key") == key else None


def prepare_prompts(rows: list[dict], generator: str, context: int, max_new_tokens: int) -> tuple[list, list]:
    """(token ids, user texts) of the prompts the build keeps, formatted as the build formats them
    (chat template, truncation to the context less T), so the baseline reads the same tokens."""
    from pipeline.data.chat import PromptFormatter
    from pipeline.data.prompts import validate
    from pipeline.engines.hf import load_tokenizer

    formatter = PromptFormatter(load_tokenizer(generator), context - max_new_tokens)
    kept, _ = validate([row["prompt"] for row in rows], "prompt")
    prompts = [formatter.prepare(row)[0] for row in kept]
    return [p.token_ids for p in prompts], [p.raw_prompt for p in prompts]


def bandwidth_floor(shape: Shape, parameters: int, element_bytes: int, rows: int, prompt_tokens: float,
                    max_new_tokens: int, bandwidth_gbs: float) -> dict:
    """The memory-bandwidth floor of one decode step (module docstring): an estimate."""
    kv_token = shape.kv_bytes_per_token(element_bytes)
    weights = parameters * element_bytes

    def at(context: float) -> dict:
        step = (weights + rows * context * kv_token) / (bandwidth_gbs * 1e9)
        return {"context_tokens": round(context, 1), "step_ms": float(f"{1000 * step:.4g}"),
                "tokens_per_second": float(f"{rows / step:.4g}")}

    mean, full = at(prompt_tokens + (max_new_tokens + 1) / 2), at(prompt_tokens + max_new_tokens)
    return {"estimate": True, "bandwidth_gbs": bandwidth_gbs, "weights_bytes": weights, "kv_bytes_per_token": kv_token,
            "rows": rows, "prompt_tokens_mean": round(prompt_tokens, 1), **mean, "at_full_context": full}


def size(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / 2**30:.2f} GiB" if value >= 2**30 else f"{value / 2**20:.1f} MiB"


def print_figures(best: dict, floor: dict, ratios: dict, device: str) -> None:
    print(f"\n{'run':<10}{'wall s':>9}{'run s':>9}{'tokens':>9}{'tokens/s':>11}{'ms/step':>9}"
          f"{'peak device':>14}{'peak RSS':>12}")
    for name, r in best.items():
        step = "-" if r["ms_per_step"] is None else f"{r['ms_per_step']:.2f}"
        print(f"{name:<10}{r['wall_seconds']:>9.2f}{r['seconds']:>9.2f}{r['generated_tokens']:>9}"
              f"{r['tokens_per_second']:>11.1f}{step:>9}{size(r['peak_memory_bytes']):>14}{size(r['peak_rss_bytes']):>12}")
    print(f"floor (ESTIMATE, not measured: generator weights {size(floor['weights_bytes'])} + {floor['rows']} rows x "
          f"{floor['context_tokens']} mean context x {floor['kv_bytes_per_token'] / 1024:.1f} KiB of KV, read once "
          f"per step at {floor['bandwidth_gbs']:.0f} GB/s): {floor['step_ms']:.2f} ms/step, "
          f"{floor['tokens_per_second']:.0f} tokens/s (at the full context {floor['at_full_context']['step_ms']:.2f} "
          f"ms/step, {floor['at_full_context']['tokens_per_second']:.0f} tokens/s)")
    print("\nvs plain, measured side by side (above 1: faster; memory: the run's peak over plain's)")
    print(f"{'run':<10}{'speed':>8}{'tokens/s':>10}{'device mem':>12}{'RSS':>7}{'step / floor':>14}")
    for name, r in ratios.items():
        device_ratio = "-" if r["device_memory"] is None else f"{r['device_memory']:.2f}"
        step = "-" if r["step_vs_floor"] is None else f"{r['step_vs_floor']:.1f}"
        print(f"{name:<10}{r['speed']:>8.2f}{r['tokens_per_second']:>10.2f}{device_ratio:>12}{r['rss']:>7.2f}{step:>14}")
    if not device.startswith("cuda"):
        print("(device memory: CPU run, none; the floor's bandwidth is a GPU's, so step / floor means little here)")


def ratios_to_plain(best: dict, floor: dict) -> dict:
    plain = best["plain"]
    out = {}
    for name, r in best.items():
        device = (r["peak_memory_bytes"] / plain["peak_memory_bytes"]
                  if r["peak_memory_bytes"] and plain["peak_memory_bytes"] else None)
        out[name] = {"speed": round(plain["seconds"] / r["seconds"], 3),
                     "tokens_per_second": round(r["tokens_per_second"] / plain["tokens_per_second"], 3),
                     "device_memory": None if device is None else round(device, 3),
                     "rss": round(r["peak_rss_bytes"] / plain["peak_rss_bytes"], 3),
                     "step_vs_floor": None if r["ms_per_step"] is None else round(r["ms_per_step"] / floor["step_ms"], 2)}
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        return child(*args.child)
    generator_shape, reward_shape = SHAPES[args.shape]
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    if dtype not in ELEMENT_BYTES:
        fail(f"--dtype {dtype}: name one of {', '.join(ELEMENT_BYTES)}")
    tokenizer = args.tokenizer or (str(REAL_TOKENIZER) if (REAL_TOKENIZER / "tokenizer_config.json").exists()
                                   else model_dirs("tiny", ("generator",))["generator"])
    rows = read_prompts(args.prompts, args.num_prompts)
    tau = args.decision_token or (64 if args.max_new_tokens >= 256 else max(1, args.max_new_tokens // 4))

    with tempfile.TemporaryDirectory(prefix="gpu-engine-") as tmp:
        work = Path(tmp)
        models_dir = Path(args.models_dir or work / "models").resolve()
        plan = {"device": args.device, "dtype": dtype, "threads": args.threads, "seed": args.seed,
                "tokenizer": str(Path(tokenizer).resolve()), "models_dir": str(models_dir),
                "shapes": {"generator": asdict(generator_shape), "reward": asdict(reward_shape)},
                "models": {role: str(models_dir / role) for role in ("generator", "reward")},
                "num_samples": args.num_samples, "max_new_tokens": args.max_new_tokens,
                "prompts_per_call": args.prompts_per_call, "reward_batch_size": args.reward_batch_size,
                "prompts_per_batch": args.prompts_per_batch, "rows_in_flight": args.rows_in_flight,
                "decision_token": tau, "rejection_rate": args.rejection_rate,
                "attn_implementation": args.attn_implementation, "config": str(REPO / "configs/real.yaml"),
                "prompts_file": str(write_prompts(rows, work / "prompts.jsonl")),
                "output": str(Path(args.output).resolve()), "overrides": args.overrides}
        plan_path = work / "plan.json"
        key = {k: plan[k] for k in ("shapes", "dtype", "seed", "tokenizer")}
        parameters = models_ready(models_dir, key)
        if parameters is None:
            plan_path.write_text(json.dumps(plan))
            print(f"== building the random {args.shape} models in {models_dir}", flush=True)
            # On a GPU in a process of its own (fast initialisation there, and this one stays off the device).
            built = spawn(plan_path, "models") if args.device.startswith("cuda") else make_models(plan)
            parameters = built["parameters"]
            (models_dir / "bench-models.json").write_text(json.dumps({"key": key, "parameters": parameters}))
        plan["prompt_token_ids"], plan["prompt_texts"] = prepare_prompts(
            rows, plan["models"]["generator"], generator_shape.context, args.max_new_tokens)
        plan_path.write_text(json.dumps(plan))
        runs = side_by_side({name: (lambda name=name: spawn(plan_path, name)) for name in VARIANTS}, args.repeats)

    best = {name: {**run.value, "process_seconds": run.seconds}
            for name, run in fastest(runs, lambda run: run.value["seconds"]).items()}
    prompt_tokens = sum(map(len, plan["prompt_token_ids"])) / len(plan["prompt_token_ids"])
    floor = bandwidth_floor(generator_shape, parameters["generator"], ELEMENT_BYTES[dtype],
                            min(args.rows_in_flight or 10**9, len(plan["prompt_token_ids"]) * args.num_samples),
                            prompt_tokens, args.max_new_tokens, args.bandwidth_gbs)
    ratios = ratios_to_plain(best, floor)

    print(f"\n{len(plan['prompt_token_ids'])} prompts of {args.prompts}, N={args.num_samples}, T={args.max_new_tokens}, "
          f"seed {args.seed}, shape {args.shape} ({parameters['generator'] / 1e9:.3f}B generator, "
          f"{parameters['reward'] / 1e9:.3f}B reward, {dtype}), device {args.device}; plain: "
          f"{args.prompts_per_call} prompts per generate call; builds: rows_in_flight {args.rows_in_flight}, "
          f"prompts_per_batch {args.prompts_per_batch}, sbon tau {tau} alpha {args.rejection_rate}"
          + (f", --set {' '.join(args.overrides)}" if args.overrides else "") + f" (fastest of {args.repeats})")
    print_figures(best, floor, ratios, args.device)
    settings = {k: v for k, v in plan.items() if k not in ("prompt_token_ids", "prompt_texts", "prompts_file")}
    write_json(args.json, {**{name: {k: v for k, v in best[name].items() if k != "report"} for name in VARIANTS},
                           "floor": floor, "ratios_to_plain": ratios, "settings": {**settings, "shape": args.shape,
                                                                                   "prompts": args.prompts,
                                                                                   "num_prompts": len(rows)},
                           "parameters": parameters, "reports": {n: best[n].get("report") for n in VARIANTS[1:]},
                           "all_runs": {n: [{k: v for k, v in run.value.items() if k != "report"} for run in each]
                                        for n, each in runs.items()}}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
