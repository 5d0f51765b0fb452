"""Prompt sources, validation, stable prompt ids, sharding and prompt formatting.

Sources: JSONL, Parquet (a file, a directory of files, or a glob) or a dataset saved with
``datasets.save_to_disk``; local paths or s3:// URIs through fsspec/s3fs.

A prompt is a string or a conversation in TRL's conversational format: a list of
{"role": "system" | "user" | "assistant", "content": str} messages ending with a user turn (the
chat template is then applied to the whole conversation).

A missing or unreadable file raises InputError (one line naming the file, and the line for
JSONL); the job turns it into exit code 2. A row whose prompt is missing, neither a string nor a
well-formed conversation, blank, or a duplicate of an earlier prompt is never skipped silently: it
becomes a Reject with its reason and its input row number.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.data.storage import filesystem, join, list_files
from pipeline.decoding.protocols import PromptInput


SUFFIXES = (".jsonl", ".json", ".parquet")


class InputError(Exception):
    """Unreadable or missing input: a user error with a one-line message."""


ROLES = ("system", "user", "assistant")


@dataclass
class PromptRow:
    source_row: int
    """0-based row number across the whole input, in read order."""
    prompt: str | list[dict]
    """The prompt text, or a conversation (validated by ``conversation_problem``)."""


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


def conversation_problem(value: list) -> str | None:
    """Why a list is not a usable conversation (None when it is): each message a mapping with a
    role in ROLES and string content, at least one non-blank, the last one a user turn."""
    if not value:
        return "empty conversation"
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            return f"message {i} is not a mapping ({type(message).__name__})"
        if message.get("role") not in ROLES:
            return f"message {i} has role {message.get('role')!r} (expected one of {', '.join(ROLES)})"
        if not isinstance(message.get("content"), str):
            return f"message {i} has no string content"
    if value[-1]["role"] != "user":
        return f"the last message is a {value[-1]['role']} turn, not a user turn"
    if not any(m["content"].strip() for m in value):
        return "every message is blank"
    return None


def _files(uri: str, storage_options: dict, suffixes: tuple[str, ...]) -> tuple[Any, list[str]]:
    try:
        # Underscore-prefixed entries (_rejects/, _markers/) are our own side files, not input.
        fs, _, files = list_files(uri, storage_options,
                                  lambda rel: rel.endswith(suffixes) and not any(p.startswith("_") for p in rel.split("/")))
    except FileNotFoundError:
        raise InputError(f"{uri}: no such file") from None
    if not files:
        raise InputError(f"{uri}: no {'/'.join(suffixes)} files found")
    return fs, files


def _is_saved_dataset(uri: str, storage_options: dict) -> bool:
    fs, path = filesystem(uri, storage_options)
    return fs.isdir(path) and (fs.exists(join(path, "dataset_info.json")) or fs.exists(join(path, "state.json")))


def read_raw_rows(uri: str, column: str, storage_options: dict | None = None) -> list[Any]:
    """The prompt column's values in input order (None where a JSONL row lacks the key)."""
    storage_options = storage_options or {}
    if _is_saved_dataset(uri, storage_options):
        import datasets

        try:
            ds = datasets.load_from_disk(uri, storage_options=storage_options or None)
        except Exception as exc:  # noqa: BLE001 - any load failure is a user input error
            raise InputError(f"{uri}: unreadable saved dataset ({type(exc).__name__}: {exc})") from None
        if isinstance(ds, datasets.DatasetDict):
            raise InputError(f"{uri}: holds splits {list(ds)}; point --prompts at one split's directory")
        if column not in ds.column_names:
            raise InputError(f"{uri}: no column {column!r} (columns: {', '.join(ds.column_names)})")
        return list(ds[column])
    fs, files = _files(uri, storage_options, SUFFIXES)
    values = []
    for f in files:
        if f.endswith((".jsonl", ".json")):
            values.extend(_read_jsonl(fs, f, column))
        elif f.endswith(".parquet"):
            values.extend(_read_parquet(fs, f, column))
        else:
            raise InputError(f"{f}: unsupported input format (expected .jsonl, .json or .parquet)")
    return values


def _read_jsonl(fs, path: str, column: str) -> list[Any]:
    values = []
    try:
        with fs.open(path, "rb") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                    raise InputError(f"{path}:{number}: malformed JSON line ({exc})") from None
                values.append(record.get(column) if isinstance(record, dict) else _NOT_AN_OBJECT)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    return values


def _read_parquet(fs, path: str, column: str) -> list[Any]:
    try:
        with fs.open(path, "rb") as f:
            table = pq.read_table(f)
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (pa.ArrowException, OSError) as exc:
        raise InputError(f"{path}: unreadable Parquet file ({exc})") from None
    if column not in table.column_names:
        raise InputError(f"{path}: no column {column!r} (columns: {', '.join(table.column_names)})")
    return table.column(column).to_pylist()


class _NotAnObject:
    def __repr__(self):
        return "<JSON line is not an object>"


_NOT_AN_OBJECT = _NotAnObject()


def validate(values: list[Any], column: str) -> tuple[list[PromptRow], list[Reject]]:
    """Split raw values into usable prompt rows and rejects (missing, neither a string nor a
    conversation, malformed conversation, blank, duplicate)."""
    rows, rejects, seen = [], [], {}
    for i, value in enumerate(values):
        if value is _NOT_AN_OBJECT:
            rejects.append(Reject(i, "row is not a JSON object", repr(value)))
        elif value is None:
            rejects.append(Reject(i, f"missing prompt (no {column!r} value)", "None"))
        elif isinstance(value, list) and conversation_problem(value):
            rejects.append(Reject(i, f"malformed conversation ({conversation_problem(value)})", repr(value)[:1000]))
        elif not isinstance(value, (str, list)):
            rejects.append(Reject(i, f"prompt is not a string or a conversation ({type(value).__name__})",
                                  repr(value)[:1000]))
        elif isinstance(value, str) and not value.strip():
            rejects.append(Reject(i, "blank prompt", repr(value)[:1000]))
        else:
            pid = prompt_id(value)
            shown = value if isinstance(value, str) else conversation_text(value)
            if pid in seen:
                rejects.append(Reject(i, f"duplicate prompt (same as row {seen[pid]})", shown[:1000], pid))
            else:
                seen[pid] = i
                rows.append(PromptRow(i, value))
    return rows, rejects


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
        if self.use_template:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return text, self.tokenizer(text, add_special_tokens=False).input_ids
        text = raw if isinstance(raw, str) else "\n\n".join(m["content"] for m in messages)
        return text, self.tokenizer(text).input_ids

    def _input(self, row: PromptRow, raw: str | list[dict], text: str, ids: list[int]) -> PromptInput:
        # prompt_id stays that of the input row, truncated or not.
        if isinstance(raw, str):
            return PromptInput(prompt_id(row.prompt), text, raw, ids)
        return PromptInput(prompt_id(row.prompt), text, conversation_text(raw), ids, messages=list(raw))

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
        raw_ids = self.tokenizer(raw, add_special_tokens=False).input_ids
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
