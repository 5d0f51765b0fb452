"""Engine tokens/s divided by HF generate()'s, same model, batch and length, measured in one run.

    python -m benchmarks.engine_vs_generate [--models tiny|DIR | --generator DIR] [--num-samples 16]
        [--max-new-tokens 64] [--repeats 3] [--json FILE]

Both sides sample (temperature 1, no top-k/top-p) --num-samples rows from the same prompt
for exactly --max-new-tokens tokens (EOS is disabled on both sides so lengths match), after one
warm-up run each. Runs alternate between the two so machine noise hits both alike; the best of
--repeats is kept for each. Target: ratio >= 1.0. Writes JSON to --json if given.
"""

from __future__ import annotations

import sys

import torch

from benchmarks import bench_parser, model_dirs, parse, ratio_table, side_by_side, write_json
from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import HFEngine


def run_engine(engine: HFEngine, prompt: list[int], batch: int, new_tokens: int) -> int:
    rows = engine.generate([prompt], batch, list(range(batch)), SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
    return sum(len(r.token_ids) for r in rows)


def run_generate(engine: HFEngine, prompt: list[int], batch: int, new_tokens: int) -> int:
    torch.manual_seed(0)
    ids = torch.tensor([prompt], device=engine.device)
    out = engine.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0, top_p=1.0,
                                temperature=1.0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                num_return_sequences=batch, pad_token_id=engine.pad_id)
    return (out.shape[1] - len(prompt)) * batch


def main(argv=None) -> int:
    parser = bench_parser("benchmarks.engine_vs_generate", __doc__, models="tiny", generator=None, device="cpu",
                          threads=1, num_samples=16, max_new_tokens=64, repeats=3, json=None)
    args = parse(parser, argv)
    model = model_dirs(args.models, ("generator",), generator=args.generator)["generator"]
    engine = HFEngine.from_pretrained(model, device=args.device)
    prompt = engine.tokenizer("Write a review of the coffee maker and tell me if it lasts.").input_ids
    variants = {"engine": lambda: run_engine(engine, prompt, args.num_samples, args.max_new_tokens),
                "generate": lambda: run_generate(engine, prompt, args.num_samples, args.max_new_tokens)}
    for variant in variants.values():  # warm-up
        variant()
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    runs = side_by_side(variants, args.repeats, sync)
    best = {name: max(r.value / r.seconds for r in each) for name, each in runs.items()}
    ratio = ratio_table(best, "generate", "tokens/s", higher_is_better=True)["engine"]
    print(f"engine / generate tokens/s: {ratio:.2f}x (target >= 1.0)")
    write_json(args.json, {"model": model, "batch": args.num_samples, "new_tokens": args.max_new_tokens,
                           "device": args.device, "engine_tokens_per_s": round(best["engine"], 1),
                           "generate_tokens_per_s": round(best["generate"], 1), "ratio": ratio}, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
