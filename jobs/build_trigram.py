"""Build ADED's tri-gram matrix (Eq. 1) from a text corpus and save it for `strategy.trigram`.

    bon-build-trigram --corpus FILE [FILE ...] --tokenizer DIR --output trigram.npz [--top-t 12]
    (or python -m jobs.build_trigram ...)

Each non-blank line of each corpus file (plain text, or JSONL with a "text" key) is one document,
tokenized with the generator's tokenizer (no special tokens); tri-grams never span two documents.
A missing or unreadable corpus file fails with exit code 2 and one line naming it.
"""

from __future__ import annotations

import json
import logging
import sys

from tqdm.auto import tqdm

from jobs.cli import bars, exits_on_interrupt, job_parser, setup_logging
from pipeline.engines.hf import load_tokenizer
from pipeline.decoding.trigram import TrigramMatrix
from pipeline.engines.trigram import save_trigram

log = logging.getLogger(__name__)


def read_documents(path: str) -> list[str]:
    """The documents of one corpus file: its non-blank lines (a JSONL file: each line's "text")."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            if path.endswith(".jsonl"):
                try:
                    line = json.loads(line)["text"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{path}:{number}: expected a JSON object with a \"text\" key") from None
            docs.append(line)
    return docs


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    parser = job_parser("bon-build-trigram", __doc__)
    parser.add_argument("--corpus", nargs="+", required=True,
                        help="text files (one document per line) or JSONL files (a \"text\" key per line)")
    parser.add_argument("--tokenizer", required=True, help="the generator's tokenizer (or model) directory or hub id")
    parser.add_argument("--output", required=True, help="where to save the matrix (.npz)")
    parser.add_argument("--top-t", type=int, default=12, help="continuations kept per context (paper: 12)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    try:
        docs = [doc for path in args.corpus for doc in read_documents(path)]
        tokenizer = load_tokenizer(args.tokenizer)
    except (OSError, ValueError) as exc:
        log.error("%s", str(exc).splitlines()[0])
        return 2
    log.info("tokenizing %d documents", len(docs))
    sequences = [tokenizer(doc, add_special_tokens=False).input_ids
                 for doc in tqdm(docs, desc="tokenizing", disable=not bars(args))]
    matrix = TrigramMatrix.from_sequences(sequences, args.top_t)
    save_trigram(matrix, args.output)
    print(f"{len(docs)} documents, {len(matrix.table)} contexts, {len(matrix)} continuations -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
