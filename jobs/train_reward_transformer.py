"""Train on the build job's pairs: today, the policy's DPO path.

    python -m jobs.train_reward_transformer --pairs URI --model DIR --output DIR [--max-steps N]
        [--batch-size B] [--learning-rate LR] [--beta B] [--seed S] [--storage-option key=value ...]

--pairs is a directory or prefix of part-*.parquet (local or s3://), one Parquet file, or a glob.
The reward channel (a Reward Transformer trained with a Bradley-Terry loss on the same pairs)
comes in a later issue; for now this runs TRL's DPO on the policy and saves it, with its
tokenizer, to --output. User errors (missing or unreadable pairs) print one line on stderr and
exit with code 2.
"""

from __future__ import annotations

import argparse
import sys

from pipeline.data.prompts import InputError


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m jobs.train_reward_transformer",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", required=True, help="pairs Parquet: directory/prefix, file or glob")
    parser.add_argument("--model", required=True, help="policy to start from: model directory or hub id")
    parser.add_argument("--output", required=True, help="directory to save the trained policy to")
    parser.add_argument("--max-steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--learning-rate", type=float, default=5e-6)
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (strength of the pull to the reference)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--storage-option", dest="storage_options", action="append", default=[],
                        metavar="KEY=VALUE", help="fsspec/s3fs option for s3:// pairs, e.g. endpoint_url=...")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    storage_options = {}
    for item in args.storage_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            print(f"error: --storage-option {item!r}: expected key=value", file=sys.stderr)
            return 2
        storage_options[key] = value

    # Imported late so --help and input errors stay fast (torch/transformers/trl load slowly).
    from pipeline.training.dpo import load_pairs, train_dpo

    try:
        pairs = load_pairs(args.pairs, storage_options)
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    metrics = train_dpo(pairs, args.model, args.output, max_steps=args.max_steps, batch_size=args.batch_size,
                        learning_rate=args.learning_rate, beta=args.beta, seed=args.seed)
    for key, value in metrics.items():
        print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    print(f"output: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
