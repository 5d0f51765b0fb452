"""HFEngine decoding throughput: generated tokens per second of one sampling session on CPU.

    python -m benchmarks.hf_throughput --model DIR [--rows 128] [--tokens 128] [--repeats 3] [--threads 2]

Each repeat opens one session of --rows rows (a fixed set of chat prompts, chat template applied,
sampled --rows / prompts times each), extends it to exactly --tokens tokens per row (temperature
1, no top-k/top-p, EOS ignored so every row has the same length) and closes it; tokens/s counts the
generated tokens over the wall clock of open + extend + close, prefill included. A short warm-up
session (8 tokens) runs first. Prints tokens/s per repeat and their median (issue 14 item 6: >= 0.9x vLLM's
CPU backend on the same shape). ``hf_tokens_per_second`` is the same measurement for another
benchmark to call.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

import torch
import transformers

from pipeline.decoding.sampling import SamplingParams
from pipeline.engines.hf import HFEngine

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


def hf_tokens_per_second(model_dir: str, rows: int = 128, tokens: int = 128, repeats: int = 3,
                         threads: int = 2) -> dict:
    """HFEngine's decoding throughput on ``model_dir`` (float32, CPU, ``threads`` threads): one
    warm-up session, then ``repeats`` timed ones; tokens/s of each and their median."""
    torch.set_num_threads(threads)
    engine = HFEngine.from_pretrained(model_dir, device="cpu", dtype="float32")
    prompts = chat_prompts(engine.tokenizer, rows)
    run_session(engine, prompts, rows, min(tokens, 8))  # warm-up
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        generated = run_session(engine, prompts, rows, tokens)
        rates.append(generated / (time.perf_counter() - start))
    return {"model": model_dir, "transformers": transformers.__version__, "rows": rows, "tokens": tokens, "threads": threads,
            "tokens_per_s": [round(r, 1) for r in rates], "median_tokens_per_s": round(statistics.median(rates), 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an HF causal LM directory")
    parser.add_argument("--rows", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=128, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    result = hf_tokens_per_second(args.model, args.rows, args.tokens, args.repeats, args.threads)
    for i, rate in enumerate(result["tokens_per_s"]):
        print(f"repeat {i}: {rate:.1f} tokens/s")
    print(f"median: {result['median_tokens_per_s']:.1f} tokens/s ({args.rows} rows x {args.tokens} tokens)")
    print(json.dumps(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
