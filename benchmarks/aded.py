"""ADED vs plain autoregressive decoding and a static n-gram retrieval drafter, measured in one run.

    python -m benchmarks.aded [--models tiny|real|DIR | --generator DIR] [--corpus FILE] [--num-prompts 8]
                              [--max-new-tokens 64]
                              [--candidates 24] [--draft-depth 4]
                              [--train-steps 300] [--device cpu] [--json out/aded.json] [--plot out/aded.png]

Methods (greedy decoding, one prompt at a time as in the paper's latency setting, every method on the
same target model and prompts):
- autoregressive: HFEngine.generate, one target forward pass per token (the baseline);
- retrieval: a static REST-like drafter (longest context suffix looked up in the corpus, its most
  frequent continuations merged into a token tree), never updated;
- aded-static: ADED's MCTS drafter over the corpus tri-gram matrix, without adaptive updates;
- aded: the same with the appendix Algorithm 2 updates from the prompts and the verified output;
  the matrix keeps learning across prompts, as the output of a deployment grows.
All three drafters are verified the same way: one target forward pass over the token tree per step.
Reported per method: mean accepted length (tokens emitted per target forward pass, bonus token
included; autoregressive = 1), wall time and speedup over autoregressive, and that the output is
identical to autoregressive (greedy acceptance is exact). The curve (PNG) is the mean accepted length
against the number of tokens generated so far in the run, the analogue of the paper's Fig. 4a.

On the tiny models (the default), the generator's weights are random, so it is
first fine-tuned for --train-steps on the corpus so that its greedy output has the corpus's regularities,
as a real model's output has its training text's. Without --corpus, the corpus is the tiny models'
grammar corpus (jobs.make_tiny_models.corpus).
"""

from __future__ import annotations

import json
import random
import sys
import time

import torch

from benchmarks import bench_parser, model_dirs, parse, write_json, write_png
from jobs.make_tiny_models import ASKS, SUBJECTS, corpus
from pipeline.decoding.aded import ADEDDrafter, RetrievalDrafter, aded_decode
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import HFEngine, PackedLinear, for_inference
from pipeline.decoding.trigram import TrigramMatrix
from pipeline.engines.adapters import TreeTarget


def fine_tune(engine: HFEngine, sequences: list[list[int]], steps: int, seed: int = 0) -> float:
    """A few AdamW steps of next-token loss on the corpus (tiny random models only; the engine
    loaded with ``prepack=False``: packed weights take no gradient)."""
    if any(isinstance(m, PackedLinear) for m in engine.model.modules()):
        raise ValueError("fine_tune: the engine's linears are prepacked (load it with prepack=False)")
    rng = random.Random(seed)
    model = engine.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loss = torch.tensor(0.0)
    for _ in range(steps):
        batch = rng.sample(sequences, 16)
        width = max(len(s) for s in batch)
        ids = torch.full((16, width), engine.pad_id, dtype=torch.long)
        labels = torch.full((16, width), -100, dtype=torch.long)
        for i, s in enumerate(batch):
            ids[i, :len(s)] = torch.tensor(s)
            labels[i, :len(s)] = torch.tensor(s)
        loss = model(input_ids=ids.to(engine.device), labels=labels.to(engine.device)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    engine.model.eval()
    return loss.item()


class _NoDraft:
    def propose(self, context):
        from pipeline.decoding.tree import TokenTree

        return TokenTree([], [])

    def observe(self, context, new_tokens):
        pass


def run_method(name, engine, drafter, prompts, sampling):
    outputs, steps, start = [], [], time.perf_counter()
    total, draft_seconds = 0, 0.0
    for prompt in prompts:
        if drafter is None:
            rows = engine.generate([prompt], 1, [0], sampling)
            outputs.append(rows[0].token_ids)
            steps += [(total + i, 1) for i in range(len(rows[0].token_ids))]
            total += len(rows[0].token_ids)
            continue
        drafter.observe(prompt, len(prompt))  # ADED learns the input's tri-grams too (Fig. 2); static ones ignore it
        out, stats = aded_decode(TreeTarget(engine.model, engine.device, engine.pad_id), drafter, [prompt], 1, [0],
                                 sampling, engine.eos_ids, engine.device)
        outputs.append(out[0])
        draft_seconds += stats.draft_seconds
        for _, _, n in stats.accepted_per_step:
            steps.append((total, n))
            total += n
    wall = time.perf_counter() - start
    # Where the time goes: drafting (the drafter's Python) vs the rest (target passes, acceptance).
    return {"name": name, "outputs": outputs, "wall_seconds": wall, "steps": steps,
            "accepted_length": sum(n for _, n in steps) / max(len(steps), 1),
            "forward_passes": len(steps), "draft_seconds": draft_seconds,
            "seconds_per_forward_pass": (wall - draft_seconds) / max(len(steps), 1)}


def curve(steps: list[tuple[int, int]], bin_tokens: int) -> list[tuple[int, float]]:
    """Mean accepted length of the verification steps that started in each bin of generated tokens."""
    bins: dict[int, list[int]] = {}
    for position, n in steps:
        bins.setdefault(position // bin_tokens, []).append(n)
    return [((b + 1) * bin_tokens, sum(v) / len(v)) for b, v in sorted(bins.items())]


def main(argv=None) -> int:
    parser = bench_parser("benchmarks.aded", __doc__, models="tiny",
                          generator=dict(help="target model directory (default: the model set's; the tiny one is "
                                              "fine-tuned first)"),
                          num_prompts=8, max_new_tokens=64, device="cpu", threads=1, seed=0, json="out/aded.json",
                          plot="out/aded.png")
    parser.add_argument("--corpus", help="text file, one document per line, or JSONL with a \"text\" field (the real "
                        "generator's samples: .cache/real-models/reward-data/samples-train.jsonl); default: the "
                        "tiny-model corpus")
    parser.add_argument("--train-steps", type=int, default=300, help="fine-tune steps for the tiny model")
    parser.add_argument("--iterations", type=int, default=150, help="MCTS iterations (paper: 150)")
    parser.add_argument("--candidates", type=int, default=24,
                        help="drafts merged into each verified tree (paper: 24); fewer = smaller verification passes")
    parser.add_argument("--draft-depth", type=int, default=4, help="draft length l (paper: 4)")
    args = parse(parser, argv)
    torch.manual_seed(args.seed)
    tiny = args.generator is None and args.models == "tiny"
    model = model_dirs(args.models, ("generator",), generator=args.generator)["generator"]
    # The tiny model is fine-tuned below, then prepacked (packed weights take no gradient).
    engine = HFEngine.from_pretrained(model, device=args.device, prepack=not tiny)
    tok = engine.tokenizer
    if args.corpus and args.corpus.endswith(".jsonl"):  # e.g. the generator's own samples
        with open(args.corpus) as f:
            lines = [text.strip() for text in (json.loads(line).get("text") or "" for line in f) if text.strip()]
    elif args.corpus:
        with open(args.corpus) as f:
            lines = [line.strip() for line in f if line.strip()]
    else:
        lines = corpus(seed=1, lines=3000)
    sequences = [tok(line).input_ids for line in lines]
    if tiny and args.train_steps:
        loss = fine_tune(engine, sequences, args.train_steps, args.seed)
        print(f"fine-tuned the tiny generator for {args.train_steps} steps (loss {loss:.2f})")
    if tiny:
        for_inference(engine.model, args.device)  # models.cpu_prepack, as --model loads
    rng = random.Random(args.seed + 1)
    prompts = [tok(f"{rng.choice(ASKS)} {rng.choice(SUBJECTS)}.").input_ids for _ in range(args.num_prompts)]
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0, ignore_eos=True)
    base = TrigramMatrix.from_sequences(sequences)
    methods = [
        ("autoregressive", None),
        ("retrieval", RetrievalDrafter(sequences, depth=args.draft_depth, candidates=args.candidates)),
        ("aded-static", ADEDDrafter(base.copy(), iterations=args.iterations, depth=args.draft_depth,
                                    candidates=args.candidates, adaptive=False, seed=args.seed)),
        ("aded", ADEDDrafter(base.copy(), iterations=args.iterations, depth=args.draft_depth,
                             candidates=args.candidates, adaptive=True, seed=args.seed)),
    ]
    run_method("warm-up", engine, None, prompts[:1], sampling)
    results = []
    for name, drafter in methods:
        results.append(run_method(name, engine, drafter, prompts, sampling))
    ar = results[0]
    rows = []
    print(f"\n{'method':<16}{'accepted/forward':>18}{'wall s':>10}{'speedup':>10}{'same output':>13}"
          f"{'drafting s':>12}{'s/forward':>11}")
    for res in results:
        same = res["outputs"] == ar["outputs"]
        speedup = ar["wall_seconds"] / res["wall_seconds"]
        print(f"{res['name']:<16}{res['accepted_length']:>18.3f}{res['wall_seconds']:>10.2f}{speedup:>10.2f}{str(same):>13}"
              f"{res['draft_seconds']:>12.2f}{res['seconds_per_forward_pass']:>11.4f}")
        rows.append({"method": res["name"], "accepted_length": round(res["accepted_length"], 4),
                     "wall_seconds": round(res["wall_seconds"], 4), "speedup": round(speedup, 4),
                     "forward_passes": res["forward_passes"], "draft_seconds": round(res["draft_seconds"], 4),
                     "seconds_per_forward_pass": round(res["seconds_per_forward_pass"], 5),
                     "same_output_as_autoregressive": same,
                     "curve": curve(res["steps"], max(args.max_new_tokens, 32))})
    bin_tokens = max(args.max_new_tokens, 32)
    print(f"\nmean accepted length by tokens generated so far (bins of {bin_tokens}):")
    print("tokens   " + "  ".join(f"{r['method']:>14}" for r in rows[1:]))
    for i, (edge, _) in enumerate(rows[-1]["curve"]):
        values = [r["curve"][i][1] if i < len(r["curve"]) else float("nan") for r in rows[1:]]
        print(f"{edge:<9}" + "  ".join(f"{v:>14.3f}" for v in values))
    write_json(args.json, {"model": model if not tiny else "tiny generator (fine-tuned)", "device": args.device,
                           "prompts": args.num_prompts, "new_tokens": args.max_new_tokens,
                           "iterations": args.iterations, "candidates": args.candidates,
                           "draft_depth": args.draft_depth, "methods": rows}, args)
    write_png(args.plot, lambda plt: plot(plt, rows[1:]))
    return 0


def plot(plt, rows: list[dict]):
    """Each drafter's mean accepted length against the tokens generated so far (the paper's Fig. 4a)."""
    fig, ax = plt.subplots(figsize=(5, 3.4))
    for r in rows:
        ax.plot([x for x, _ in r["curve"]], [y for _, y in r["curve"]], "o-", label=r["method"])
    ax.set_xlabel("tokens generated so far")
    ax.set_ylabel("mean accepted length")
    ax.legend()
    return fig


if __name__ == "__main__":
    sys.exit(main())
