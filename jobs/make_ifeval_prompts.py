"""Write our verifiable-instruction prompt sets, in the columns of IFEval's data.

    python -m jobs.make_ifeval_prompts [--output configs/prompts] [--seed 0]

Writes ``ifeval-train.jsonl`` (TRAIN_ROWS rows) and ``ifeval-eval.jsonl`` (EVAL_ROWS rows, held
out: built from their own base tasks, none shared with the training set). Each row is one short
everyday base task (written here, for a model as small as SmolLM2-135M-Instruct) followed by 1 to 3
instructions from lm-eval's IFEval registry, each described by its own checker's
``build_description(**kwargs)``, as Google's IFEval generation code does (Zhou et al., 2023,
"Instruction-Following Evaluation for Large Language Models"). Instructions are drawn without the
pairs the registry's conflict table forbids (``INSTRUCTION_CONFLICTS``, made symmetric with its
``conflict_make``), only from pipeline.judge.SUPPORTED, and mostly from the ones a 135M chat model
follows some of the time (INSTRUCTION_WEIGHTS).

Columns, as IFEval's data: ``key`` (int, unique over both files), ``prompt``, ``instruction_id_list``
and ``kwargs`` (one dict per instruction, holding that instruction's own arguments only). The output
depends on --seed alone; the committed files are this job's output at the default seed.
"""

from __future__ import annotations

import json
import logging
import random
import sys
from collections import Counter
from pathlib import Path

from jobs.cli import exits_on_interrupt, job_parser, setup_logging
from pipeline import judge

log = logging.getLogger(__name__)

TRAIN_ROWS = 480
EVAL_ROWS = 64
EVAL_KEY_OFFSET = 100_000
"""Held-out keys start here, so that a key names one row across both files."""

TRAIN_TASKS = (
    "Write a short note to a neighbor asking them to water your plants while you are away.",
    "Describe your favorite season of the year.",
    "Give some tips for staying focused while studying.",
    "Explain why people should drink enough water.",
    "Write a short story about a lost cat finding its way home.",
    "Write an email to a teacher asking for an extension on homework.",
    "Write a product description for a reusable water bottle.",
    "Describe a simple breakfast that is quick to make.",
    "Give some advice for a person starting their first job.",
    "Explain how to plant a tree.",
    "Write a thank-you note to a friend who helped you move.",
    "Describe a busy city street in the morning.",
    "Give some tips for saving money on groceries.",
    "Explain what a rainbow is.",
    "Write a short story about a robot who learns to paint.",
    "Write an email inviting coworkers to a team lunch.",
    "Write a product description for a cozy wool blanket.",
    "Describe the sound of rain on a roof.",
    "Give some tips for getting better sleep.",
    "Explain why exercise is good for the heart.",
    "Write a short note reminding your roommate to buy milk.",
    "Describe a walk in the forest.",
    "Give some tips for keeping a small garden.",
    "Explain how a bicycle works.",
    "Write a short story about a child who finds a secret door.",
    "Write an email to a landlord about a broken heater.",
    "Write a product description for a pair of running shoes.",
    "Describe your ideal weekend.",
    "Give some tips for learning a new language.",
    "Explain why the sky looks blue.",
    "Write a birthday message for a grandmother.",
    "Describe a beach at sunset.",
    "Give some tips for packing a suitcase.",
    "Explain what recycling is and why it matters.",
    "Write a short story about a dragon who is afraid of the dark.",
    "Write an email asking a shop about the opening hours.",
    "Write a product description for a desk lamp.",
    "Describe a cup of hot chocolate on a cold day.",
    "Give some tips for making new friends in a new town.",
    "Explain how bees make honey.",
    "Write a short note to welcome a new neighbor.",
    "Describe a farmers market on a Saturday.",
    "Give some tips for cooking pasta.",
    "Explain why we have seasons.",
    "Write a short story about a boy and his dog at the park.",
    "Write an email to a friend about your summer plans.",
    "Write a product description for a wooden cutting board.",
    "Describe the view from a mountain top.",
    "Give some tips for staying calm before an exam.",
    "Explain how to make a cup of tea.",
    "Write a short apology note for being late to a meeting.",
    "Describe a quiet library.",
    "Give some tips for keeping a room tidy.",
    "Explain what a volcano is.",
    "Write a short story about an old lighthouse keeper.",
    "Write an email to a coach asking to join the team.",
    "Write a product description for a backpack for school.",
    "Describe a snowy morning.",
    "Give some tips for a long car trip.",
    "Explain why sleep is important for children.",
    "Write a congratulations message for a friend who graduated.",
    "Describe your favorite food.",
    "Give some tips for taking care of a puppy.",
    "Explain how clouds form.",
    "Write a short story about a girl who can talk to birds.",
    "Write an email to a neighbor about a lost package.",
    "Write a product description for a ceramic coffee mug.",
    "Describe a birthday party in a park.",
    "Give some tips for writing a good essay.",
    "Explain what the moon is made of.",
    "Write a short note to a coworker thanking them for their help.",
    "Describe a train ride through the countryside.",
    "Give some tips for drinking less coffee.",
    "Explain why trees are important.",
    "Write a short story about a penguin who wants to fly.",
    "Write an email asking a library to renew a book.",
    "Write a product description for a set of colored pencils.",
    "Describe a kitchen that smells of fresh bread.",
    "Give some tips for riding a bike safely in the city.",
    "Explain how a plant grows from a seed.",
    "Write a get-well-soon message for a classmate.",
    "Describe a thunderstorm.",
    "Give some tips for spending less time on the phone.",
    "Explain what a habit is.",
    "Write a short story about two friends building a treehouse.",
    "Write an email to a hotel asking about a late check-in.",
    "Write a product description for a houseplant.",
    "Describe a bakery in the early morning.",
    "Give some tips for a first visit to a museum.",
    "Explain why washing your hands matters.",
    "Write a short note inviting a friend to go hiking.",
    "Describe a river in spring.",
    "Give some tips for cleaning a kitchen quickly.",
    "Explain how a library card works.",
    "Write a short story about a clock that stopped ticking.",
    "Write an email to a team about a change in the meeting time.",
    "Write a product description for a small tent for camping.",
    "Describe a playground after school.",
    "Give some tips for staying warm in winter.",
    "Explain what a budget is.",
    "Write a short thank-you message for a birthday gift.",
    "Describe an autumn afternoon.",
    "Give some tips for eating more vegetables.",
    "Explain why the ocean is salty.",
    "Write a short story about a mouse who lives in a bakery.",
    "Write an email asking a friend to return a borrowed book.",
    "Write a product description for a soft pillow.",
    "Describe a family dinner.",
    "Give some tips for a job interview.",
    "Explain how to wash a car.",
    "Write a short note to a mail carrier to say thank you.",
    "Describe a garden full of flowers.",
    "Give some tips for walking more every day.",
    "Explain what a map is used for.",
    "Write a short story about a snowman who wants to see summer.",
    "Write an email to a club about joining as a new member.",
    "Write a product description for a kitchen timer.",
    "Describe a morning at a busy airport.",
    "Give some tips for reading more books.",
    "Explain why it is good to eat breakfast.",
    "Write a short farewell message for a coworker who is leaving.",
    "Describe a lake in the evening.",
    "Give some tips for planning a small party.",
    "Explain how a refrigerator keeps food cold.",
    "Write a short story about a fox and a crow.",
    "Write an email asking a neighbor to keep the noise down.",
    "Write a product description for a picnic basket.",
    "Describe your favorite place to relax.",
    "Give some tips for keeping plants alive indoors.",
    "Explain what a fever is.",
)
"""Training base tasks, one a line."""

EVAL_TASKS = (
    "Write a short note asking a friend to feed your fish.",
    "Describe a carnival at night.",
    "Give some tips for staying healthy while traveling.",
    "Explain why stars twinkle.",
    "Write a short story about a turtle who enters a race.",
    "Write an email to a dentist to move an appointment.",
    "Write a product description for a folding umbrella.",
    "Describe a hot summer day in the city.",
    "Give some tips for learning to cook.",
    "Explain how a compass works.",
    "Write a thank-you note to a bus driver.",
    "Describe a cozy cabin in the woods.",
    "Give some tips for keeping a journal.",
    "Explain what wind is.",
    "Write a short story about a kite that flies away.",
    "Write an email to a neighbor offering to help with their garden.",
    "Write a product description for a travel mug.",
    "Describe a fishing trip at dawn.",
    "Give some tips for cleaning out a closet.",
    "Explain why people wear seat belts.",
    "Write a short welcome message for a new student in class.",
    "Describe a bookshop on a rainy day.",
    "Give some tips for keeping your phone battery alive longer.",
    "Explain how ice turns into water.",
    "Write a short story about a painter who loses her brush.",
    "Write an email asking a restaurant for a table for four.",
    "Write a product description for a pair of warm gloves.",
    "Describe a school on the first day of the year.",
    "Give some tips for a day at the beach.",
    "Explain what a calendar is for.",
    "Write a short note to a friend who is feeling sad.",
    "Describe a campfire under the stars.",
)
"""Held-out base tasks: none appears in TRAIN_TASKS."""

COMMON_WORDS = ("today", "friend", "simple", "home", "happy", "time", "small", "warm", "water", "easy",
                "morning", "family", "light", "quiet", "fresh")
"""Words a short everyday answer may or may not contain, for the keyword instructions."""
FORBIDDEN_WORDS = ("very", "really", "good", "great", "important", "also", "just", "best", "many", "help",
                   "make", "like")
"""Words small models use often: forbidding them is a real constraint."""
END_PHRASES = ("Any other questions?", "Is there anything else I can help with?", "Thank you for reading",
               "Have a nice day")

INSTRUCTION_WEIGHTS = {
    "change_case:english_lowercase": 3, "change_case:english_capital": 3, "punctuation:no_comma": 3,
    "detectable_format:number_bullet_lists": 3, "detectable_format:title": 3, "startend:quotation": 3,
    "keywords:existence": 3, "keywords:forbidden_words": 3, "keywords:frequency": 3, "startend:end_checker": 3,
    "detectable_content:postscript": 3, "length_constraints:number_words": 3,
    "keywords:letter_frequency": 1, "detectable_format:number_highlighted_sections": 1,
    "length_constraints:number_paragraphs": 1, "detectable_content:number_placeholders": 1,
    "detectable_format:multiple_sections": 1,
}
"""Draw weights: 3 for the instructions a 135M model sometimes follows and sometimes not."""
INSTRUCTIONS_PER_PROMPT = {1: 2, 2: 2, 3: 1}
"""Draw weights of how many instructions a prompt carries."""


def draw_kwargs(instruction_id: str, rng: random.Random) -> dict:
    """The arguments of one instruction, from modest ranges a short answer can meet."""
    choice = rng.choice
    return {
        "detectable_format:number_bullet_lists": lambda: {"num_bullets": choice((2, 3, 4, 5))},
        "keywords:existence": lambda: {"keywords": rng.sample(COMMON_WORDS, choice((1, 2)))},
        "keywords:forbidden_words": lambda: {"forbidden_words": rng.sample(FORBIDDEN_WORDS, choice((1, 2, 3)))},
        "keywords:frequency": lambda: {"keyword": choice(COMMON_WORDS), "frequency": choice((1, 2, 3)),
                                       "relation": choice(("at least", "less than"))},
        "startend:end_checker": lambda: {"end_phrase": choice(END_PHRASES)},
        "detectable_content:postscript": lambda: {"postscript_marker": choice(("P.S.", "P.P.S"))},
        "length_constraints:number_words": lambda: choice(
            ({"num_words": choice((40, 60, 80)), "relation": "less than"},
             {"num_words": choice((20, 30, 50)), "relation": "at least"})),
        "keywords:letter_frequency": lambda: {"letter": choice("aeiostn"), "let_frequency": choice((3, 5, 10)),
                                              "let_relation": choice(("at least", "less than"))},
        "detectable_format:number_highlighted_sections": lambda: {"num_highlights": choice((1, 2))},
        "length_constraints:number_paragraphs": lambda: {"num_paragraphs": choice((2, 3))},
        "detectable_content:number_placeholders": lambda: {"num_placeholders": choice((1, 2))},
        "detectable_format:multiple_sections": lambda: {"section_spliter": choice(("Section", "SECTION")),
                                                        "num_sections": choice((2, 3))},
    }.get(instruction_id, dict)()


def conflicts() -> dict[str, set[str]]:
    """The registry's conflict table made symmetric (on a copy: conflict_make edits its argument)."""
    registry = judge.registry()
    return registry.conflict_make({k: set(v) for k, v in registry.INSTRUCTION_CONFLICTS.items()})


def draw_instructions(rng: random.Random, table: dict[str, set[str]]) -> list[str]:
    """1 to 3 instruction ids, no two in conflict."""
    count = rng.choices(list(INSTRUCTIONS_PER_PROMPT), weights=list(INSTRUCTIONS_PER_PROMPT.values()))[0]
    chosen: list[str] = []
    while len(chosen) < count:
        free = [i for i in INSTRUCTION_WEIGHTS if not any(i in table[c] for c in chosen)]
        if not free:
            break
        chosen.append(rng.choices(free, weights=[INSTRUCTION_WEIGHTS[i] for i in free])[0])
    return chosen


def make_row(key: int, task: str, rng: random.Random, table: dict[str, set[str]]) -> dict:
    """One prompt: the base task, then each instruction's description from its own checker (those
    that end in a multi-line example last, each on a line of its own)."""
    described = []
    for instruction_id in draw_instructions(rng, table):
        checker = judge.registry().INSTRUCTION_DICT[instruction_id](instruction_id)
        description = checker.build_description(**draw_kwargs(instruction_id, rng))
        # kwargs as the checker holds them (keywords sorted, say), not as drawn.
        described.append((instruction_id, description, checker.get_instruction_args() or {}))
    described.sort(key=lambda d: "\n" in d[1])
    prompt = task
    for _, description, _ in described:
        prompt += ("\n" if "\n" in prompt else " ") + description
    return {"key": key, "prompt": prompt, "instruction_id_list": [d[0] for d in described],
            "kwargs": [d[2] for d in described]}


def make_rows(tasks: tuple[str, ...], rows: int, first_key: int, rng: random.Random, seen: set[str]) -> list[dict]:
    """``rows`` prompts cycling through ``tasks`` (each task about equally often), every prompt
    text new (``seen`` holds the texts so far; the evaluation job joins by prompt text)."""
    table, out = conflicts(), []
    while len(out) < rows:
        task = tasks[len(out) % len(tasks)]
        row = make_row(first_key + len(out), task, rng, table)
        if row["prompt"] in seen:
            continue
        # Every row must be checkable: the judge accepts its ids and kwargs.
        judge.ifeval_reward([row["prompt"]], ["x"], [row["instruction_id_list"]], [row["kwargs"]])
        seen.add(row["prompt"])
        out.append(row)
    return out


def make_prompt_sets(seed: int = 0) -> dict[str, list[dict]]:
    """{file name: rows} for the training and held-out sets."""
    if set(TRAIN_TASKS) & set(EVAL_TASKS):
        raise ValueError(f"base tasks in both sets: {sorted(set(TRAIN_TASKS) & set(EVAL_TASKS))}")
    unsupported = set(INSTRUCTION_WEIGHTS) - judge.SUPPORTED
    if unsupported:
        raise ValueError(f"instructions the judge does not support: {sorted(unsupported)}")
    rng, seen = random.Random(seed), set()
    return {"ifeval-train.jsonl": make_rows(TRAIN_TASKS, TRAIN_ROWS, 0, rng, seen),
            "ifeval-eval.jsonl": make_rows(EVAL_TASKS, EVAL_ROWS, EVAL_KEY_OFFSET, rng, seen)}


def base_task(prompt: str) -> str | None:
    """The base task (of TRAIN_TASKS or EVAL_TASKS) that ``prompt`` starts with, the longest one
    where several do; None for a prompt not written by this job. Prompts on one base task are not
    independent draws: an interval over them resamples base tasks (pipeline.judge.accuracy_gain's
    groups)."""
    return max((t for t in TRAIN_TASKS + EVAL_TASKS if prompt.startswith(t)), key=len, default=None)


def write_jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


@exits_on_interrupt()
def main(argv: list[str] | None = None) -> int:
    parser = job_parser("python -m jobs.make_ifeval_prompts", __doc__)
    parser.add_argument("--output", default="configs/prompts",
                        help="directory to write ifeval-train.jsonl and ifeval-eval.jsonl into")
    parser.add_argument("--seed", type=int, default=0, help="the only input of the draw (the committed files: 0)")
    args = parser.parse_args(argv)
    setup_logging(args.log_level)
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        log.error("--output: cannot create %s (%s)", out, exc.strerror)
        return 2
    for name, rows in make_prompt_sets(args.seed).items():
        write_jsonl(out / name, rows)
        counts = Counter(i for row in rows for i in row["instruction_id_list"])
        print(f"{out / name}: {len(rows)} rows, {sum(counts.values())} instructions ("
              + ", ".join(f"{i} {n}" for i, n in counts.most_common()) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
