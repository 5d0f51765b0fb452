"""Reward functions for the tests, with the signature of TRL's GRPOTrainer reward functions
(``fn(prompts, completions, partial, **columns) -> list``), named in a config as
``models.reward=tests.reward_functions:NAME``.

Each returns, for partial responses (``partial`` True: a speculative-rejection decision token) and
for final ones, one of: a real score, None (TRL's "no reward for this one"), NaN, inf, or a constant.
The real score is a deterministic hash of the text in [0, 1), so distinct texts rank apart and a
prefix ranks independently of its full response. ``SOMETIMES``: a value is absent for one text in
``EVERY`` (by the same hash), so a batch mixes scored and unscored rows.
"""

from __future__ import annotations

import math
import zlib

EVERY = 3
"""``*_sometimes`` functions: one text in EVERY (by hash) gets no value."""


def text_of(completion) -> str:
    """A completion's text: a string, or TRL's conversational ``[{"role": "assistant", "content": ...}]``."""
    return completion if isinstance(completion, str) else completion[0]["content"]


def real_score(text: str) -> float:
    """The score of a text when there is one: a deterministic hash in [0, 1)."""
    return zlib.crc32(text.encode()) / 2**32


def absent_for(text: str) -> bool:
    """Whether a ``*_sometimes`` function gives no value for ``text``."""
    return zlib.crc32(b"absent:" + text.encode()) % EVERY == 0


def _rewards(completions, partial, on_partial, on_final) -> list:
    partial = partial if partial is not None else [False] * len(completions)
    return [(on_partial if cut else on_final)(text_of(c)) for c, cut in zip(completions, partial)]


def _none(text):
    return None


def _nan(text):
    return math.nan


def _inf(text):
    return math.inf


def _constant(text):
    return 0.5


def _none_sometimes(text):
    return None if absent_for(text) else real_score(text)


def _nan_sometimes(text):
    return math.nan if absent_for(text) else real_score(text)


def scored(prompts, completions, partial=None, **columns):
    """A real score for partial and final responses alike."""
    return _rewards(completions, partial, real_score, real_score)


def scored_again(prompts, completions, partial=None, **columns):
    """A second real score, independent of ``scored``'s (another hash): a composite's other component."""
    return _rewards(completions, partial, _second_score, _second_score)


def _second_score(text):
    return zlib.crc32(b"second:" + text.encode()) / 2**32


def none_partial(prompts, completions, partial=None, **columns):
    """None for every partial response (the issue's case), a real final score."""
    return _rewards(completions, partial, _none, real_score)


def none_partial_high_final(prompts, completions, partial=None, **columns):
    """None for every partial response, 1 + a real score for a final one (above any real score): a
    checker that says nothing about prefixes and passes finished responses (issue 49, item 4)."""
    return _rewards(completions, partial, _none, _high)


def _high(text):
    return 1.0 + real_score(text)


def nan_partial(prompts, completions, partial=None, **columns):
    return _rewards(completions, partial, _nan, real_score)


def inf_partial(prompts, completions, partial=None, **columns):
    return _rewards(completions, partial, _inf, real_score)


def constant_partial(prompts, completions, partial=None, **columns):
    """The same partial reward for every row: every row ties with r_cut, so every row goes on."""
    return _rewards(completions, partial, _constant, real_score)


def none_partial_sometimes(prompts, completions, partial=None, **columns):
    """None for some partial responses (``absent_for``), a real score for the others and for finals."""
    return _rewards(completions, partial, _none_sometimes, real_score)


def nan_partial_sometimes(prompts, completions, partial=None, **columns):
    return _rewards(completions, partial, _nan_sometimes, real_score)


def none_final(prompts, completions, partial=None, **columns):
    """A real partial score, None for every final response: every finished candidate is quarantined."""
    return _rewards(completions, partial, real_score, _none)


def nan_final_sometimes(prompts, completions, partial=None, **columns):
    """NaN for some final responses (``absent_for``): exactly those candidates are quarantined."""
    return _rewards(completions, partial, real_score, _nan_sometimes)


def constant_final(prompts, completions, partial=None, **columns):
    """The same final reward for every response: best and worst tie, so no pair."""
    return _rewards(completions, partial, real_score, _constant)


def none_always(prompts, completions, partial=None, **columns):
    return _rewards(completions, partial, _none, _none)


def constant_always(prompts, completions, partial=None, **columns):
    return _rewards(completions, partial, _constant, _constant)


FINAL_ALWAYS_FINITE = {"scored", "scored_again", "none_partial", "none_partial_high_final", "nan_partial",
                       "inf_partial", "constant_partial", "none_partial_sometimes", "nan_partial_sometimes",
                       "constant_final", "constant_always"}
"""The functions whose final rewards are always finite: their builds quarantine nothing."""
FINAL_NEVER_FINITE = {"none_final", "none_always"}
"""The functions whose final rewards are never finite: every finished candidate is quarantined."""
ALL = sorted(FINAL_ALWAYS_FINITE | FINAL_NEVER_FINITE | {"nan_final_sometimes"})


def final_is_finite(name: str, text: str) -> bool:
    """Whether function ``name`` gives the final response ``text`` a finite reward."""
    if name in FINAL_NEVER_FINITE:
        return False
    return name != "nan_final_sometimes" or not absent_for(text)
