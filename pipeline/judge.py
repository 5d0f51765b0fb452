"""The judge: IFEval's verifiable-instruction checkers, a judge no one in this project wrote.

IFEval (Zhou et al., 2023, "Instruction-Following Evaluation for Large Language Models",
arXiv:2311.07911) pairs each prompt with instructions whose following a program can verify
("answer with less than 40 words", "do not use any commas", "wrap your entire response in double
quotation marks"). The checkers used here are lm-eval's copy of Google's reference code
(``lm_eval.tasks.ifeval.instructions_registry``, the ``ifeval`` task of lm-evaluation-harness);
``check`` calls them exactly as that task's ``utils.test_instruction_following_strict`` does:

- instruction-level strict accuracy: an instruction is followed when its checker accepts the
  response as is (no stripping of markdown or first/last lines: that is IFEval's "loose" variant);
  an empty or blank response follows nothing;
- prompt-level strict accuracy: a response follows its prompt when it follows every instruction.

``accuracy`` computes both over many judged responses (section 3 of the paper).

Supported instructions (SUPPORTED): the registry's, less the two whose checkers need NLTK's punkt
sentence tokenizer (length_constraints:number_sentences, change_case:capital_word_frequency), since
punkt cannot be downloaded here and lm-eval would try to at import.

Partial responses (``broken``): a prefix has broken an instruction for good when no continuation
can make the checker accept the full response, e.g. a comma under punctuation:no_comma. The reward
function ``ifeval_reward`` scores a final response by the fraction of its instructions followed,
and a partial one by 1 - the fraction broken, an upper bound of every continuation's final score.

The old RubricJudge (the generator's own network plus a rubric) stays at the end of this module
until its last users move off it; it is used in no published quality figure.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import io
import math
import os
import re
import sys
import types
from dataclasses import dataclass

import torch

PUNKT_INSTRUCTIONS = frozenset({"length_constraints:number_sentences", "change_case:capital_word_frequency"})
"""Checkers that tokenize with NLTK's punkt data (not installable here): left out of SUPPORTED."""


@functools.cache
def registry() -> types.ModuleType:
    """lm_eval.tasks.ifeval.instructions_registry, imported without lm_eval/tasks/__init__.py (the
    task manager, which pulls in sacrebleu, datasets and the rest of the harness): a bare package
    module stands in for ``lm_eval.tasks``. instructions_util calls ``nltk.download("punkt_tab")``
    at import and prints when it did; with no network here, the download is replaced by a no-op and
    anything printed during the import is dropped. langdetect (used by the case and language
    checkers) is seeded, as its documentation asks for deterministic results."""
    import langdetect
    import lm_eval
    import nltk

    if "lm_eval.tasks" not in sys.modules:
        tasks = types.ModuleType("lm_eval.tasks")
        tasks.__path__ = [os.path.join(os.path.dirname(lm_eval.__file__), "tasks")]
        sys.modules["lm_eval.tasks"] = tasks
    download, nltk.download = nltk.download, lambda *args, **kwargs: False
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            module = importlib.import_module("lm_eval.tasks.ifeval.instructions_registry")
    finally:
        nltk.download = download
    langdetect.DetectorFactory.seed = 0
    return module


SUPPORTED = frozenset(registry().INSTRUCTION_DICT) - PUNKT_INSTRUCTIONS
"""Instruction ids the judge checks: lm-eval's IFEval registry, less PUNKT_INSTRUCTIONS."""


def _plain(value):
    """A kwargs value as the checkers expect it: Parquet/pandas hand lists back as numpy arrays and
    ints as numpy scalars (``if not keywords`` fails on an array)."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    return list(value) if isinstance(value, tuple) else value


def _instruction(instruction_id: str, kwargs: dict | None, prompt: str | None):
    """A checker with its arguments set, as lm-eval's ifeval utils.test_instruction_following_strict
    builds it: None-valued keys dropped (Parquet gives every row the union of the struct's keys,
    with nulls; lm-eval drops every falsy value, which only differs for an explicit 0 or "", here
    kept), then ``build_description(**kwargs)``, and the prompt passed on when the checker asks for
    one. Unlike lm-eval, a missing argument is an error instead of a random draw, so a judgement
    never depends on the global random state."""
    if instruction_id not in SUPPORTED:
        why = "needs NLTK punkt data, not available here" if instruction_id in PUNKT_INSTRUCTIONS else "unknown"
        raise ValueError(f"instruction {instruction_id!r}: {why} (pipeline.judge.SUPPORTED lists the supported ids)")
    args = {k: _plain(v) for k, v in (kwargs or {}).items() if v is not None}
    checker = registry().INSTRUCTION_DICT[instruction_id](instruction_id)
    expected = set(checker.get_instruction_args_keys())
    if set(args) != expected:
        raise ValueError(f"instruction {instruction_id!r}: kwargs keys {sorted(args)}, expected {sorted(expected)}")
    checker.build_description(**args)
    drawn = checker.get_instruction_args()
    if drawn and "prompt" in drawn and prompt is not None:
        checker.build_description(prompt=prompt)
    return checker


def _checkers(instruction_id_list, kwargs, prompt):
    ids, kwargs = list(instruction_id_list), list(kwargs)
    if len(ids) != len(kwargs):
        raise ValueError(f"{len(ids)} instruction ids but {len(kwargs)} kwargs dicts")
    return [(i, _instruction(i, k, prompt)) for i, k in zip(ids, kwargs)]


def check(response: str, instruction_id_list, kwargs, prompt: str | None = None) -> list[bool]:
    """IFEval strict: per instruction, whether ``response`` follows it (module docstring).
    ``kwargs`` holds one dict per instruction."""
    blank = not response.strip()
    return [not blank and bool(checker.check_following(response))
            for _, checker in _checkers(instruction_id_list, kwargs, prompt)]


def _count_words(text: str) -> int:
    """instructions_util.count_words: NLTK's RegexpTokenizer(r"\w+") tokens, i.e. \w+ runs."""
    return len(re.findall(r"\w+", text))


def _broken(instruction_id: str, checker, prefix: str) -> bool:
    """Whether no continuation of ``prefix`` can satisfy ``checker`` (see ``broken``). Each rule
    holds because the quantity the checker tests can only grow (or stay fixed) as text is appended;
    instructions without such a rule are never broken."""
    if instruction_id == "punctuation:no_comma":
        return "," in prefix
    if instruction_id == "change_case:english_lowercase":
        # str.islower fails as soon as one cased character is not lowercase; with a lowercase
        # letter appended, only such a character can make it fail.
        return not (prefix + "a").islower()
    if instruction_id == "change_case:english_capital":
        return not (prefix + "A").isupper()
    if instruction_id == "startend:quotation":  # the stripped response must open with a double quote
        opening = prefix.lstrip()
        return bool(opening) and opening[0] != '"'
    if instruction_id == "keywords:forbidden_words":
        # A match counts only once the character after it is written: "cat" at the end of the
        # prefix may still become "cats", which \b rejects.
        return any(re.search(r"\b" + word + r"\b(?=[\s\S])", prefix, flags=re.IGNORECASE)
                   for word in checker._forbidden_words)
    if instruction_id == "detectable_format:number_bullet_lists":
        # Each pattern's matches in a prefix are matches of every continuation (a match's last part
        # is ".*$", which extends), so the count only grows.
        bullets = (len(re.findall(r"^\s*\*[^\*].*$", prefix, flags=re.MULTILINE))
                   + len(re.findall(r"^\s*-.*$", prefix, flags=re.MULTILINE)))
        return bullets > checker._num_bullets
    less_than = getattr(checker, "_comparison_relation", None) == "less than"
    if instruction_id == "length_constraints:number_words" and less_than:
        return _count_words(prefix) >= checker._num_words
    if instruction_id == "keywords:frequency" and less_than and re.fullmatch(r"[\w ]+", checker._keyword):
        # Non-overlapping matches of a literal never shrink in number when text is appended.
        return len(re.findall(checker._keyword, prefix, flags=re.IGNORECASE)) >= checker._frequency
    if instruction_id == "keywords:letter_frequency" and less_than:
        return prefix.lower().count(checker._letter) >= checker._frequency
    return False


def broken(partial_response: str, instruction_id_list, kwargs, prompt: str | None = None) -> list[bool]:
    """Per instruction: True when no continuation of ``partial_response`` can follow it (broken for
    good), so that ``check(full)[i]`` is False for every ``full`` that starts with the prefix.
    Never True where some continuation could still follow; False for instructions with no rule."""
    return [_broken(i, checker, partial_response) for i, checker in _checkers(instruction_id_list, kwargs, prompt)]


def prompt_text(prompt) -> str:
    """A TRL prompt as text: a string, or a message list's last user turn."""
    if isinstance(prompt, str):
        return prompt
    return next((m["content"] for m in reversed(list(prompt)) if m["role"] == "user"), "")


def completion_text(completion) -> str:
    """A TRL completion as text: a string, or a message list ([{"role": "assistant", "content": ...}])
    with its contents joined."""
    return completion if isinstance(completion, str) else "".join(m["content"] for m in completion)


def ifeval_reward(prompts, completions, instruction_id_list, kwargs, partial=None, **_) -> list[float]:
    """A reward function with TRL GRPOTrainer's signature (``reward_func(prompts=, completions=,
    **dataset columns)``, one value per completion). A final completion scores the fraction of its
    instructions followed (IFEval strict); with ``partial[i]`` True, completion i is a prefix and
    scores 1 - the fraction of its instructions broken for good, an upper bound of the score of any
    continuation, so that partial and final scores rank on one scale."""
    n = len(completions)
    partial = [False] * n if partial is None else list(partial)
    columns = {"prompts": len(prompts), "instruction_id_list": len(instruction_id_list), "kwargs": len(kwargs),
               "partial": len(partial)}
    wrong = {k: v for k, v in columns.items() if v != n}
    if wrong:
        raise ValueError(f"{n} completions but " + ", ".join(f"{v} {k}" for k, v in wrong.items()))
    rewards = []
    for prompt, completion, ids, args, is_partial in zip(prompts, completions, instruction_id_list, kwargs, partial):
        ids = list(ids)
        if not ids:
            raise ValueError("a row with no instructions: nothing to judge")
        prompt, completion = prompt_text(prompt), completion_text(completion)
        if is_partial:
            # (n - broken) / n, not 1 - broken / n: the same floats as final scores of equal counts.
            rewards.append((len(ids) - sum(broken(completion, ids, args, prompt))) / len(ids))
        else:
            rewards.append(sum(check(completion, ids, args, prompt)) / len(ids))
    return rewards


def accuracy(judgements: list[list[bool]]) -> dict:
    """IFEval's two strict figures over judged responses (one list of per-instruction bools each):
    prompt-level = share of responses following all their instructions, instruction-level = share of
    all instructions followed. NaN over no responses."""
    instructions = [followed for judged in judgements for followed in judged]
    return {"prompt_level_strict": sum(map(all, judgements)) / len(judgements) if judgements else math.nan,
            "instruction_level_strict": sum(instructions) / len(instructions) if instructions else math.nan}


# -- RubricJudge: not a judge of quality ----------------------------------------------------------

COMPLETENESS_WEIGHT = 0.1
COMPLETENESS_FLOOR = -20.0
REPETITION_WEIGHT = 2.0
BREVITY_PENALTY = 1.0
MIN_WORDS = 3
RELEVANCE_FRAME = ("Answer: {response}\n\nQuestion:", " {prompt}")
"""The reverse-direction frame: (context, target); the baseline context has an empty response."""
DESCRIPTION = (
    f"score = relevance + {COMPLETENESS_WEIGHT} * max(log p_end, {COMPLETENESS_FLOOR}) - {REPETITION_WEIGHT} * "
    f"repetition - {BREVITY_PENALTY} * [words < {MIN_WORDS}]; relevance = per-token PMI of the prompt given the "
    "response, (log p(x | 'Answer: y\\n\\nQuestion:') - log p(x | 'Answer: \\n\\nQuestion:')) / |x|; p_end = "
    "probability of EOS right after the response in the chat-formatted conversation; repetition = 1 - distinct / "
    "total word 3-grams; all log-probabilities from the frozen generator (pipeline/judge.py)"
)


@dataclass(frozen=True)
class Rating:
    """One judged response: the rubric's terms and their total."""

    relevance: float
    """Per-token PMI of the prompt given the response (nats)."""
    log_p_end: float
    """log p(EOS | conversation up to the end of the response)."""
    repetition: float
    """Fraction of repeated word 3-grams, in [0, 1)."""
    words: int
    score: float


def repetition(text: str, n: int = 3) -> float:
    """1 - distinct / total word n-grams (0 when the text has fewer than n words)."""
    words = re.findall(r"\w+", text.lower())
    grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def rubric_score(relevance: float, log_p_end: float, repeated: float, words: int) -> float:
    """The rubric's total (RubricJudge's docstring)."""
    return (relevance + COMPLETENESS_WEIGHT * max(log_p_end, COMPLETENESS_FLOOR) - REPETITION_WEIGHT * repeated
            - BREVITY_PENALTY * (words < MIN_WORDS))


class RubricJudge:
    """NOT an independent judge: the generator's own network plus a rubric (below), so a policy
    trained or searched against it can game it. It is used in no quality figure (those come from
    IFEval's checkers, above); its last user is tests/test_fetch_models.py, and it goes when that
    test moves off it.

    A Scorer (pipeline.decoding.protocols.Scorer: ``score(prompts, responses)``) over a frozen
    causal LM and its tokenizer (it needs a chat template for the completeness term; without one the
    conversation is prompt then response).

    The rubric: a fixed, deterministic score of (prompt, response) computed with a frozen causal
    LM (here, the generator itself), used to label preference pairs and to evaluate win rates. It is
    not trained on anything; the reward model (pipeline.training.reward_model) learns from its labels.

    For a prompt x and response y (the text, cut to ``max_response_tokens`` tokens):

        score = relevance + COMPLETENESS_WEIGHT * max(log p_end, COMPLETENESS_FLOOR)
                - REPETITION_WEIGHT * repetition - BREVITY_PENALTY * [words < MIN_WORDS]

    - relevance: pointwise mutual information of the prompt and the response, read in the reverse
      direction, per prompt token: (log p(x | "Answer: y\\n\\nQuestion:") - log p(x | "Answer: \\n\\nQuestion:")) / |x|.
      A response that makes its question predictable is about it; generic or off-topic text earns
      about 0 (the "MMI-bidi" reranking of Li et al., 2016, "A Diversity-Promoting Objective Function
      for Neural Conversation Models", section 4.2: p(source | target) reranks candidates).
    - completeness: p_end, the LM's probability of ending its turn (any EOS id) right after y, read in
      the chat-formatted conversation (user x, assistant y). A response cut at the token cap ends
      mid-sentence and gets p_end near 0 (log p_end about -20 on SmolLM2); a finished one about 1.
      The judge reads text only, so it judges any method's output the same way.
    - repetition: the fraction of repeated word 3-grams, 1 - distinct / total (lowercased ``\\w+``
      words; 0 with fewer than three words).
    - brevity: a fixed penalty for empty or near-empty answers (fewer than MIN_WORDS words).

    Every term is a pure function of the two texts and the frozen LM: no sampling, and batches are
    formed by length in a fixed order, so the same inputs always get the same score.
    """

    def __init__(self, model, tokenizer, batch_size: int = 16, max_response_tokens: int = 256):
        from pipeline.engines.hf import eos_token_ids

        self.model = model.eval()
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.max_response_tokens = max_response_tokens
        self.end_ids = sorted(eos_token_ids(model, tokenizer))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.end_ids[0]
        self.device = next(model.parameters()).device

    @classmethod
    def from_pretrained(cls, name_or_path: str, device: str = "cpu", **kwargs) -> RubricJudge:
        from transformers import AutoModelForCausalLM

        from pipeline.engines.hf import load_tokenizer

        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch.float32).to(device)
        return cls(model, load_tokenizer(name_or_path), **kwargs)

    def score(self, prompts: list[str | list[dict]], responses: list[str]) -> list[float]:
        return [r.score for r in self.rate(prompts, responses)[0]]

    @torch.inference_mode()
    def rate(self, prompts: list[str | list[dict]], responses: list[str]) -> tuple[list[Rating], torch.Tensor]:
        """Every response's Rating, and the LM's final hidden state at the last token of each
        conversation ([N, H]: what a sequence-classification head on the same backbone reads)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
        responses = [self._cut(r) for r in responses]
        relevance = self._relevance(prompts, responses)
        log_p_end, states = self._conversation_pass(prompts, responses)
        ratings = []
        for rel, end, response in zip(relevance, log_p_end, responses):
            words = len(re.findall(r"\w+", response))
            rep = repetition(response)
            ratings.append(Rating(rel, end, rep, words, rubric_score(rel, end, rep, words)))
        return ratings, states

    def conversation(self, prompt: str | list[dict], response: str) -> str:
        """The chat-formatted text (the prompt's turns, then the response as the assistant's), as a
        reward model reads it (pipeline.engines.rewards.RewardScorer.format)."""
        turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if self.tokenizer.chat_template:
            return self.tokenizer.apply_chat_template(turns + [{"role": "assistant", "content": response}],
                                                      tokenize=False)
        return "\n\n".join(m["content"] for m in turns) + response

    def _cut(self, response: str) -> str:
        ids = self.tokenizer(response, add_special_tokens=False).input_ids
        return response if len(ids) <= self.max_response_tokens else self.tokenizer.decode(ids[:self.max_response_tokens])

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False).input_ids

    def _relevance(self, prompts: list[str | list[dict]], responses: list[str]) -> list[float]:
        context, target = RELEVANCE_FRAME
        # A conversation's question is its last user turn.
        asked = [p if isinstance(p, str) else next((m["content"] for m in reversed(p) if m["role"] == "user"), "")
                 for p in prompts]
        targets = {p: self._ids(target.format(prompt=p)) for p in asked}
        empty = self._ids(context.format(response=""))
        baseline = dict(zip(targets, self._target_logp([(empty, targets[p]) for p in targets])))
        conditional = self._target_logp([(self._ids(context.format(response=r)), targets[p])
                                         for p, r in zip(asked, responses)])
        return [(c - baseline[p]) / max(len(targets[p]), 1) for p, c in zip(asked, conditional)]

    def _target_logp(self, rows: list[tuple[list[int], list[int]]]) -> list[float]:
        """Sum of log p(target tokens | context) for each (context ids, target ids)."""
        out = [0.0] * len(rows)
        for batch in self._batches([len(c) + len(t) for c, t in rows]):
            ids, mask = _right_padded([rows[i][0] + rows[i][1] for i in batch], self.pad_id, self.device)  # [B, L]
            hidden = self._base(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
            for b, i in enumerate(batch):
                context, target = rows[i]
                # The vocabulary projection only where a target token is predicted: [T, V], not [L, V].
                logp = self._head(hidden[b, len(context) - 1:len(context) + len(target) - 1]).float().log_softmax(-1)
                out[i] = float(logp[torch.arange(len(target)), torch.tensor(target)].sum())
        return out

    def _conversation_pass(self, prompts: list[str | list[dict]], responses: list[str]) -> tuple[list[float], torch.Tensor]:
        """log p(EOS) right after each response, and the final hidden state at the conversation's
        last token, from one forward pass over the conversation."""
        tail = self._template_tail()
        texts = [self.conversation(p, r) for p, r in zip(prompts, responses)]
        full = [self._ids(t) for t in texts]
        heads = [self._ids(t[:len(t) - len(tail)] if tail and t.endswith(tail) else t) for t in texts]
        log_p_end = [0.0] * len(texts)
        states = torch.zeros(len(texts), self.model.config.hidden_size)
        for batch in self._batches([len(f) for f in full]):
            ids, mask = _right_padded([full[i] for i in batch], self.pad_id, self.device)  # [B, L]
            hidden = self._base(input_ids=ids, attention_mask=mask).last_hidden_state  # [B, L, H]
            rows = torch.arange(len(batch), device=self.device)
            last = torch.tensor([len(full[i]) - 1 for i in batch], device=self.device)
            states[batch] = hidden[rows, last].float().cpu()
            # The response ends where the conversation's tokens stop agreeing with its text cut
            # right after the response (a BPE merge across that boundary moves the read back a token).
            ends = torch.tensor([max(len(os.path.commonprefix([heads[i], full[i]])), 1) - 1 for i in batch],
                                device=self.device)
            logp = self._head(hidden[rows, ends]).float().log_softmax(-1)  # [B, V]
            for i, v in zip(batch, logp[:, self.end_ids].logsumexp(-1).tolist()):
                log_p_end[i] = max(v, -1e4) if math.isfinite(v) else -1e4
        return log_p_end, states

    def _batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices in batches of similar length (less padding), in a fixed order for fixed inputs."""
        order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
        return [order[k:k + self.batch_size] for k in range(0, len(order), self.batch_size)]

    def _template_tail(self) -> str:
        """What the chat template writes after the assistant's content (the same for every response)."""
        sentinel = "\u2063response\u2063"
        text = self.conversation("question", sentinel)
        return text[text.index(sentinel) + len(sentinel):] if sentinel in text else ""

    @property
    def _base(self):
        return getattr(self.model, self.model.base_model_prefix)

    @property
    def _head(self):
        return self.model.get_output_embeddings()


def _right_padded(seqs: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids.to(device), mask.to(device)

