"""Build the tiny local models the demo and the tests use, deterministically for a seed.

    bon-make-tiny-models --output DIR [--seed 0]    (or python -m jobs.make_tiny_models ...)

Writes DIR/generator (LlamaForCausalLM), DIR/draft (a smaller LlamaForCausalLM with the same
tokenizer) and DIR/reward (LlamaForSequenceClassification, one label), each with its tokenizer,
all through save_pretrained. The tokenizer is a byte-level BPE trained here with `tokenizers`
on a corpus drawn from a small grammar, and carries a chat template, so the chat-template code
paths run too. The weights are random: these models exercise code, they do not mean anything.
The trained bench models (``python -m jobs.bench_models --output DIR``) build on these builders.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

from jobs.cli import bars, exits_on_interrupt, job_parser, setup_logging

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SUBJECTS = ["the battery", "this blender", "the headphones", "my new phone", "the delivery", "the lamp",
            "the keyboard", "this jacket", "the coffee maker", "the app", "the manual", "the camera"]
VERBS = ["works", "broke", "feels", "looks", "arrived", "charges", "sounds", "lasts", "performs", "fits"]
ADVERBS = ["great", "badly", "quickly", "slowly", "fine", "perfectly", "poorly", "well", "oddly", "reliably"]
ASKS = ["Write a review of", "Explain why", "Summarize what you think of", "Describe how", "Tell me if"]


def corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(lines):
        s, v, a = rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(ADVERBS)
        out.append(f"{rng.choice(ASKS)} {s}. {s.capitalize()} {v} {a}, and I would {rng.choice(['buy', 'return', 'keep', 'recommend'])} it.")
    return out


def build_tokenizer(seed: int, vocab_size: int, texts: list[str] | None = None) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts if texts is not None else corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<|user|>", "<|assistant|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 512
    return fast


def llama_config(tok, hidden: int, layers: int, heads: int, kv_heads: int, **extra) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=512,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False, **extra,
    )


def make_tiny_models(output: str | Path, seed: int = 0, vocab_size: int = 512) -> dict[str, Path]:
    output = Path(output)
    tok = build_tokenizer(seed, vocab_size)
    specs = {
        "generator": (LlamaForCausalLM, llama_config(tok, hidden=64, layers=2, heads=4, kv_heads=2)),
        "draft": (LlamaForCausalLM, llama_config(tok, hidden=32, layers=1, heads=2, kv_heads=1)),
        "reward": (LlamaForSequenceClassification, llama_config(tok, hidden=64, layers=2, heads=4, kv_heads=2, num_labels=1)),
    }
    paths = {}
    for offset, (name, (cls, config)) in enumerate(specs.items()):
        torch.manual_seed(seed * 1000 + offset)
        model = cls(config).eval()
        paths[name] = output / name
        model.save_pretrained(paths[name])
        tok.save_pretrained(paths[name])
    return paths


def make_vllm_model(output: str | Path, seed: int = 0, vocab_size: int = 512) -> Path:
    """A tiny generator that vLLM's CPU attention kernels accept (head size 64; the tiny
    generator's 16 is not one of them), with the tiny models' tokenizer: for the vllm-marked tests."""
    output = Path(output)
    tok = build_tokenizer(seed, vocab_size)
    torch.manual_seed(seed * 1000 + 99)
    model = LlamaForCausalLM(llama_config(tok, hidden=128, layers=2, heads=2, kv_heads=1)).eval()
    model.save_pretrained(output)
    tok.save_pretrained(output)
    return output


def models_cli(argv: list[str] | None, prog: str, doc: str, build) -> int:
    """The CLI of a model builder (this job, jobs.bench_models): ``--output DIR [--seed S]``, then
    ``build(output, seed, progress)`` (progress: show bars, only where stderr is a terminal);
    prints the paths it wrote and logs the time it took."""
    parser = job_parser(prog, doc)
    parser.add_argument("--output", required=True, help="directory to write generator/, draft/ and reward/ into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tokenizer corpus and the weights")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    start = time.perf_counter()
    for name, path in build(args.output, args.seed, bars(args)).items():
        print(f"{name}: {path}")
    log.info("built in %.1fs", time.perf_counter() - start)
    return 0


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    return models_cli(argv, "bon-make-tiny-models", __doc__,
                      lambda output, seed, progress: make_tiny_models(output, seed))


if __name__ == "__main__":
    sys.exit(main())
