"""Speculative rejection vs Best-of-N, same run, same prompts, same seeds: a table shaped like
Table 1 of "Accelerating Best-of-N via Speculative Rejection".

    python -m benchmarks.sbon [--models bench|DIR] [--num-samples 16 64] [--sr 8:0.9 16:0.8 ...] [--device cpu|cuda]
    python -m benchmarks.sbon --synthetic 1b --device cuda      # speed only, random ~1B Llama pair

Bench models: DIR/generator and DIR/reward from ``python -m jobs.bench_models
--output DIR`` (built here when missing; cached). Rows, for each N of --num-samples:
- Best-of-N (the reference: speedup 1, score 100);
- speculative rejection at each (tau, alpha) of ``--sr`` ("TAU[,TAU...]:ALPHA"; a list of taus
  rejects at each), plus adaptive per-prompt rejection (``--adaptive Z``) next to the fixed alpha
  it starts from;
- Best-of-N/4 (the paper's Best-of-25 row) and Best-of-M with M = round(N / speedup) of the
  headline SR row, as in the paper's section 6 (plus M = round(N * token rate) when that differs:
  equal generated tokens rather than equal wall-clock);
- memory-budget mode (section 6.3): ``--memory INITIAL:LIVE:TAU`` starts INITIAL rows per prompt
  and keeps LIVE past tau; it sits in the N=LIVE table (same live rows, i.e. KV memory, after tau
  as that Best-of-N), and its score against Best-of-INITIAL is printed at the end.

Columns: wall-clock speedup over Best-of-N (T_BoN / T_method, Eq. 5; "CPUspd": the same ratio of
this process's CPU time, which other processes on a shared machine cannot inflate), normalized score (Eq. 5:
100 * (1 - (max_k s(Z_k) - max_{k accepted} s(Y_k)) / (max_k s(Z_k) - min_k s(Z_k))), averaged
over prompts), token rate (generated tokens / Best-of-N's) and reward-model tokens read. With the
same seeds every method samples the same candidates as Best-of-N, so the score is at most 100.
The headline SR row is also run with full re-scoring instead of streaming reward sessions: the
ratio of reward-model tokens read is printed, and the scores must agree.
Targets: >= 3x wall-clock speedup at score >= 98, and SR above Best-of-M's score.
Writes JSON to --json (default sbon.json) and a speedup-score scatter PNG to --plot.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import torch

from benchmarks import bench_parser, model_dirs, model_prompts, parse, read_prompts, write_json, write_png

from pipeline.data.chat import PromptFormatter, prompt_id
from pipeline.decoding.best_of_n import BestOfNParams, best_of_n
from pipeline.decoding.domain import PromptInput, PromptResult
from pipeline.decoding.metrics import normalized_score as eq5
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative_rejection import SpeculativeRejectionParams, speculative_rejection
from pipeline.engines.hf import DTYPES, HFEngine
from pipeline.engines.rewards import RewardScorer

# Random-init Llama pairs for --synthetic: speed is measurable, quality is not.
SYNTHETIC = {
    "1b": {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
           "num_key_value_heads": 8},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2},
}


@dataclass
class Run:
    name: str
    n: int
    seconds: float
    """Wall-clock seconds (fastest repeat)."""
    cpu_seconds: float
    """CPU seconds of this process (fastest repeat): the work itself, which time stolen by other
    processes on a shared machine does not inflate; equal to wall-clock on an idle one-thread CPU run."""
    results: list[PromptResult]
    reward_tokens: int
    params: dict = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(r.generated_tokens for r in self.results)


def best_accepted(result: PromptResult) -> float:
    """max over I_accepted of the final reward: completed candidates that were never stopped."""
    finals = [c.score for c in result.candidates if c.completed and not c.stopped_early and not c.failed]
    return max(finals) if finals else -math.inf


def normalized_score(reference: list[PromptResult], method: list[PromptResult]) -> float:
    """Eq. 5 averaged over prompts; prompts whose Best-of-N rewards are all equal are skipped."""
    values = [eq5([c.score for c in ref.candidates], best_accepted(got)) for ref, got in zip(reference, method)]
    values = [v for v in values if math.isfinite(v)]
    return sum(values) / len(values) if values else math.nan


def parse_sr(spec: str) -> tuple[list[int], float]:
    taus, alpha = spec.split(":")
    return [int(t) for t in taus.split(",")], float(alpha)


def load_models(args):
    if args.synthetic:
        from transformers import LlamaForCausalLM, LlamaForSequenceClassification

        from jobs.make_tiny_models import build_tokenizer, llama_config

        tok = build_tokenizer(0, 512)
        shape = dict(SYNTHETIC[args.synthetic])
        hidden, layers = shape.pop("hidden_size"), shape.pop("num_hidden_layers")
        heads, kv = shape.pop("num_attention_heads"), shape.pop("num_key_value_heads")
        dtype = DTYPES[args.dtype]
        torch.manual_seed(0)
        gen_cfg = llama_config(tok, hidden, layers, heads, kv)
        gen_cfg.intermediate_size = shape["intermediate_size"]
        rew_cfg = llama_config(tok, hidden, layers, heads, kv, num_labels=1)
        rew_cfg.intermediate_size = shape["intermediate_size"]
        generator = LlamaForCausalLM(gen_cfg).to(device=args.device, dtype=dtype)
        reward = LlamaForSequenceClassification(rew_cfg).to(device=args.device, dtype=dtype)
        params = sum(p.numel() for p in generator.parameters())
        print(f"synthetic {args.synthetic}: generator and reward model of {params / 1e6:.0f}M parameters each "
              f"(random weights: speed only)", file=sys.stderr)
        return HFEngine(generator, tok, args.device), RewardScorer(reward, load_tokenizer_copy(tok), args.device)
    models = model_dirs(args.models, generator=args.generator, reward=args.reward)
    engine = HFEngine.from_pretrained(models["generator"], device=args.device, dtype=args.dtype)
    scorer = RewardScorer.from_pretrained(models["reward"], device=args.device, dtype=args.dtype,
                                          batch_size=args.reward_batch_size)
    return engine, scorer


def load_tokenizer_copy(tok):
    """The reward side sets truncation_side on its tokenizer; give it its own copy."""
    import copy

    return copy.deepcopy(tok)


def prompt_inputs(args, tokenizer) -> list[PromptInput]:
    if args.prompts or not args.synthetic:
        texts = [row["prompt"] for row in read_prompts(args.prompts or model_prompts(args.models))]
    else:
        from jobs.bench_models import bench_prompts

        texts = bench_prompts()
    # Spread over the products: every 4th prompt is a different product with the first request.
    texts = (texts[::4] + [t for i, t in enumerate(texts) if i % 4])[:args.num_prompts]
    formatter = PromptFormatter(tokenizer, max_prompt_tokens=10**6)
    out = []
    for raw in texts:
        text, ids = formatter.render(raw)
        out.append(PromptInput(prompt_id(raw), text, raw, ids))
    return out


def run(name: str, fn, params, prompts, engine, scorer, sampling, n, seed, rows_per_batch, repeats=1) -> Run:
    """Run ``fn`` over all prompts ``repeats`` times; the fastest wall-clock is kept (the shared
    machine's noise only ever adds time). The results are the same every time (same seeds)."""
    per_batch = max(1, rows_per_batch // n)
    best, best_cpu, results, reward_tokens = math.inf, math.inf, None, 0
    for _ in range(repeats):
        before = scorer.tokens_read
        start, start_cpu = time.perf_counter(), time.process_time()
        out = []
        for i in range(0, len(prompts), per_batch):
            out += fn(prompts[i:i + per_batch], engine, scorer, params, sampling, n, seed)
        if engine.device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
        results, reward_tokens = results or out, scorer.tokens_read - before
    return Run(name, n, best, best_cpu, results, reward_tokens,
               {k: v for k, v in vars(params).items()} if params is not None else {})


def table(rows: list[dict], n: int) -> str:
    head = f"{'N=' + str(n):<28}{'Spdup':>8}{'CPUspd':>8}{'Score':>8}{'TokRate':>9}{'RM tok':>10}{'M':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['method']:<28}{r['speedup']:>8.3f}{r['cpu_speedup']:>8.3f}{r['score']:>8.1f}"
                     f"{r['token_rate']:>9.3f}{r['reward_tokens']:>10d}{r.get('m', ''):>8}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = bench_parser("benchmarks.sbon", __doc__, models="bench", generator=None, reward=None,
                          prompts=dict(help="prompt file, JSONL (default: the model set's prompts.jsonl)"),
                          num_prompts=16, num_samples=dict(type=int, nargs="+", default=[16, 64], help="the Ns compared"),
                          max_new_tokens=128, repeats=3, seed=0, device="cpu",
                          dtype=dict(default=None, help="float32 (default on cpu) or bfloat16 (default on cuda)"),
                          threads=1, json="sbon.json", plot="sbon.png")
    parser.add_argument("--synthetic", choices=sorted(SYNTHETIC), help="random-init Llama pair instead (speed only)")
    parser.add_argument("--sr", nargs="+", default=["8:0.85", "8:0.9", "8:0.75", "16:0.9"],
                        help="speculative rejection settings TAU[,TAU...]:ALPHA; the first is the headline")
    parser.add_argument("--adaptive", type=float, default=1.0, help="z of adaptive rejection (0: skip)")
    parser.add_argument("--adaptive-taus", default="8,16:0.75", help="TAU,TAU:ALPHA for the adaptive comparison")
    parser.add_argument("--memory", default="64:16:8", help="INITIAL:LIVE:TAU for memory-budget mode ('' skips)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rows-per-batch", type=int, default=256,
                        help="engine batch: prompts per batch = this / N (large enough that compute, not per-step "
                             "overhead, sets the step time)")
    parser.add_argument("--reward-batch-size", type=int, default=64)
    args = parse(parser, argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    engine, scorer = load_models(args)
    prompts = prompt_inputs(args, engine.tokenizer)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    go = dict(prompts=prompts, engine=engine, scorer=scorer, sampling=sampling, seed=args.seed,
              rows_per_batch=args.rows_per_batch, repeats=args.repeats)
    # Warm-up (allocator, kernels) so the first timed run is not penalised.
    run("warmup", best_of_n, BestOfNParams(), prompts=prompts[:1], engine=engine, scorer=scorer,
        sampling=SamplingParams(max_new_tokens=8), seed=args.seed, n=2, rows_per_batch=2)
    report = {"models": args.synthetic or args.models, "device": args.device, "dtype": args.dtype,
              "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "seed": args.seed, "tables": {}}
    bon_runs: dict[int, Run] = {}
    points = []
    memory_run = None
    for n in args.num_samples:
        bon = bon_runs[n] = run(f"Bo{n}", best_of_n, BestOfNParams(), n=n, **go)
        rows = []

        def row(r: Run, **extra) -> dict:
            out = {"method": r.name, "speedup": bon.seconds / r.seconds, "cpu_speedup": bon.cpu_seconds / r.cpu_seconds,
                   "score": normalized_score(bon.results, r.results), "token_rate": r.tokens / bon.tokens,
                   "reward_tokens": r.reward_tokens, "seconds": round(r.seconds, 3),
                   "cpu_seconds": round(r.cpu_seconds, 3), "params": r.params, **extra}
            rows.append(out)
            return out

        sr_rows, sr_runs = [], []
        for spec in args.sr:
            taus, alpha = parse_sr(spec)
            params = SpeculativeRejectionParams(decision_token=taus, rejection_rate=alpha)
            sr_runs.append(run(f"SBoN tau={spec.split(':')[0]} a={alpha}", speculative_rejection, params, n=n, **go))
            sr_rows.append(row(sr_runs[-1]))
        if args.adaptive > 0:
            taus, alpha = parse_sr(args.adaptive_taus)
            fixed = SpeculativeRejectionParams(decision_token=taus, rejection_rate=alpha)
            adaptive = SpeculativeRejectionParams(decision_token=taus, rejection_rate=alpha,
                                                  adaptive_rejection=args.adaptive)
            row(run(f"SBoN tau={args.adaptive_taus.split(':')[0]} a={alpha}", speculative_rejection, fixed, n=n, **go))
            row(run(f"  adaptive z={args.adaptive}", speculative_rejection, adaptive, n=n, **go))
        row(bon)
        quarter = max(1, n // 4)
        row(run(f"Bo{quarter} (N/4)", best_of_n, BestOfNParams(), n=quarter, **go), m=quarter)
        headline = sr_rows[0]
        m = max(1, round(n / headline["speedup"]))
        bom = row(run(f"Bo{m} (M=N/speedup)", best_of_n, BestOfNParams(), n=m, **go), m=m)
        m_tokens = max(1, round(n * headline["token_rate"]))
        if m_tokens != m:  # equal generated tokens rather than equal wall-clock
            row(run(f"Bo{m_tokens} (M=N*token rate)", best_of_n, BestOfNParams(), n=m_tokens, **go), m=m_tokens)
        # Streaming vs full re-scoring on the headline setting: same scores, fewer reward tokens.
        taus, alpha = parse_sr(args.sr[0])
        rescoring = run("rescoring", speculative_rejection,
                        SpeculativeRejectionParams(decision_token=taus, rejection_rate=alpha, streaming_rewards=False),
                        n=n, **go)
        stream_ratio = headline["reward_tokens"] / max(1, rescoring.reward_tokens)
        if args.memory:
            initial, live, tau = (int(v) for v in args.memory.split(":"))
            if n == live:  # same live rows (KV memory) after tau as this table's Best-of-N
                params = SpeculativeRejectionParams(decision_token=tau, rejection_rate=0.0, initial_candidates=initial,
                                                    max_live_candidates=live)
                memory_run = run(f"memory {initial}->{live} tau={tau}", speculative_rejection, params, n=live, **go)
                row(memory_run, m=f"{initial}>{live}")
        print("\n" + table(rows, n))
        passing = [r for r in sr_rows if r["score"] >= 98.0]
        for clock in ("speedup", "cpu_speedup"):
            best = max(passing, key=lambda r: r[clock]) if passing else max(sr_rows, key=lambda r: r["score"])
            print(f"target >= 3x at score >= 98 ({'wall-clock' if clock == 'speedup' else 'CPU time'}): "
                  f"{'MET' if passing and best[clock] >= 3 else 'NOT MET'} "
                  f"(best SR: {best['method']}, {best[clock]:.2f}x at {best['score']:.1f})")
        print(f"SR vs Best-of-M at equal cost: {headline['method']} {headline['score']:.1f} vs Bo{m} {bom['score']:.1f}"
              f" ({'SR ahead' if headline['score'] > bom['score'] else 'SR NOT ahead'})")
        diff = max((abs(a.score - b.score) for x, y in zip(sr_runs[0].results, rescoring.results)
                    for a, b in zip(x.candidates, y.candidates) if not (a.failed or b.failed)), default=0.0)
        print(f"streaming / re-scoring reward-model tokens: {stream_ratio:.3f} "
              f"({headline['reward_tokens']} vs {rescoring.reward_tokens}; max score difference {diff:.2e})")
        report["tables"][str(n)] = {"rows": rows, "stream_ratio": stream_ratio, "rescoring_tokens": rescoring.reward_tokens,
                                    "max_stream_score_diff": diff}
        points += [(n, r) for r in rows]
    if memory_run is not None:
        initial, live, _ = (int(v) for v in args.memory.split(":"))
        summary = {"score_vs_bo_live": normalized_score(bon_runs[live].results, memory_run.results),
                   "tokens_vs_bo_live": memory_run.tokens / bon_runs[live].tokens}
        if initial in bon_runs:
            summary["score_vs_bo_initial"] = normalized_score(bon_runs[initial].results, memory_run.results)
            summary["speedup_vs_bo_initial"] = bon_runs[initial].seconds / memory_run.seconds
        report["memory_budget"] = summary
        print(f"\nmemory-budget {args.memory}: " + ", ".join(f"{k} {v:.3g}" for k, v in summary.items()))
    write_json(args.json, report, args)
    write_png(args.plot, lambda plt: plot(plt, points), dpi=150)
    return 0


def plot(plt, points):
    """One panel per N: speedup vs normalized score, each point labelled with its method."""
    ns = sorted({n for n, _ in points})
    fig, axes = plt.subplots(1, len(ns), figsize=(5.5 * len(ns), 4.5), squeeze=False)
    for ax, n in zip(axes[0], ns):
        for _, r in (p for p in points if p[0] == n):
            name = r["method"].strip()
            color = "tab:red" if name.startswith(("SBoN", "adaptive")) else (
                "tab:blue" if name.startswith("Bo") else "tab:green")
            ax.scatter(r["speedup"], r["score"], c=color, s=18)
            ax.annotate(name, (r["speedup"], r["score"]), fontsize=6, xytext=(3, 2), textcoords="offset points")
        ax.axhline(98, ls="--", c="grey", lw=0.8)
        ax.axvline(3, ls="--", c="grey", lw=0.8)
        ax.set(title=f"N={n}", xlabel="wall-clock speedup over Best-of-N", ylabel="normalized score (Eq. 5)")
    return fig


if __name__ == "__main__":
    sys.exit(main())
