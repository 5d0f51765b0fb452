"""ULTS vs beam search on synthetic trees: the toy experiment of the ULTS paper (section 5.1, Fig. 3).

    python -m benchmarks.ults_toy [--trees 100] [--alphas 0.1 0.2 0.5 0.8] [--epsilons 0.05 0.1 0.3]
                                  [--json out/ults_toy.json] [--plot out/ults_toy.png]

Trees have branching b = 8 and depth d = 5; every node's transition probabilities are drawn from
Dirichlet(alpha). ULTS runs on-model (its prior is the true Dirichlet(alpha)), with k_max = inf and
Eq. 1 optimised over the whole boundary (the paper does this because the trees are small), for
each epsilon. Beam search runs with widths 1-7. Both expand a node by reading all its 8 children,
so "node expansions" is the cost. For each alpha it prints, and plots, the mean log-likelihood of
the returned leaf against the mean number of expansions, and says whether ULTS dominates: for
every epsilon, no beam width reaches a higher mean log-likelihood with at most as many expansions
(beam search interpolated linearly between widths). The paper reports domination at every alpha.
No model, no device: --device is accepted for uniformity and ignored.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from pipeline.decoding.ults import DirichletPrior, ULTSParams, beam_search, fit_level_beliefs, ults_search
from benchmarks import bench_parser, parse, write_json, write_png

BRANCHING, DEPTH = 8, 5


class ToyTreeExpander:
    """A fully stored tree: level l holds b^l nodes, node i's children are i*b .. i*b + b-1, and each
    node's transition probabilities come from Dirichlet(alpha). Implements NodeExpander."""

    def __init__(self, alpha: float, seed: int, branching: int = BRANCHING, depth: int = DEPTH):
        rng = np.random.default_rng(seed)
        self.b = branching
        self.levels = [np.log(np.clip(rng.dirichlet(np.full(branching, alpha), size=branching ** level), 1e-300, 1))
                       for level in range(depth)]  # level l: [b^l, b] log-probabilities
        self.index: dict[tuple[int, int], tuple[int, int]] = {}  # (tree, node) -> (level, index)

    def best_loglik(self) -> float:
        """The exact optimum by dynamic programming (for reference)."""
        value = np.zeros(self.b ** len(self.levels))
        for level in reversed(self.levels):
            value = (level + value.reshape(-1, self.b)).max(1)
        return float(value[0])

    def roots(self, prompts):
        for t in range(len(prompts)):
            self.index[(t, 0)] = (0, 0)
        return torch.from_numpy(np.stack([self.levels[0][0]] * len(prompts)))

    def expand(self, items):
        rows = []
        for tree, node, parent, token in items:
            level, idx = self.index[(tree, parent)]
            self.index[(tree, node)] = (level + 1, idx * self.b + token)
            rows.append(self.levels[level + 1][idx * self.b + token])
        return torch.from_numpy(np.stack(rows))

    def release(self, tree):
        pass


def toy_params(epsilon: float, belief_samples: int = 1000) -> ULTSParams:
    """The paper's toy setting: no k_max cap, Eq. 1 over the whole boundary, max backup."""
    return ULTSParams(epsilon=epsilon, k_max=None, branching=BRANCHING, belief_samples=belief_samples,
                      acquisition="posterior", selection="boundary")


def run_alpha(alpha: float, epsilons: list[float], widths: list[int], trees: int, seed: int = 0,
              belief_samples: int = 1000) -> dict:
    """Mean log-likelihood and mean expansions over ``trees`` random trees, per method."""
    beliefs = fit_level_beliefs(DirichletPrior(alpha, BRANCHING), DEPTH, belief_samples, seed=seed)
    out = {"alpha": alpha, "ults": {}, "beam": {}}
    for eps in epsilons:
        params = toy_params(eps, belief_samples)
        ll, ex = [], []
        for k in range(trees):
            res = ults_search(ToyTreeExpander(alpha, seed * 100_000 + k), [[0]], beliefs, DEPTH, params, seeds=[k])[0]
            ll.append(res.leaves[0][1])
            ex.append(res.expansions)
        out["ults"][eps] = {"loglik": float(np.mean(ll)), "expansions": float(np.mean(ex))}
    for width in widths:
        ll, ex = [], []
        for k in range(trees):
            res = beam_search(ToyTreeExpander(alpha, seed * 100_000 + k), [[0]], DEPTH, width)[0]
            ll.append(res.leaves[0][1])
            ex.append(res.expansions)
        out["beam"][width] = {"loglik": float(np.mean(ll)), "expansions": float(np.mean(ex))}
    out["optimum"] = float(np.mean([ToyTreeExpander(alpha, seed * 100_000 + k).best_loglik() for k in range(trees)]))
    out["ults_dominates"] = dominates(out)
    return out


def beam_at(beam: dict, expansions: float) -> float:
    """Beam search's mean log-likelihood at a given budget, linear between widths (-inf below width 1)."""
    points = sorted((v["expansions"], v["loglik"]) for v in beam.values())
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    if expansions < xs[0]:
        return -np.inf
    return float(np.interp(expansions, xs, ys))


def dominates(result: dict) -> bool:
    """Every ULTS point is at least as good as beam search at the same number of expansions."""
    return all(v["loglik"] >= beam_at(result["beam"], v["expansions"]) - 1e-9 for v in result["ults"].values())


def plot(plt, results: list[dict]):
    """Per alpha: mean log-likelihood against node expansions; beam search's widths as a line, each
    ULTS epsilon as a point."""
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.4), squeeze=False)
    for ax, res in zip(axes[0], results):
        beam = sorted(res["beam"].items())
        ax.plot([v["expansions"] for _, v in beam], [v["loglik"] for _, v in beam], "o-", label="beam search (k=1..7)")
        for w, v in beam:
            ax.annotate(str(w), (v["expansions"], v["loglik"]), fontsize=7, xytext=(2, -8), textcoords="offset points")
        for eps, v in sorted(res["ults"].items()):
            ax.plot(v["expansions"], v["loglik"], "s", label=f"ULTS eps={eps}")
        ax.axhline(res["optimum"], color="gray", lw=0.8, ls="--", label="optimum")
        ax.set_title(f"alpha = {res['alpha']}")
        ax.set_xlabel("node expansions")
        ax.set_ylabel("log-likelihood")
    axes[0][0].legend(fontsize=7)
    return fig


def main(argv=None) -> int:
    parser = bench_parser("benchmarks.ults_toy", __doc__, seed=0,
                          device=dict(default="cpu", help="ignored: the toy needs no model"),
                          json="out/ults_toy.json", plot="out/ults_toy.png")
    parser.add_argument("--trees", type=int, default=100, help="random trees per alpha")
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.2, 0.5, 0.8])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.05, 0.1, 0.3])
    parser.add_argument("--widths", type=int, nargs="+", default=list(range(1, 8)))
    parser.add_argument("--belief-samples", type=int, default=1000)
    args = parse(parser, argv)
    results = []
    for alpha in args.alphas:
        res = run_alpha(alpha, args.epsilons, args.widths, args.trees, args.seed, args.belief_samples)
        results.append(res)
        print(f"alpha={alpha}  optimum {res['optimum']:.3f}  ULTS dominates beam search: {res['ults_dominates']}")
        for eps, v in res["ults"].items():
            print(f"  ULTS eps={eps:<5} loglik {v['loglik']:8.3f}  expansions {v['expansions']:6.2f}  "
                  f"(beam at same budget {beam_at(res['beam'], v['expansions']):8.3f})")
        for width, v in res["beam"].items():
            print(f"  beam k={width:<7} loglik {v['loglik']:8.3f}  expansions {v['expansions']:6.2f}")
    write_json(args.json, {"results": results}, args)
    write_png(args.plot, lambda plt: plot(plt, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
