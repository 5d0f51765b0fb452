"""DSBD against multinomial sampling, speculative decoding and beam sampling, same run, same prompts.

    python -m benchmarks.dsbd [--models tiny|real|DIR] [--device cpu|cuda] [--num-prompts 4] [--num-samples 1]
        [--max-new-tokens 32] [--repeats 2] [--grid quick|paper|wide] [--random-large] [--no-ray]
        [--prompts FILE] [--aded] [--json out/bench/dsbd.json] [--plot out/bench/dsbd.png]

Every method decodes the same prompts with the same seeds to exactly --max-new-tokens tokens (EOS
disabled), in-process (no Ray), with the target through the same tree-verification engine
(pipeline.engines.tree), so the ratios compare algorithms, not engines. Per method it reports
tokens/s (best of --repeats, runs interleaved so machine noise hits all alike), target forward
passes per generated token, the perplexity of the outputs under the target (what beam width buys;
lower is better) and the average accepted width (beams per generated position).

Methods (DSBD paper section 4): multinomial sampling (beam width 1), speculative decoding
(Leviathan et al., --gamma-spec drafts), beam sampling of width 1-4, and DSBD over the grid of
(W_S, gamma, t) with W_min = 1 (quick: W_S 2,3,4 x gamma 2,3 x t 0.7,0.9; paper: W_S 2..6; wide:
W_S 2,4,6 x gamma 2,3 x t 0.3..0.9, lower t giving wider layers), and
DSBD in memory mode (gamma 2, t 0.5 and 0.9, each W_S). Then:
- Pareto fronts (tokens/s vs perplexity) of DSBD and beam sampling, written as a PNG;
- the speed-up at matched perplexity: for each beam width, the fastest DSBD setting whose
  perplexity is no worse, divided by beam sampling's speed (target: >= 1.5x);
- the memory-constrained comparison (paper Table 1): every method keeps ONE KV cache row:
  multinomial, speculative decoding, DSBD in memory mode (section 3.4);
- draft placement: one DSBD setting with the draft in-process vs in a Ray DraftActor (a round
  trip per iteration); --no-ray skips it;
- --aded: the same two methods with ADED's model-free drafts instead of the draft model
  (pipeline.decoding.aded.ADEDLayerDrafter over an empty tri-gram matrix reset for every prompt, as
  a dsbd build without models.draft runs): speculative decoding and DSBD (W_S 2 and 3, gamma 3,
  t 0.9).

Models: --models DIR holds DIR/generator and DIR/draft (e.g. `python -m jobs.bench_models
--output DIR`, or `python -m jobs.fetch_models --output DIR --draft` for SmolLM2-135M-Instruct and
its distilled draft: --models real), prompts from --prompts, else DIR/prompts.jsonl when present, else
configs/prompts/demo.jsonl, through the generator's chat template when it has one (--num-samples
seeds each); by default the random tiny models. Random
weights make perplexity nearly flat, so quality differences there mean little; speed ratios still
hold. --random-large builds a random-init ~1B target and ~100M draft (bf16 on cuda) so decoding is
memory-bound as in the paper; it needs a GPU. --random-medium (~40M / ~0.3M) makes the target's
forward pass the main cost on a CPU too, as it is for real models; on the tiny models the Python
work per iteration costs as much as a forward pass, which hides what the algorithms save.

Timing: on cpu, tokens per CPU-second of this process (time.process_time, one torch thread), so
other jobs on a shared machine do not skew the ratios; on cuda, wall time after synchronize.
The draft-placement comparison uses wall time (the DraftActor works in another process).
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.decoding.aded import ADEDDrafter, ADEDLayerDrafter
from pipeline.decoding.dsbd import DecodeStats, DSBDParams, beam_sampling, dsbd_decode
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import speculative_decode
from pipeline.engines.draft import HFDrafter
from pipeline.engines.adapters import TreeSession
from benchmarks import bench_parser, model_dirs, model_prompts, parse, read_prompts, write_json, write_png

GRIDS = {"quick": {"W_S": [2, 3, 4], "gamma": [2, 3], "t": [0.7, 0.9]},
         "paper": {"W_S": [2, 3, 4, 5, 6], "gamma": [2, 3], "t": [0.7, 0.9]},
         "wide": {"W_S": [2, 4, 6], "gamma": [2, 3], "t": [0.3, 0.5, 0.7, 0.9]}}


def load_models(args):
    """(target model, draft model, prompts as token ids, where they came from)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    if args.random_large or args.random_medium:
        # (target, draft) shapes: hidden, intermediate, layers, heads, kv heads; vocabulary.
        target_shape, draft_shape, vocab, label = (
            ((2048, 5632, 20, 32, 8), (768, 2048, 6, 12, 4), 32000, "random-init ~1.1B target / ~100M draft")
            if args.random_large else
            ((768, 2048, 6, 12, 4), (128, 256, 2, 4, 2), 512, "random-init ~40M target / ~0.3M draft"))
        torch.manual_seed(0)

        def build(shape):
            hidden, inter, layers, heads, kv = shape
            cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                              num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                              max_position_embeddings=2048, tie_word_embeddings=False)
            return LlamaForCausalLM(cfg).to(args.device, dtype).eval()

        target, draft = build(target_shape), build(draft_shape)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(10, vocab, (32,), generator=g).tolist() for _ in range(args.num_prompts)]
        args.model_dir = None
        return target, draft, prompts, label
    models = model_dirs(args.models, ("generator", "draft"))
    args.model_dir = str(Path(models["generator"]).parent)
    target = AutoModelForCausalLM.from_pretrained(models["generator"], dtype=dtype).to(args.device).eval()
    draft = AutoModelForCausalLM.from_pretrained(models["draft"], dtype=dtype).to(args.device).eval()
    from pipeline.engines.hf import load_tokenizer

    tok = load_tokenizer(models["generator"])
    # Bench model directories may carry their own prompts (DIR/prompts.jsonl).
    texts = [row["prompt"] for row in read_prompts(args.prompts or model_prompts(args.models))
             if row["prompt"].strip()]
    if getattr(tok, "chat_template", None):  # as a build formats them (PromptFormatter)
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=True, return_dict=True)["input_ids"] for t in texts[:args.num_prompts]]
    else:
        prompts = [tok(t).input_ids for t in texts[:args.num_prompts]]
    label = f"{args.model_dir} ({'random tiny models' if args.models == 'tiny' else 'given'})"
    return target, draft, prompts, label


@torch.inference_mode()
def perplexity(model, prompts: list[list[int]], outputs: list[list[int]], device) -> float:
    """exp(mean NLL per generated token) under the target, over all outputs."""
    nll, count = 0.0, 0
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt + out], device=device)
        logp = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float().log_softmax(-1)  # [T, V]
        nll -= float(logp.gather(-1, torch.tensor(out, device=device)[:, None]).sum())
        count += len(out)
    return math.exp(nll / max(count, 1))


def methods(args, vocab_size: int) -> dict[str, tuple]:
    """name -> (kind, settings)."""
    out = {"multinomial": ("beam", {"width": 1}),
           "speculative": ("spec", {"gamma": args.gamma_spec})}
    if args.aded:
        from pipeline.engines.trigram import load_trigram

        aded = ADEDLayerDrafter(ADEDDrafter(load_trigram("", 12)), vocab_size)
        out["speculative_aded"] = ("spec", {"gamma": args.gamma_spec, "aded": aded})
        for ws in (2, 3):
            out[f"dsbd_aded_ws{ws}_g3_t0.9"] = ("dsbd", {"W_S": ws, "gamma": 3, "t": 0.9, "memory": False, "aded": aded})
    for w in range(2, 5):
        out[f"beam_w{w}"] = ("beam", {"width": w})
    grid = GRIDS[args.grid]
    for ws, gamma, t in itertools.product(grid["W_S"], grid["gamma"], grid["t"]):
        out[f"dsbd_ws{ws}_g{gamma}_t{t}"] = ("dsbd", {"W_S": ws, "gamma": gamma, "t": t, "memory": False})
    for ws, gamma, t in itertools.product(grid["W_S"], [2], [0.5, 0.9]):
        out[f"dsbd_mem_ws{ws}_g{gamma}_t{t}"] = ("dsbd", {"W_S": ws, "gamma": gamma, "t": t, "memory": True})
    return out


def run(kind: str, cfg: dict, target, drafter, prompts, seeds, sampling, device) -> tuple[list, DecodeStats]:
    stats, outputs = DecodeStats(), []
    if cfg.get("aded"):
        drafter = cfg["aded"]
    for prompt in prompts:
        if isinstance(drafter, ADEDLayerDrafter):
            drafter.reset()  # every prompt starts from the same (empty) matrix, as in a dsbd build
        for seed in seeds:
            session = TreeSession(target, device)
            if kind == "beam":
                outputs.append(beam_sampling(session, prompt, cfg["width"], sampling, seed, stats=stats))
            elif kind == "spec":
                outputs.append(speculative_decode(session, drafter, prompt, cfg["gamma"], sampling, seed, stats=stats))
            else:
                params = DSBDParams(draft_width=cfg["W_S"], num_draft_layers=cfg["gamma"],
                                    acceptance_threshold=cfg["t"], memory_mode=cfg["memory"])
                outputs.append(dsbd_decode(session, drafter, prompt, params, sampling, seed, stats=stats))
    return outputs, stats


def pareto(points: list[dict]) -> list[dict]:
    """Points no other point beats on both speed (higher) and perplexity (lower), by perplexity."""
    front = [p for p in points if not any(q["tokens_per_s"] >= p["tokens_per_s"] and q["perplexity"] <= p["perplexity"]
                                          and q is not p and (q["tokens_per_s"], q["perplexity"]) != (p["tokens_per_s"], p["perplexity"])
                                          for q in points)]
    return sorted(front, key=lambda p: p["perplexity"])


def plot(plt, results: dict):
    """Tokens/s against perplexity: beam sampling's widths, every DSBD setting and its Pareto front,
    speculative decoding."""
    fig, ax = plt.subplots(figsize=(6, 4))
    beam = [dict(r, name=n) for n, r in results.items() if n.startswith("beam") or n == "multinomial"]
    dsbd = [dict(r, name=n) for n, r in results.items() if n.startswith("dsbd_ws")]
    beam.sort(key=lambda r: r["perplexity"])
    ax.plot([r["tokens_per_s"] for r in beam], [r["perplexity"] for r in beam], "o-", color="orange",
            label="beam sampling (width 1-4)")
    ax.scatter([r["tokens_per_s"] for r in dsbd], [r["perplexity"] for r in dsbd], color="tab:blue", s=12,
               label="DSBD (W_S, gamma, t)")
    front = pareto(dsbd)
    ax.plot([r["tokens_per_s"] for r in front], [r["perplexity"] for r in front], "-", color="tab:blue",
            label="DSBD Pareto front")
    spec = results["speculative"]
    ax.scatter([spec["tokens_per_s"]], [spec["perplexity"]], marker="x", color="red", label="speculative decoding")
    ax.set_xlabel("tokens / s")
    ax.set_ylabel("perplexity under the target (lower is better)")
    ax.legend(fontsize=7)
    return fig


def placement(args, draft_model, target, prompts, seeds, sampling, label) -> dict:
    """One DSBD setting with the drafter in-process vs in a Ray DraftActor."""
    import os

    import ray

    from actors.draft import DraftActor
    from actors.remote import RemoteDrafter

    source = args.model_dir
    if source is None:
        return {"skipped": "the random-init models are not on disk for a DraftActor to load"}
    ray.init(num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": os.getcwd()}})
    try:
        actor = ray.remote(num_cpus=0, num_gpus=1 if args.device.startswith("cuda") else 0)(DraftActor).remote(
            f"{source}/draft", args.device, "bfloat16" if args.device.startswith("cuda") else "float32", 1)
        ray.get(actor.stats.remote())
        drafters = {"colocated": HFDrafter(draft_model, args.device), "actor": RemoteDrafter(actor)}
        cfg = {"W_S": 3, "gamma": 2, "t": 0.9, "memory": False}
        best = dict.fromkeys(drafters, 0.0)
        for _ in range(args.repeats):
            for name, drafter in drafters.items():
                start = time.perf_counter()
                outputs, _ = run("dsbd", cfg, target, drafter, prompts, seeds, sampling, args.device)
                best[name] = max(best[name], sum(map(len, outputs)) / (time.perf_counter() - start))
        return {"setting": "dsbd W_S=3 gamma=2 t=0.9", "tokens_per_s": best,
                "actor_over_colocated": best["actor"] / best["colocated"]}
    finally:
        ray.shutdown()


def main(argv=None) -> int:
    parser = bench_parser("benchmarks.dsbd", __doc__, models="tiny", device="cpu", num_prompts=4,
                          num_samples=dict(default=1, help="seeds per prompt"), max_new_tokens=32, repeats=2,
                          threads=1, prompts=dict(help="prompts JSONL (default: DIR/prompts.jsonl or the demo's)"),
                          json="out/bench/dsbd.json", plot="out/bench/dsbd.png")
    parser.add_argument("--gamma-spec", type=int, default=3, help="draft tokens per step of speculative decoding")
    parser.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    parser.add_argument("--random-large", action="store_true", help="random-init ~1B target, ~100M draft (GPU)")
    parser.add_argument("--random-medium", action="store_true",
                        help="random-init ~40M target, ~0.3M draft: the target dominates the cost, even on a CPU")
    parser.add_argument("--no-ray", action="store_true", help="skip the draft-placement measurement")
    parser.add_argument("--aded", action="store_true", help="also speculative decoding and DSBD with ADED drafts")
    args = parse(parser, argv)
    target, draft_model, prompts, label = load_models(args)
    drafter = HFDrafter(draft_model, args.device)
    sampling = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    seeds = list(range(args.num_samples))
    todo = methods(args, target.config.vocab_size)
    clock = time.perf_counter if args.device.startswith("cuda") else time.process_time
    warm = SamplingParams(max_new_tokens=4, ignore_eos=True)
    for kind, cfg in [todo["multinomial"], todo["speculative"], todo["dsbd_ws2_g2_t0.9"]]:  # warm-up
        run(kind, cfg, target, drafter, prompts[:1], [0], warm, args.device)
    best: dict[str, float] = dict.fromkeys(todo, 0.0)
    results: dict[str, dict] = {}
    for rep in range(args.repeats):
        for name, (kind, cfg) in tqdm(todo.items(), desc=f"repeat {rep + 1}/{args.repeats}", file=sys.stderr):
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            start = clock()
            outputs, stats = run(kind, cfg, target, drafter, prompts, seeds, sampling, args.device)
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
            best[name] = max(best[name], sum(map(len, outputs)) / (clock() - start))
            if rep == 0:  # seeded: every repeat decodes the same tokens
                results[name] = {"kind": kind, **{k: v for k, v in cfg.items() if k != "aded"},
                                 "drafter": "aded" if "aded" in cfg else "draft model", "perplexity": perplexity(target, [p for p in prompts for _ in seeds],
                                                                               outputs, args.device),
                                 "target_forwards_per_token": stats.target_forwards / max(stats.steps, 1),
                                 "avg_accepted_width": stats.beam_steps / max(stats.steps, 1)}
    for name in results:
        results[name]["tokens_per_s"] = best[name]

    beams = {w: results["multinomial" if w == 1 else f"beam_w{w}"] for w in range(1, 5)}
    dsbd = {n: r for n, r in results.items() if n.startswith("dsbd_ws")}
    matched = {}
    for w, beam in beams.items():
        ok = {n: r for n, r in dsbd.items() if r["perplexity"] <= beam["perplexity"]}
        if ok:
            name = max(ok, key=lambda n: ok[n]["tokens_per_s"])
            fewest = min(ok, key=lambda n: ok[n]["target_forwards_per_token"])
            matched[f"beam_w{w}"] = {"dsbd": name, "speedup": ok[name]["tokens_per_s"] / beam["tokens_per_s"],
                                     "beam_perplexity": beam["perplexity"], "dsbd_perplexity": ok[name]["perplexity"],
                                     # Hardware-independent: target passes saved (what memory-bound GPUs turn into time).
                                     "fewest_forwards_dsbd": fewest,
                                     "forward_ratio": beam["target_forwards_per_token"]
                                     / ok[fewest]["target_forwards_per_token"]}
        else:
            matched[f"beam_w{w}"] = {"dsbd": None, "speedup": None, "beam_perplexity": beam["perplexity"]}
    memory_rows = ["multinomial", "speculative"] + [n for n in results if n.startswith("dsbd_mem")]

    print(f"models: {label}; device {args.device}; {len(prompts)} prompts x {len(seeds)} seeds x {args.max_new_tokens} tokens; "
          f"tok/s per {'wall' if args.device.startswith('cuda') else 'CPU'} second")
    print(f"{'method':28s} {'tok/s':>8s} {'fwd/tok':>8s} {'ppl':>9s} {'width':>6s}")
    for name, r in results.items():
        print(f"{name:28s} {r['tokens_per_s']:8.1f} {r['target_forwards_per_token']:8.3f} {r['perplexity']:9.3f} "
              f"{r['avg_accepted_width']:6.2f}")
    print("\nspeed-up at matched perplexity (fastest DSBD with perplexity <= beam sampling's):")
    for key, m in matched.items():
        if m["speedup"] is None:
            print(f"  {key}: no DSBD setting reaches perplexity {m['beam_perplexity']:.3f}")
        else:
            print(f"  {key}: {m['dsbd']} {m['speedup']:.2f}x (ppl {m['dsbd_perplexity']:.3f} vs {m['beam_perplexity']:.3f}); "
                  f"target passes per token {m['forward_ratio']:.2f}x fewer ({m['fewest_forwards_dsbd']})")
    print("\nmemory-constrained (one KV cache row; paper Table 1):")
    for name in memory_rows:
        r = results[name]
        print(f"  {name:26s} ppl {r['perplexity']:9.3f}  tok/s {r['tokens_per_s']:8.1f}  "
              f"fwd/tok {r['target_forwards_per_token']:.3f}")
    placement_result = {"skipped": "--no-ray"}
    if not args.no_ray:
        placement_result = placement(args, draft_model, target, prompts, seeds, sampling, label)
        print(f"\ndraft placement: {json.dumps(placement_result)}")
    write_json(args.json, {"models": label, "device": args.device, "prompts": len(prompts), "samples": len(seeds),
                           "new_tokens": args.max_new_tokens, "results": results, "matched_perplexity": matched,
                           "memory_constrained": {n: results[n] for n in memory_rows}, "placement": placement_result,
                           "dsbd_pareto_front": [n for n, r in dsbd.items() if r in pareto(list(dsbd.values()))]},
               args)
    write_png(args.plot, lambda plt: plot(plt, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
