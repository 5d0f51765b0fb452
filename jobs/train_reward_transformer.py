"""Train a Reward Transformer on the build job's pairs (Bradley-Terry, Eq. 17, or TCRM; optionally DPO).

    bon-train-reward-transformer --pairs URI [--allow-partial] --generator DIR --output DIR [--dpo]
        [--epochs E] [--max-steps N] [--batch-size B] [--learning-rate LR] [--hidden-size H]
        [--objective sla|tcrm [--mc-weight W] [--td-weight W]]
        [--eval-fraction F] [--dpo-steps N] [--dpo-learning-rate LR] [--beta B] [--seed S]
        [--device cpu|cuda] [--storage-option key=value ...]
    (or python -m jobs.train_reward_transformer ...)

--pairs is a directory or prefix of train-*.parquet (a build) or part-*.parquet (local or s3://), one
Parquet file, or a glob; or a reward model build's DIR/reward-data (jobs.fetch_models --retrain): the
judge's pairs of the generator's own training samples, with the token ids it sampled.
A build_dataset output is read through its commit markers: committed shards only, and only once
the build finished (_SUCCESS); --allow-partial reads an unfinished build's committed shards and
prints one line saying how many shards and pairs it read.
--generator is an HF causal LM directory or hub id (a fresh reward channel is attached) or a Reward
Transformer directory (its channel trains on). The policy is frozen unless --dpo, which first
runs TRL's DPOTrainer on the same training split (the paper's setting 2). Writes the Reward
Transformer directory to --output (HF model, tokenizer, reward_channel.safetensors and .json,
training_metrics.json) and prints the loss, held-out pairwise accuracy and AuTRC. User errors
(missing or unreadable pairs) print one line on stderr and exit with code 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from jobs.cli import (add_channel_objective_flags, bars, channel_objective_error, exits_on_interrupt, job_parser,
                      setup_logging)
from pipeline.errors import FetchError, InputError
from pipeline.errors import IncompleteBuild

log = logging.getLogger(__name__)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (module docstring); the Bradley-Terry defaults are the paper's."""
    parser = job_parser("bon-train-reward-transformer", __doc__)
    parser.add_argument("--pairs", required=True, help="pairs Parquet: directory/prefix, file or glob")
    parser.add_argument("--allow-partial", action="store_true",
                        help="read an unfinished build's committed shards (says how many) instead of refusing it")
    parser.add_argument("--generator", required=True,
                        help="the policy (HF causal LM directory or hub id) or a Reward Transformer to start from")
    parser.add_argument("--output", required=True, help="directory to save the Reward Transformer to")
    parser.add_argument("--dpo", action="store_true", help="also train the policy with DPO first (setting 2)")
    parser.add_argument("--epochs", type=int, default=3, help="Bradley-Terry epochs (the paper: 3)")
    parser.add_argument("--max-steps", type=int, default=None, help="cap on Bradley-Terry optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="pairs per step")
    parser.add_argument("--learning-rate", type=float, default=5e-5, help="reward channel LR (the paper: 5e-5)")
    parser.add_argument("--hidden-size", type=int, default=256, help="reward channel width (the paper: 256)")
    add_channel_objective_flags(parser)
    parser.add_argument("--eval-fraction", type=float, default=0.2, help="held-out share for accuracy and AuTRC")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per prompt + response")
    parser.add_argument("--dpo-steps", type=int, default=10, help="with --dpo: DPOTrainer steps")
    parser.add_argument("--dpo-learning-rate", type=float, default=5e-6, help="with --dpo: the policy's LR")
    parser.add_argument("--beta", type=float, default=0.1, help="DPO beta (strength of the pull to the reference)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split, the channel's init and the batches")
    parser.add_argument("--device", default="cpu", help="torch device for the Bradley-Terry steps")
    parser.add_argument("--storage-option", dest="storage_options", action="append", default=[],
                        metavar="KEY=VALUE", help="fsspec/s3fs option for s3:// pairs, e.g. endpoint_url=...")
    return parser.parse_args(argv)


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    error = channel_objective_error(args)
    if error:
        log.error("%s", error)
        return 2
    storage_options = {}
    for item in args.storage_options:
        key, sep, value = item.partition("=")
        if not sep or not key:
            log.error("--storage-option %r: expected key=value", item)
            return 2
        storage_options[key] = value

    # Imported late so --help and input errors stay fast (torch/transformers/trl load slowly).
    from pipeline.training.reward_channel import train_reward_transformer

    try:
        pairs = _pairs(args, storage_options)
    except (InputError, IncompleteBuild, FetchError) as exc:
        log.error("%s", exc)
        return 2
    try:
        from transformers import AutoConfig

        AutoConfig.from_pretrained(args.generator)
    except (OSError, ValueError) as exc:
        log.error("--generator: cannot load %r (%s)", args.generator, str(exc).splitlines()[0])
        return 2
    try:
        metrics = train_reward_transformer(
            pairs, args.generator, args.output, dpo=args.dpo, hidden_size=args.hidden_size, epochs=args.epochs,
            batch_size=args.batch_size, learning_rate=args.learning_rate, max_steps=args.max_steps,
            eval_fraction=args.eval_fraction, max_length=args.max_length, dpo_steps=args.dpo_steps,
            dpo_learning_rate=args.dpo_learning_rate, beta=args.beta, seed=args.seed, device=args.device,
            progress=bars(args), objective=args.objective, mc_weight=args.mc_weight, td_weight=args.td_weight)
    except InputError as exc:
        log.error("%s: %s", args.pairs, exc)
        return 2
    Path(args.output, "training_metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    for key in ("train_loss", "first_loss", "steps", "train_pairs", "eval_pairs", "pairs_dropped_empty", "eval_loss",
                "pairwise_accuracy", "autrc", "dpo_train_loss", "dpo_steps"):
        if key in metrics:
            value = metrics[key]
            print(f"{key}: {value:.4g}" if isinstance(value, float) else f"{key}: {value}")
    print(f"output: {args.output}")
    return 0


def _pairs(args: argparse.Namespace, storage_options: dict):
    """--pairs as a Dataset: a reward model build's DIR/reward-data gives the judge's pairs of its
    training samples (pipeline.training.reward_channel.judged_pair_rows); anything else is Parquet
    pairs (pipeline.training.dpo.load_pairs)."""
    from pipeline.training.dpo import load_pairs

    if "://" not in args.pairs and (Path(args.pairs) / "judged-train.jsonl").exists():
        import datasets

        from pipeline.engines.hf import load_tokenizer
        from pipeline.training.reward_channel import judged_pair_rows

        try:
            tokenizer = load_tokenizer(args.generator)
        except (OSError, ValueError) as exc:
            raise InputError(f"--generator: cannot load {args.generator!r} ({str(exc).splitlines()[0]})") from None
        rows = judged_pair_rows(Path(args.pairs), "train", tokenizer)
        if not rows:
            raise InputError(f"{args.pairs}: the judge tells no two training samples of a prompt apart")
        return datasets.Dataset.from_list(rows)
    return load_pairs(args.pairs, storage_options, token_ids=True, allow_partial=args.allow_partial)


if __name__ == "__main__":
    sys.exit(main())
