"""ULTS vs beam search on a language model: mean log-likelihood against node expansions and wall time.

    python -m benchmarks.ults_lm [--models tiny|real|DIR | --generator DIR] [--num-prompts 16]
                                 [--max-new-tokens 20] [--device cpu] [--json out/ults_lm.json] [--plot out/ults_lm.png]

The ULTS paper's section 5.2 setting on our generator: decode --max-new-tokens tokens (fixed length, EOS
ignored, as the paper does so that likelihoods compare), beam search with k in {1, 2, 3, 4, 5, 10}
against ULTS with the Dirichlet prior (alpha 1e-4) and the empirical prior, epsilon 0.1 and
k_max in {2, 3, 5, 10} (top-k_max children per expansion, as in the authors' code). Both run on the
same expander (KV reuse along paths, all prompts batched in each forward pass), so a node expansion
costs the same for both. Reported per setting: mean total log-likelihood of the best sequence, mean
node expansions per prompt, and wall time of the whole batch (prior fitting excluded: it is cached and
reused across runs). The claim to check (paper Fig. 5): ULTS reaches the same or a higher
log-likelihood than beam search with fewer expansions.

On the tiny models (the default) the generator's weights are random (near-uniform softmax), so it is
fine-tuned briefly on the tiny corpus (--train-steps) so its next-token distributions are peaked like
a real model's.
"""

from __future__ import annotations

import random
import sys
import time

import numpy as np
import torch

from benchmarks import bench_parser, model_dirs, parse, write_json, write_png
from benchmarks.aded import fine_tune
from jobs.make_tiny_models import ASKS, SUBJECTS, corpus
from pipeline.decoding.ults import (DirichletPrior, EmpiricalPrior, ULTSParams, beam_search, collect_softmax,
                                    fit_level_beliefs, ults_search)
from pipeline.engines.hf import HFEngine, for_inference
from pipeline.engines.adapters import PathCacheExpander


def main(argv=None) -> int:
    parser = bench_parser("benchmarks.ults_lm", __doc__, models="tiny",
                          generator=dict(help="generator directory (default: the model set's; the tiny one is "
                                              "fine-tuned first)"),
                          num_prompts=16, max_new_tokens=20, device="cpu", threads=1, seed=0, json="out/ults_lm.json",
                          plot="out/ults_lm.png")
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 2, 3, 4, 5, 10])
    parser.add_argument("--k-max", type=int, nargs="+", default=[2, 3, 5, 10])
    parser.add_argument("--alpha", type=float, default=1e-4)
    parser.add_argument("--epsilon", type=float, default=0.1)
    parser.add_argument("--empirical-samples", type=int, default=256)
    parser.add_argument("--train-steps", type=int, default=40)
    args = parse(parser, argv)
    torch.manual_seed(args.seed)
    tiny = args.generator is None and args.models == "tiny"
    model = model_dirs(args.models, ("generator",), generator=args.generator)["generator"]
    engine = HFEngine.from_pretrained(model, device=args.device, prepack=not tiny)  # tiny: fine-tuned, then prepacked
    if tiny:
        if args.train_steps:
            fine_tune(engine, [engine.tokenizer(line).input_ids for line in corpus(1, 3000)], args.train_steps)
        for_inference(engine.model, args.device)
    tok = engine.tokenizer
    rng = random.Random(args.seed + 1)
    prompts = [tok(f"{rng.choice(ASKS)} {rng.choice(SUBJECTS)}.").input_ids for _ in range(args.num_prompts)]
    held_out = [tok(f"{rng.choice(ASKS)} {rng.choice(SUBJECTS)}.").input_ids for _ in range(16)]
    depth = args.max_new_tokens
    vocab = int(engine.model.config.vocab_size)
    priors = {
        "dirichlet": DirichletPrior(args.alpha, vocab),
        # C from greedy completions of other prompts than the test ones (section 5.2.1), pooled
        "empirical": EmpiricalPrior(np.concatenate(collect_softmax(
            PathCacheExpander(engine.model, engine.device), held_out,
            -(-args.empirical_samples // len(held_out)), depth, seeds=list(range(len(held_out))))[0])),
    }
    beliefs = {name: fit_level_beliefs(prior, depth, 1000) for name, prior in priors.items()}
    results = []

    def record(name, kind, setting, fn):
        start = time.perf_counter()
        out = fn()
        wall = time.perf_counter() - start
        row = {"method": name, "kind": kind, "setting": setting,
               "loglik": sum(r.leaves[0][1] for r in out) / len(out),
               "expansions": sum(r.expansions for r in out) / len(out), "wall_seconds": wall}
        results.append(row)
        print(f"{name:<22}{row['loglik']:>12.3f}{row['expansions']:>12.2f}{wall:>10.2f}")

    print(f"{'method':<22}{'loglik':>12}{'expansions':>12}{'wall s':>10}")
    for k in args.beams:
        record(f"beam k={k}", "beam", k,
               lambda k=k: beam_search(PathCacheExpander(engine.model, engine.device), prompts, depth, k))
    for name, bel in beliefs.items():
        for k_max in args.k_max:
            # top-k_max children per expansion, as in the authors' code
            params = ULTSParams(epsilon=args.epsilon, k_max=k_max, branching=k_max)
            record(f"ULTS-{name} k_max={k_max}", f"ults-{name}", k_max,
                   lambda bel=bel, params=params: ults_search(PathCacheExpander(engine.model, engine.device), prompts,
                                                              bel, depth, params, seeds=list(range(len(prompts)))))
    beams = sorted((r["expansions"], r["loglik"]) for r in results if r["kind"] == "beam")
    print("\nULTS vs beam search at the same or a larger budget:")
    for r in results:
        if r["kind"] == "beam":
            continue
        cheaper_or_equal = [b for b in beams if b[0] >= r["expansions"]]
        beaten = [b for b in cheaper_or_equal if b[1] <= r["loglik"] + 1e-3]
        print(f"  {r['method']:<22} loglik {r['loglik']:.3f} with {r['expansions']:.1f} expansions: "
              f"at least as good as {len(beaten)}/{len(cheaper_or_equal)} beam settings that expand as many or more")
    write_json(args.json, {"model": model if not tiny else "tiny generator (fine-tuned)", "device": args.device,
                           "prompts": args.num_prompts, "new_tokens": depth, "results": results}, args)
    write_png(args.plot, lambda plt: plot(plt, results))
    return 0


def plot(plt, results: list[dict]):
    """Mean log-likelihood against node expansions and against wall time, one line per method kind."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for kind, marker in (("beam", "o-"), ("ults-dirichlet", "s-"), ("ults-empirical", "^-")):
        rows = sorted((r for r in results if r["kind"] == kind), key=lambda r: r["expansions"])
        for ax, x in zip(axes, ("expansions", "wall_seconds")):
            ax.plot([r[x] for r in rows], [r["loglik"] for r in rows], marker, label=kind)
    axes[0].set_xlabel("node expansions per prompt")
    axes[1].set_xlabel("wall seconds (batch)")
    for ax in axes:
        ax.set_ylabel("mean log-likelihood")
    axes[0].legend(fontsize=8)
    return fig


if __name__ == "__main__":
    sys.exit(main())
