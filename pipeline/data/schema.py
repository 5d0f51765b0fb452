"""The output's schemas: the pair columns (TRL's standard and conversational formats), the side
files' (rejects, quarantine), and the input's other columns kept beside each pair (ExtraColumns),
unified into one schema per output. That unified schema is part of the build's identity (the
config hash folds in ``ExtraColumns.identity``): a resume that would write another one is refused
(pipeline.build), and ``OutputStore.verify`` checks every committed pair file against it."""

from __future__ import annotations

import json

import pyarrow as pa

PAIR_SCHEMA = pa.schema([
    ("prompt_id", pa.string()),
    ("prompt", pa.string()),
    ("chosen", pa.string()),
    ("rejected", pa.string()),
    ("chosen_score", pa.float64()),
    ("rejected_score", pa.float64()),
    ("chosen_scores", pa.list_(pa.float64())),
    ("rejected_scores", pa.list_(pa.float64())),
    ("strategy", pa.string()),
    ("num_candidates", pa.int64()),
    ("generated_tokens", pa.int64()),
    ("bon_equivalent_tokens", pa.int64()),
    ("rejected_is_partial", pa.bool_()),
    ("chosen_sample", pa.int64()),
    ("rejected_sample", pa.int64()),
    ("stopped_early", pa.int64()),
    ("failed_candidates", pa.int64()),
    ("raw_prompt", pa.string()),
    ("prompt_truncated", pa.bool_()),
    ("source_row", pa.int64()),
    ("prompt_token_ids", pa.list_(pa.int64())),
    ("chosen_token_ids", pa.list_(pa.int64())),
    ("rejected_token_ids", pa.list_(pa.int64())),
])

MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
"""TRL's conversational format: a list of {"role", "content"} messages."""
CONVERSATIONAL_PAIR_SCHEMA = pa.schema([
    field.with_type(MESSAGES) if field.name in ("prompt", "chosen", "rejected") else field for field in PAIR_SCHEMA])
PAIR_SCHEMAS = {"standard": PAIR_SCHEMA, "conversational": CONVERSATIONAL_PAIR_SCHEMA}

CANDIDATE_FIELDS = [
    pa.field("candidate_scores", pa.list_(pa.float64())),
    pa.field("candidate_tokens", pa.list_(pa.int64())),
    pa.field("candidate_stopped_early", pa.list_(pa.bool_())),
]
"""With data.candidate_scores: every candidate of the prompt, by sample index: its score (final
reward, the partial reward at the stop for one stopped early, NaN for a failed one), its generated
tokens and whether speculative rejection stopped it. Best-of-K for any K up to N is then the best of
the first K (row seeds make them the candidates a Best-of-K build samples)."""



class ExtraColumns:
    """The input's other columns in the output (data.extra_columns): their Arrow types, inferred at
    plan time shard by shard and unified (struct fields merged, nulls promoted), so that every part
    file of a build has one schema. A column whose values have no common Arrow type (a number in
    one row, a list in another) is written as JSON text; a column whose name the pair schema
    already uses is left out (the build notes it and the manifest lists it)."""

    def __init__(self, candidates: bool = False):
        self.types: dict[str, pa.DataType] = {}
        self.as_text: set[str] = set()
        self.left_out: set[str] = set()
        self.candidates = candidates
        """data.candidate_scores: the pair rows carry CANDIDATE_FIELDS after the pair columns."""
        self.taken = set(PAIR_SCHEMA.names) | ({f.name for f in CANDIDATE_FIELDS} if candidates else set())

    def add(self, rows: list[dict]) -> None:
        """Fold one shard's rows (each a dict of the row's other columns) into the types."""
        names = list(dict.fromkeys(n for row in rows for n in row))
        for name in names:
            if name in self.taken:
                self.left_out.add(name)
            elif name not in self.as_text:
                self._fold(name, [row.get(name) for row in rows])

    def _fold(self, name: str, values: list) -> None:
        try:
            found = pa.array(values).type
            if name in self.types:
                found = pa.unify_schemas([pa.schema([(name, self.types[name])]), pa.schema([(name, found)])],
                                         promote_options="permissive").field(name).type
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            self.as_text.add(name)
            found = pa.string()
        self.types[name] = found

    def finish(self) -> None:
        """After the last ``add``: a type with an empty struct in it (every row's dict was empty, as
        IFEval's kwargs of instructions without arguments are) cannot be written to Parquet, so
        that column is written as JSON text too."""
        for name, found in self.types.items():
            if _has_empty_struct(found):
                self.as_text.add(name)
                self.types[name] = pa.string()

    def schema(self, base: pa.Schema) -> pa.Schema:
        return pa.schema([*base, *(CANDIDATE_FIELDS if self.candidates else []),
                          *(pa.field(n, t) for n, t in self.types.items())])

    def values(self, columns: dict) -> dict:
        """A pair row's extra columns, from its prompt's (PromptInput.columns)."""
        return {n: json.dumps(columns[n], default=repr) if n in self.as_text and columns.get(n) is not None
                else columns.get(n) for n in self.types}

    def describe(self) -> dict:
        """For the manifest: each column's type (``json text`` for the text fallback); the candidate
        columns first where the build writes them."""
        return {**({f.name: str(f.type) for f in CANDIDATE_FIELDS} if self.candidates else {}),
                **{n: "json text" if n in self.as_text else str(t) for n, t in self.types.items()}}


def _has_empty_struct(found: pa.DataType) -> bool:
    if pa.types.is_struct(found):
        return found.num_fields == 0 or any(_has_empty_struct(found.field(i).type) for i in range(found.num_fields))
    if pa.types.is_list(found) or pa.types.is_large_list(found) or pa.types.is_fixed_size_list(found):
        return _has_empty_struct(found.value_type)
    if pa.types.is_map(found):
        return _has_empty_struct(found.key_type) or _has_empty_struct(found.item_type)
    return False


REJECT_SCHEMA = pa.schema([
    ("source_row", pa.int64()),
    ("prompt_id", pa.string()),
    ("reason", pa.string()),
    ("value", pa.string()),
    ("stage", pa.string()),
    ("generated_tokens", pa.int64()),
    ("bon_equivalent_tokens", pa.int64()),
])

# Candidates with a non-finite reward; score is its repr (nan, inf or -inf).
QUARANTINE_SCHEMA = pa.schema([
    ("source_row", pa.int64()),
    ("prompt_id", pa.string()),
    ("sample", pa.int64()),
    ("score", pa.string()),
    ("stopped_early", pa.bool_()),
    ("text", pa.string()),
])
