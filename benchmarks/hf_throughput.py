"""HFEngine decoding throughput: generated tokens per second of one sampling session on CPU.

    python -m benchmarks.hf_throughput --generator DIR [--rows 128] [--max-new-tokens 128] [--repeats 3] [--threads 2]
    python -m benchmarks.hf_throughput --generator DIR --compare-prepack [--repeats 3]
    python -m benchmarks.hf_throughput --generator DIR --compare-attention [--paths sdpa,sdpa+gather] [--device cuda --dtype bfloat16]
    python -m benchmarks.hf_throughput --generator DIR --compare-dtype [--repeats 3]
    python -m benchmarks.hf_throughput --generator DIR --reward DIR --contend-reward [--repeats 2]

Each repeat opens one session of --rows rows (a fixed set of chat prompts, chat template applied,
sampled --rows / prompts times each), extends it to exactly --max-new-tokens tokens per row (temperature
1, no top-k/top-p, EOS ignored so every row has the same length) and closes it; tokens/s counts the
generated tokens over the wall clock of open + extend + close, prefill included. A short warm-up
session (8 tokens) runs first. Prints tokens/s per repeat and their median (issue 14 item 6: >= 0.9x vLLM's
CPU backend on the same shape). ``hf_tokens_per_second`` is the same measurement for another
benchmark to call.

``--compare-prepack``: the same measurement on two engines in one process, models.cpu_prepack on
(pipeline.engines.hf.PackedLinear) and off, their repeats alternating, and the cost of one forward
pass that feeds 1, 2, 4 or 8 tokens to one row after its prompt (what a verification pass of
speculative or tree decoding costs: --pass-repeats passes each, median); prints each with the ratio
off / on.

``--compare-attention``: the same measurement under each attention path (ATTENTION: sdpa as
PyTorch dispatches it, eager, and sdpa with its kernel pinned to math, flash, efficient or cuDNN),
one engine per implementation in one process, repeats alternating; a kernel the device lacks is
reported, not measured. The paths change the prefills; every decoding step reads the KV cache's
blocks with its own kernel, and ``sdpa+gather`` measures the other decode kernel (each row's blocks
gathered, then SDPA: the fallback, ``BON_KV_KERNEL=gather``) against the default (compiled
flex_attention over the blocks in place). This is how the defaults were chosen (docs/benchmarks.md,
"Attention").

``--compare-dtype``: the same measurement in float32 (prepacked, the engine's CPU default) and in
bfloat16, one engine each in one process, repeats alternating: what ``jobs.fetch_models
--sampling-dtype`` trades when the reward model's training samples are drawn.

``--contend-reward``: the same measurement for each decode kernel (flex_attention over the blocks,
and ``sdpa+gather``), alone and while the reward model (--reward) scores in another thread of the
same process without pause, as in an in-process build (runtime.local), where the generator and the
reward model share the machine's cores; repeats alternate. Prints each kernel's tokens/s alone and
contended, the slowdown, and the reward passes the other thread finished per second of decoding.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
import transformers
from transformers import DynamicCache

from benchmarks import bench_parser, model_dirs, parse, write_json
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import HFEngine
from pipeline.engines.kv_cache import KERNEL_ENV
from pipeline.engines.rewards import RewardScorer
from pipeline.engines.tree import cache_argument
from pipeline.engines.vllm_engine import _environment

PROMPTS = [
    "Write a short birthday message for a coworker.",
    "Why is exercise important?",
    "What is the difference between a virus and a bacterium?",
    "Give me some advice on how to get better at public speaking.",
    "Explain why the sky is blue in simple terms.",
    "List three tips for learning a new language.",
    "Write a short poem about a busy city.",
    "How do I make a cup of green tea?",
]


def chat_prompts(tokenizer, rows: int) -> list[list[int]]:
    """The first prompts of PROMPTS, as many as divide ``rows`` evenly, through the chat template."""
    count = math.gcd(rows, len(PROMPTS))
    return [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
            for p in PROMPTS[:count]]


def run_session(engine: HFEngine, prompts: list[list[int]], rows: int, tokens: int) -> int:
    """One session: open ``rows`` rows, extend them to ``tokens`` tokens, close; tokens generated."""
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True)
    engine.open("throughput", prompts, rows // len(prompts), list(range(rows)), sampling)
    try:
        engine.extend("throughput", until=tokens)
    finally:
        stats = engine.close("throughput")
    return stats["generated_tokens"]


def _rate(engine: HFEngine, prompts: list[list[int]], rows: int, tokens: int) -> float:
    start = time.perf_counter()
    generated = run_session(engine, prompts, rows, tokens)
    return generated / (time.perf_counter() - start)


def _summary(rates: list[float]) -> dict:
    return {"tokens_per_s": [round(r, 1) for r in rates], "median_tokens_per_s": round(statistics.median(rates), 1)}


def alternating_rates(engines: dict[str, HFEngine], prompts: list[list[int]], rows: int, tokens: int,
                      repeats: int) -> dict[str, list[float]]:
    """Tokens/s of each engine over ``repeats`` sessions, the engines taking turns (after one short
    warm-up session each), so that a drift of the machine's speed falls on all of them alike."""
    for engine in engines.values():
        run_session(engine, prompts, rows, min(tokens, 8))  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(repeats):
        for name, engine in engines.items():
            rates[name].append(_rate(engine, prompts, rows, tokens))
    return rates


def hf_tokens_per_second(model_dir: str, rows: int = 128, tokens: int = 128, repeats: int = 3,
                         threads: int = 2, prepack: bool = True) -> dict:
    """HFEngine's decoding throughput on ``model_dir`` (float32, CPU, ``threads`` threads,
    models.cpu_prepack = ``prepack``): one warm-up session, then ``repeats`` timed ones; tokens/s of
    each and their median."""
    torch.set_num_threads(threads)
    engine = HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32", prepack=prepack)
    prompts = chat_prompts(engine.tokenizer, rows)
    run_session(engine, prompts, rows, min(tokens, 8))  # warm-up
    rates = [_rate(engine, prompts, rows, tokens) for _ in range(repeats)]
    return {"model": model_dir, "transformers": transformers.__version__, "rows": rows, "tokens": tokens,
            "threads": threads, "prepack": prepack, **_summary(rates)}


@torch.inference_mode()
def pass_seconds(engine: HFEngine, prompt: list[int], fed: int, repeats: int) -> float:
    """Median seconds of one forward pass feeding ``fed`` tokens to one row whose prompt is cached
    (the cache is cut back after each pass)."""
    cache = DynamicCache(config=engine.model.config)
    cached = cache_argument(engine.model, cache)  # outside the timed passes
    engine.model(torch.tensor([prompt]), use_cache=True, **cached)
    ids = torch.tensor([prompt[-fed:]])
    positions = torch.arange(len(prompt), len(prompt) + fed)[None]
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        engine.model(ids, use_cache=True, position_ids=positions, **cached)
        times.append(time.perf_counter() - start)
        cache.crop(-fed)
    return statistics.median(times[1:])


def compare_prepack(model_dir: str, rows: int, tokens: int, repeats: int, threads: int,
                    pass_repeats: int = 20) -> dict:
    """Both settings of models.cpu_prepack in one process, repeats alternating (see the module docstring)."""
    torch.set_num_threads(threads)
    engines = {name: HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32", prepack=name == "prepack")
               for name in ("prepack", "default")}
    prompts = chat_prompts(engines["prepack"].tokenizer, rows)
    rates = alternating_rates(engines, prompts, rows, tokens, repeats)
    passes = {name: {fed: pass_seconds(engine, prompts[0], fed, pass_repeats) for fed in (1, 2, 4, 8)}
              for name, engine in engines.items()}
    result = {"model": model_dir, "transformers": transformers.__version__, "torch": torch.__version__,
              "rows": rows, "tokens": tokens, "threads": threads}
    for name in engines:
        result[name] = {**_summary(rates[name]),
                        "pass_ms_by_tokens_fed": {fed: round(s * 1000, 1) for fed, s in passes[name].items()}}
    result["throughput_ratio_prepack_over_default"] = round(
        statistics.median(rates["prepack"]) / statistics.median(rates["default"]), 3)
    result["pass_cost_ratio_default_over_prepack"] = {
        fed: round(passes["default"][fed] / passes["prepack"][fed], 2) for fed in (1, 2, 4, 8)}
    return result


def compare_dtype(model_dir: str, rows: int, tokens: int, repeats: int, threads: int,
                  dtypes: tuple[str, ...] = ("float32", "bfloat16")) -> dict:
    """The engine's decoding throughput in each of ``dtypes`` on CPU, in one process, repeats
    alternating; ratios to the first."""
    torch.set_num_threads(threads)
    engines = {dtype: HFEngine.from_pretrained(model_dir, device="cpu", dtype=dtype) for dtype in dtypes}
    rates = alternating_rates(engines, chat_prompts(engines[dtypes[0]].tokenizer, rows), rows, tokens, repeats)
    return {"model": model_dir, "transformers": transformers.__version__, "torch": torch.__version__, "rows": rows,
            "tokens": tokens, "threads": threads, **{dtype: _summary(rates[dtype]) for dtype in dtypes},
            f"throughput_ratio_over_{dtypes[0]}": {
                dtype: round(statistics.median(rates[dtype]) / statistics.median(rates[dtypes[0]]), 3)
                for dtype in dtypes}}


ATTENTION = ("sdpa", "sdpa+gather", "eager", "sdpa:math", "sdpa:flash", "sdpa:efficient", "sdpa:cudnn")
"""The attention paths ``--compare-attention`` measures: transformers' sdpa with PyTorch's own
choice of kernel, the same with the decode steps gathering the blocks (``+gather``), eager, and
sdpa with its kernel pinned (``torch.nn.attention.sdpa_kernel``); a kernel this device or these
shapes lack is reported as an error, not measured."""


def decode_kernel(gather: bool):
    """The KV cache's decode kernel inside the block: the blocks gathered for SDPA (``gather``), or
    the default (compiled flex_attention in place); pipeline.engines.kv_cache reads KERNEL_ENV at
    every layer's call, and the caller's setting is back after the block."""
    return _environment({KERNEL_ENV: "gather" if gather else ""})


def compare_attention(model_dir: str, rows: int, tokens: int, repeats: int, threads: int,
                      device: str = "cpu", dtype: str = "float32", paths: tuple[str, ...] = ATTENTION) -> dict:
    """The engine's decoding throughput under each attention path, in one process, repeats
    alternating. Since the paged KV cache (pipeline.engines.kv_cache) every decoding step reads its
    blocks with its own kernel whatever the model's implementation, so the paths differ in the
    prefills, except ``+gather``, the other decode kernel; benchmarks.paged_attention compares the
    decode kernels alone, one layer's call."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.set_num_threads(threads)
    engines = {name: HFEngine.from_pretrained(model_dir, device=device, dtype=dtype,
                                              load={"attn_implementation": name})
               for name in sorted({p.split(":")[0].split("+")[0] for p in paths})}
    prompts = chat_prompts(next(iter(engines.values())).tokenizer, rows)
    result = {"model": model_dir, "transformers": transformers.__version__, "torch": torch.__version__,
              "device": device, "dtype": dtype, "rows": rows, "tokens": tokens, "threads": threads}
    rates: dict[str, list[float]] = {}
    errors: dict[str, str] = {}

    def rate(path: str, length: int = tokens) -> float:
        path, gather, _ = path.partition("+gather")
        base, _, kernel = path.partition(":")
        engine = engines[base]
        if not kernel:
            with decode_kernel(bool(gather)):
                return _rate(engine, prompts, rows, length)
        with decode_kernel(False), sdpa_kernel([getattr(SDPBackend, {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                                               "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[kernel])]):
            return _rate(engine, prompts, rows, length)

    for path in paths:  # warm-up, and which paths run here at all
        try:
            rate(path, min(tokens, 8))
            rates[path] = []
        except (RuntimeError, AttributeError) as exc:
            errors[path] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    for _ in range(repeats):
        for path in rates:
            rates[path].append(rate(path))
    for path in paths:
        result[path] = _summary(rates[path]) if path in rates else {"error": errors[path]}
    return result


CONTEND_RESPONSE = " ".join(PROMPTS) * 3
"""What the reward thread scores: about 230 tokens of the real reward model's tokenizer per response."""


def contend_reward(model_dir: str, reward_dir: str, rows: int, tokens: int, repeats: int, threads: int,
                   batch: int = 32) -> dict:
    """Each decode kernel's throughput alone and beside a reward model scoring ``batch`` responses a
    call, without pause, in another thread of this process; the four runs alternate per repeat."""
    import threading

    torch.set_num_threads(threads)
    engine = HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32")
    scorer = RewardScorer.from_pretrained(reward_dir, device="cpu", dtype="float32", batch_size=batch)
    prompts = chat_prompts(engine.tokenizer, rows)
    texts = ([PROMPTS[0]] * batch, [CONTEND_RESPONSE] * batch)
    result = {"model": model_dir, "reward": reward_dir, "transformers": transformers.__version__,
              "torch": torch.__version__, "rows": rows, "tokens": tokens, "threads": threads, "reward_batch": batch}
    runs = {(kernel, mode): [] for kernel in ("flex", "sdpa+gather") for mode in ("alone", "contended")}
    passes = {kernel: [] for kernel in ("flex", "sdpa+gather")}
    for kernel in passes:  # warm-up
        with decode_kernel(kernel != "flex"):
            run_session(engine, prompts, rows, min(tokens, 8))
    scorer.score(*texts)
    for _ in range(repeats):
        for (kernel, mode), rates in runs.items():
            stop, done = threading.Event(), [0]

            def score():
                while not stop.is_set():
                    scorer.score(*texts)
                    done[0] += 1

            other = threading.Thread(target=score, daemon=True) if mode == "contended" else None
            if other:
                other.start()
            try:
                with decode_kernel(kernel != "flex"):
                    start = time.perf_counter()
                    generated = run_session(engine, prompts, rows, tokens)
                    seconds = time.perf_counter() - start
            finally:
                stop.set()
                if other:
                    other.join()
            rates.append(generated / seconds)
            if other:
                passes[kernel].append(done[0] / seconds)
    for kernel in passes:
        alone, contended = (statistics.median(runs[kernel, m]) for m in ("alone", "contended"))
        result[kernel] = {"alone": _summary(runs[kernel, "alone"]), "contended": _summary(runs[kernel, "contended"]),
                          "slowdown": round(alone / contended, 2),
                          "reward_calls_per_s": round(statistics.median(passes[kernel]), 3)}
    return result


def main(argv=None) -> int:
    parser = bench_parser("benchmarks.hf_throughput", __doc__, models="tiny", generator=None, reward=None,
                          max_new_tokens=128,
                          repeats=3, threads=2, json=None)
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--no-prepack", action="store_true", help="models.cpu_prepack off")
    parser.add_argument("--compare-prepack", action="store_true",
                        help="cpu_prepack on and off side by side, and the cost of 1-8 token passes")
    parser.add_argument("--pass-repeats", type=int, default=20)
    parser.add_argument("--compare-attention", action="store_true",
                        help="the engine's throughput under eager, sdpa and sdpa with each kernel pinned")
    parser.add_argument("--compare-dtype", action="store_true",
                        help="float32 (prepacked) and bfloat16 on CPU side by side")
    parser.add_argument("--contend-reward", action="store_true",
                        help="each decode kernel alone and beside the reward model (--reward) scoring in another thread")
    parser.add_argument("--paths", default=",".join(ATTENTION),
                        help="--compare-attention's paths, comma-separated (default: all of them)")
    parser.add_argument("--device", default="cpu", help="--compare-attention's device (cpu, cuda)")
    parser.add_argument("--dtype", default="float32", help="--compare-attention's dtype")
    args = parse(parser, argv)
    model = model_dirs(args.models, ("generator",), generator=args.generator)["generator"]
    if args.contend_reward:
        reward = model_dirs(args.models, ("reward",), reward=args.reward)["reward"]
        result = contend_reward(model, reward, args.rows, args.max_new_tokens, args.repeats, args.threads)
        for kernel in ("flex", "sdpa+gather"):
            r = result[kernel]
            print(f"{kernel:12s} alone {r['alone']['median_tokens_per_s']:.1f} tokens/s {r['alone']['tokens_per_s']}, "
                  f"contended {r['contended']['median_tokens_per_s']:.1f} {r['contended']['tokens_per_s']}: "
                  f"{r['slowdown']:.2f}x slower; reward calls {r['reward_calls_per_s']:.3f}/s")
    elif args.compare_attention:
        paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
        unknown = sorted(set(paths) - set(ATTENTION))
        if unknown:
            parser.error(f"--paths: unknown {', '.join(unknown)} (known: {', '.join(ATTENTION)})")
        result = compare_attention(model, args.rows, args.max_new_tokens, args.repeats, args.threads,
                                   args.device, args.dtype, paths)
        best = max((p for p in paths if "median_tokens_per_s" in result[p]),
                   key=lambda p: result[p]["median_tokens_per_s"])
        for path in paths:
            r = result[path]
            line = (f"{r['median_tokens_per_s']:.1f} tokens/s {r['tokens_per_s']}, "
                    f"{r['median_tokens_per_s'] / result[best]['median_tokens_per_s']:.2f}x the fastest"
                    if "error" not in r else f"not run: {r['error']}")
            print(f"{path:15s} {line}")
    elif args.compare_dtype:
        result = compare_dtype(model, args.rows, args.max_new_tokens, args.repeats, args.threads)
        for dtype, ratio in result["throughput_ratio_over_float32"].items():
            print(f"{dtype:9s} {result[dtype]['median_tokens_per_s']:.1f} tokens/s {result[dtype]['tokens_per_s']}, "
                  f"{ratio:.2f}x float32")
    elif args.compare_prepack:
        result = compare_prepack(model, args.rows, args.max_new_tokens, args.repeats, args.threads, args.pass_repeats)
        for name in ("prepack", "default"):
            r = result[name]
            passes = ", ".join(f"{fed} tok {ms} ms" for fed, ms in r["pass_ms_by_tokens_fed"].items())
            print(f"{name:8s} {r['median_tokens_per_s']:.1f} tokens/s {r['tokens_per_s']}; one-row pass: {passes}")
        print(f"throughput prepack / default: {result['throughput_ratio_prepack_over_default']}x; "
              f"one-row pass cost default / prepack by tokens fed: {result['pass_cost_ratio_default_over_prepack']}")
    else:
        result = hf_tokens_per_second(model, args.rows, args.max_new_tokens, args.repeats, args.threads,
                                      prepack=not args.no_prepack)
        for i, rate in enumerate(result["tokens_per_s"]):
            print(f"repeat {i}: {rate:.1f} tokens/s")
        print(f"median: {result['median_tokens_per_s']:.1f} tokens/s ({args.rows} rows x {args.max_new_tokens} tokens)")
    write_json(args.json, result, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
