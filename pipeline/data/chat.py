"""A prompt as the generator sees it: the validated row (PromptRow) or why it has none (Reject),
its stable id, a conversation's canonical text, and its tokens (encode_text, encode_chat,
PromptFormatter; the reward side tokenizes a prompt the same way).

A prompt is a string or a conversation in TRL's conversational format: a list of
{"role": "system" | "user" | "assistant", "content": str} messages ending with a user turn (the
chat template is then applied to the whole conversation).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from dataclasses import dataclass, field

from pipeline.decoding.domain import PromptInput


@dataclass
class PromptRow:
    source_row: int
    """0-based row number across the whole input, in read order."""
    prompt: str | list[dict]
    """The prompt text, or a conversation (validated by pipeline.data.prompts.conversation_problem)."""
    columns: dict = field(default_factory=dict)
    """The row's other columns read (PromptSource ``extra_columns``)."""


@dataclass
class Reject:
    source_row: int
    reason: str
    value: str
    """The offending value, as text (repr for non-strings), truncated to 1000 characters."""
    prompt_id: str | None = None


def prompt_id(prompt: str | list[dict]) -> str:
    """Stable id of a prompt: the first 16 hex digits of sha256 of its text (of a conversation:
    of its canonical JSON, ``conversation_text``)."""
    text = prompt if isinstance(prompt, str) else conversation_text(prompt)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def conversation_text(messages: list[dict]) -> str:
    """A conversation as canonical JSON: the raw_prompt column and the id's input."""
    return json.dumps([{"role": m["role"], "content": m["content"]} for m in messages], ensure_ascii=False)


def encode_text(tokenizer, text: str, add_special_tokens: bool = False) -> list[int]:
    """Token ids of user (or model) text as plain text: a special token's string inside it, such as
    "<|im_start|>system", is split into ordinary tokens, never read as the special token itself."""
    if not text:
        return []
    return tokenizer(text, add_special_tokens=add_special_tokens, split_special_tokens=True).input_ids


def encode_chat(tokenizer, messages: list[dict], add_generation_prompt: bool) -> tuple[str, list[int]]:
    """(the chat template's text for ``messages``, its token ids), where only the template makes
    special tokens: every message's content is encoded as plain text (``encode_text``).

    Tokenizing the rendered text would parse a special token's string inside a prompt, so a prompt
    holding "<|im_end|>" then "<|im_start|>system ..." would forge a system turn. As chat-serving
    engines do, the template is rendered once with a placeholder for each content: the text between
    placeholders is the template's own and is tokenized as usual (its role and BOS tokens are real),
    the contents are tokenized with special tokens split. The text returned is the real rendering.
    A template that alters a content (``| trim``) is followed when the alteration is a strip;
    otherwise the content is encoded as written (still as plain text)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    contents = [m["content"] for m in messages]
    tag = uuid.uuid4().hex
    while any(tag in c for c in contents):  # a placeholder no content can imitate
        tag = uuid.uuid4().hex
    shell = tokenizer.apply_chat_template([{**m, "content": f"<{tag}:{i}>"} for i, m in enumerate(messages)],
                                          tokenize=False, add_generation_prompt=add_generation_prompt)
    pieces = re.split(f"<{tag}:(\\d+)>", shell)  # [template, index, template, index, ..., template]
    for variant in (contents, [c.strip() for c in contents]):
        if "".join(p if k % 2 == 0 else variant[int(p)] for k, p in enumerate(pieces)) == text:
            contents = variant
            break
    ids: list[int] = []
    for k, piece in enumerate(pieces):
        if k % 2 == 0:
            ids += tokenizer(piece, add_special_tokens=False).input_ids if piece else []
        else:
            ids += encode_text(tokenizer, contents[int(piece)])
    return text, ids


def reward_prompt_tokens(tokenizer, prompt: str | list[dict]) -> int:
    """How many tokens of a reward model's text come before the response: the text that
    pipeline.engines.rewards.RewardScorer.encode builds (the conversation, then the response as the
    assistant's turn, through the chat template; without one, the prompt's text, then the response,
    with the tokenizer's special tokens), less the response and what follows it. That is what a
    reward model reads of the prompt: a streaming reward session once per prompt (its rows' shared
    head), whole-text scoring once with every candidate. Counted as the common prefix of two texts
    that differ in their response only."""
    turns = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)

    def encode(response: str) -> list[int]:
        if getattr(tokenizer, "chat_template", None):
            return encode_chat(tokenizer, turns + [{"role": "assistant", "content": response}],
                               add_generation_prompt=False)[1]
        text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in turns) + "\n\n"
        return encode_text(tokenizer, text + response, add_special_tokens=True)

    first, second = encode("0"), encode("1")
    return next((i for i, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))


class PromptFormatter:
    """Turns a prompt into generator tokens: chat template when the tokenizer has one (and
    chat_template is "auto"), else the raw text (a conversation without a template: its messages'
    contents, one per paragraph). Over-long prompts are truncated or rejected, as configured: a
    string loses the *start* of its text, so the end of the request survives; a conversation loses
    its oldest turns (system turns are kept), and is rejected when its last turn alone is too long."""

    def __init__(self, tokenizer, max_prompt_tokens: int, overlength: str = "truncate", chat_template: str = "auto"):
        if max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens} "
                             "(is max_new_tokens larger than the model's context?)")
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        self.overlength = overlength
        self.use_template = chat_template == "auto" and bool(getattr(tokenizer, "chat_template", None))

    def render(self, raw: str | list[dict]) -> tuple[str, list[int]]:
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
        # The prompt's text is the user's text, never markup: see encode_chat.
        if self.use_template:
            return encode_chat(self.tokenizer, messages, add_generation_prompt=True)
        text = raw if isinstance(raw, str) else "\n\n".join(m["content"] for m in messages)
        return text, encode_text(self.tokenizer, text, add_special_tokens=True)

    def _input(self, row: PromptRow, raw: str | list[dict], text: str, ids: list[int]) -> PromptInput:
        # prompt_id stays that of the input row, truncated or not.
        if isinstance(raw, str):
            return PromptInput(prompt_id(row.prompt), text, raw, ids, columns=row.columns)
        return PromptInput(prompt_id(row.prompt), text, conversation_text(raw), ids, messages=list(raw),
                           columns=row.columns)

    def prepare(self, row: PromptRow) -> tuple[PromptInput | None, Reject | None, bool]:
        """Returns (prompt, None, truncated) or (None, reject, False)."""
        text, ids = self.render(row.prompt)
        if len(ids) <= self.max_prompt_tokens:
            return self._input(row, row.prompt, text, ids), None, False
        shown = row.prompt if isinstance(row.prompt, str) else conversation_text(row.prompt)
        too_long = Reject(row.source_row, f"prompt too long ({len(ids)} tokens > {self.max_prompt_tokens})",
                          shown[:1000], prompt_id(row.prompt))
        if self.overlength == "reject":
            return None, too_long, False
        cut = self._truncate_text(row.prompt) if isinstance(row.prompt, str) else self._drop_turns(row.prompt)
        if cut is None:
            return None, Reject(row.source_row, "prompt cannot be truncated to fit", shown[:1000],
                                prompt_id(row.prompt)), False
        raw, text, ids = cut
        return self._input(row, raw, text, ids), None, True

    def _truncate_text(self, raw: str) -> tuple[str, str, list[int]] | None:
        """Keep the end of the text: the longest tail whose rendering fits."""
        text, ids = self.render(raw)
        raw_ids = encode_text(self.tokenizer, raw)
        overhead = len(ids) - len(raw_ids)
        budget = self.max_prompt_tokens - max(overhead, 0)
        while budget > 0:
            raw = self.tokenizer.decode(raw_ids[-budget:], skip_special_tokens=True)
            text, ids = self.render(raw)
            if len(ids) <= self.max_prompt_tokens and raw.strip():
                return raw, text, ids
            budget -= max(1, len(ids) - self.max_prompt_tokens)
        return None

    def _drop_turns(self, messages: list[dict]) -> tuple[list[dict], str, list[int]] | None:
        """Drop the oldest non-system turns until the conversation fits; its last turn always stays."""
        kept = list(messages)
        while True:
            droppable = [i for i, m in enumerate(kept[:-1]) if m["role"] != "system"]
            if not droppable:
                return None
            del kept[droppable[0]]
            text, ids = self.render(kept)
            if len(ids) <= self.max_prompt_tokens:
                return kept, text, ids
