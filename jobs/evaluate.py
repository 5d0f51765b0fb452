"""Compare decoding methods against greedy decoding, judged by the labeling reward model.

    python -m jobs.evaluate --model DIR --judge DIR --prompts URI [--methods greedy,temperature,...]
        [--max-new-tokens T] [--max-prompts P] [--num-samples N] [--search-depth D] [--search-width K]
        [--step-size N] [--sla-temperature T] [--seed S] [--device cpu|cuda] [--dtype float32] [--output FILE]

--model is the policy (a Reward Transformer directory for `sla`), --judge the sequence-
classification reward model that labeled the training pairs. Methods: greedy, temperature,
top_p, top_k, beam, sla, sbon (default: all; sla only when the model has a trained reward
channel). Prints win / tie / loss against greedy, the win rate (wins + ties/2, Table 1 of the SLA
paper) and the decoding cost relative to greedy (tokens and wall time), and writes them as JSON
to --output when given. User errors print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys

from pipeline.data.prompts import InputError


def parse_args(argv):
    from pipeline.evaluation import CHOICES

    parser = argparse.ArgumentParser(prog="python -m jobs.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="policy or Reward Transformer directory")
    parser.add_argument("--judge", required=True, help="reward model (sequence classifier) that judges")
    parser.add_argument("--prompts", required=True, help="JSONL/Parquet/saved dataset with a prompt column")
    parser.add_argument("--prompt-column", default="prompt")
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of {','.join(CHOICES)}")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-prompts", type=int, default=None, help="evaluate the first P valid prompts")
    parser.add_argument("--num-samples", type=int, default=8, help="N of speculative rejection")
    parser.add_argument("--search-depth", type=int, default=2, help="SLA d")
    parser.add_argument("--search-width", type=int, default=2, help="SLA k")
    parser.add_argument("--step-size", type=int, default=10, help="SLA n")
    parser.add_argument("--sla-temperature", type=float, default=1.0, help="temperature of SLA's sampled children")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--output", default=None, help="write the report as JSON here")
    return parser.parse_args(argv)


def load_prompts(uri: str, column: str, tokenizer, max_new_tokens: int, limit: int | None):
    from pipeline.data.prompts import PromptFormatter, read_raw_rows, validate

    rows, _ = validate(read_raw_rows(uri, column), column)
    formatter = PromptFormatter(tokenizer, tokenizer.model_max_length - max_new_tokens)
    prompts = [p for p, _, _ in map(formatter.prepare, rows) if p is not None]
    return prompts[:limit] if limit else prompts


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pipeline.config import ConfigError
    from pipeline.decoding.sla import SLAParams
    from pipeline.engines.reward_transformer import has_trained_channel
    from pipeline.evaluation import CHOICES, DEFAULT_METHODS, compare, format_report

    try:
        sla_params = SLAParams(args.search_depth, args.search_width, args.step_size)
        trained = has_trained_channel(args.model)
        if args.methods:
            methods = [m.strip() for m in args.methods.split(",") if m.strip()]
            unknown = [m for m in methods if m not in CHOICES]
            if unknown:
                raise ConfigError(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(CHOICES)}")
            if "sla" in methods and not trained:
                raise ConfigError(f"--model: 'sla' needs a trained reward channel, {args.model!r} has none "
                                  "(train one with python -m jobs.train_reward_transformer)")
        else:
            methods = [m for m in DEFAULT_METHODS if m != "sla" or trained]
            if not trained:
                print(f"note: {args.model} has no trained reward channel; sla skipped", file=sys.stderr)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    from transformers import AutoConfig

    from pipeline.engines.hf import HFEngine
    from pipeline.engines.rewards import RewardScorer

    for flag, path in (("--model", args.model), ("--judge", args.judge)):
        try:
            AutoConfig.from_pretrained(path)
        except (OSError, ValueError) as exc:
            print(f"error: {flag}: cannot load {path!r} ({str(exc).splitlines()[0]})", file=sys.stderr)
            return 2
    engine = HFEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype)
    try:
        prompts = load_prompts(args.prompts, args.prompt_column, engine.tokenizer, args.max_new_tokens, args.max_prompts)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not prompts:
        print(f"error: {args.prompts}: no valid prompts", file=sys.stderr)
        return 2
    judge = RewardScorer.from_pretrained(args.judge, device=args.device, dtype=args.dtype)
    report = compare(engine, judge, prompts, methods, args.max_new_tokens, args.seed, sla_params=sla_params,
                     sla_temperature=args.sla_temperature, num_samples=args.num_samples)
    print(f"{len(prompts)} prompts, judged by {args.judge}, against greedy")
    print(format_report(report))
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"prompts": len(prompts), "model": args.model, "judge": args.judge, "methods": report}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
