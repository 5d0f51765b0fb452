"""The reward model's data: responses the policy itself sampled (Sample) and the judge's verdict on
each (Judgement: IFEval's checkers, pipeline.judge), and the preference pairs they make."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.decoding.sampling import SamplingParams, row_seed
from pipeline.errors import InputError


@dataclass
class Sample:
    """One complete response the policy sampled."""

    prompt: str | list[dict]
    """What the reward model and the judge read before the response (PromptInput.reward_input)."""
    prompt_id: str
    sample: int
    token_ids: list[int]
    """Generated tokens, EOS excluded."""
    text: str
    eos: bool
    """True when the response ended with EOS, False when it reached the token cap."""


@dataclass
class Judgement:
    """The judge's strict verdict on one sample (pipeline.judge.check)."""

    followed: list[bool]
    """Per instruction of the prompt: followed or not (IFEval strict)."""

    @property
    def fraction(self) -> float:
        """Instruction-level: the share of the prompt's instructions followed."""
        return sum(self.followed) / len(self.followed)

    @property
    def all_followed(self) -> bool:
        """Prompt-level: every instruction followed."""
        return all(self.followed)


def sample_responses(engine, prompts, num_samples: int, max_new_tokens: int, temperature: float, seed: int,
                     rows_per_batch: int = 128, progress=None) -> list[Sample]:
    """``num_samples`` seeded samples of each prompt (pipeline.decoding.domain.PromptInput) with
    ``engine`` (an HFEngine), in batches of about ``rows_per_batch`` rows."""
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature)
    per_batch = max(1, rows_per_batch // num_samples)
    out = []
    for start in range(0, len(prompts), per_batch):
        chunk = prompts[start:start + per_batch]
        seeds = [row_seed(seed, p.prompt_id, s) for p in chunk for s in range(num_samples)]
        rows = engine.generate([p.token_ids for p in chunk], num_samples, seeds, sampling)
        for row in rows:
            p = chunk[row.row // num_samples]
            out.append(Sample(p.reward_input, p.prompt_id, row.row % num_samples, list(row.token_ids), row.text,
                              eos=len(row.token_ids) < max_new_tokens))
        if progress is not None:
            progress.update(len(chunk))
    return out


def judge_samples(samples: list[Sample], instructions: dict[str, tuple[list[str], list[dict]]]) -> list[Judgement]:
    """The judge's verdict on each sample; ``instructions`` maps a prompt_id to the prompt's
    (instruction_id_list, kwargs), as in IFEval's data."""
    from pipeline.judge import check

    out = []
    for s in samples:
        ids, kwargs = instructions[s.prompt_id]
        out.append(Judgement(check(s.text, ids, kwargs, s.prompt if isinstance(s.prompt, str) else None)))
    return out


def preference_pairs(groups: list[str], scores: list[float], margin: float) -> list[tuple[int, int]]:
    """(chosen, rejected) index pairs: every two responses of one group (prompt) whose judge
    scores differ, by at least ``margin``; the higher one is chosen."""
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    pairs = []
    for index in members.values():
        for a, i in enumerate(index):
            for j in index[a + 1:]:
                gap = abs(scores[i] - scores[j])
                if gap > 0 and gap >= margin:
                    pairs.append((i, j) if scores[i] > scores[j] else (j, i))
    return pairs


def read_judged(data: Path, split: str) -> tuple[list[Sample], list[float]]:
    """A reward model build's DIR/reward-data samples of ``split`` ("train" or "eval") and the
    judge's instruction-level fraction for each; InputError naming the file when one is missing or
    the verdicts are not on those samples."""
    files = [data / f"samples-{split}.jsonl", data / f"judged-{split}.jsonl"]
    for f in files:
        if not f.exists():
            raise InputError(f"{f}: no such file (a reward model build's DIR/reward-data has it)")
    samples = [Sample(**json.loads(line)) for line in files[0].read_text().splitlines()]
    judged = [json.loads(line) for line in files[1].read_text().splitlines()]
    if [(s.prompt_id, s.sample) for s in samples] != [(j["prompt_id"], j["sample"]) for j in judged]:
        raise InputError(f"{files[1]}: its rows are not the verdicts on {files[0]}'s samples, in order")
    return samples, [sum(j["followed"]) / len(j["followed"]) for j in judged]
