"""Engine tokens/s divided by HF generate()'s, same model, batch and length, measured in one run.

    python -m benchmarks.engine_vs_generate --model DIR [--batch 16] [--new-tokens 64] [--repeats 3]

Both sides sample (temperature 1, no top-k/top-p) the same number of rows from the same prompt
for exactly --new-tokens tokens (EOS is disabled on both sides so lengths match), after one
warm-up run each. Runs alternate between the two so machine noise hits both alike; the best of
--repeats is kept for each. Target: ratio >= 1.0. Writes JSON to --json if given.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    engine = HFEngine.from_pretrained(args.model, device=args.device)
    prompt = engine.tokenizer("Write a review of the coffee maker and tell me if it lasts.").input_ids
    best = {"engine": 0.0, "generate": 0.0}
    runners = {"engine": run_engine, "generate": run_generate}
    for name, fn in runners.items():  # warm-up
        fn(engine, prompt, args.batch, args.new_tokens)
    for _ in range(args.repeats):
        for name, fn in runners.items():
            start = time.perf_counter()
            tokens = fn(engine, prompt, args.batch, args.new_tokens)
            best[name] = max(best[name], tokens / (time.perf_counter() - start))
    result = {"model": args.model, "batch": args.batch, "new_tokens": args.new_tokens, "device": args.device,
              "engine_tokens_per_s": round(best["engine"], 1), "generate_tokens_per_s": round(best["generate"], 1),
              "ratio": round(best["engine"] / best["generate"], 3)}
    print(json.dumps(result))
    print(f"engine / generate tokens/s: {result['ratio']:.2f}x (target >= 1.0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
