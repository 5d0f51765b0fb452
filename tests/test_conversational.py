"""TRL's conversational format, in and out: a prompt column holding conversations (system turns
included) is accepted and templated whole, a malformed message list is a counted reject with its
reason, plain strings keep working, and `data.output_format: conversational` writes pairs that a
real DPOTrainer step reads with no conversion (as it reads the standard format)."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from jobs.build_dataset import main
from pipeline.data.chat import PromptFormatter, PromptRow, prompt_id
from pipeline.data.prompts import conversation_problem, validate
from tests.conftest import GOOD_PROMPTS, write_jsonl

SYSTEM = {"role": "system", "content": "You are a terse product reviewer."}
CONVERSATIONS = [
    [SYSTEM, {"role": "user", "content": GOOD_PROMPTS[0]}],
    [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": GOOD_PROMPTS[1]}],
    [{"role": "user", "content": GOOD_PROMPTS[2]}],
    [SYSTEM, {"role": "user", "content": GOOD_PROMPTS[3]}],
]
MALFORMED = {
    "empty conversation": [],
    "message 0 has no string content": [{"role": "user"}],
    "message 1 has role 'robot'": [{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}],
    "not a user turn": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
    "message 0 is not a mapping": ["just text"],
    "every message is blank": [{"role": "user", "content": "  "}],
}


def test_conversations_validate_and_malformed_ones_are_rejects_with_reasons():
    values = CONVERSATIONS + list(MALFORMED.values()) + ["a plain string prompt", CONVERSATIONS[0]]
    rows, rejects = validate(values, "messages")
    assert [r.source_row for r in rows] == [0, 1, 2, 3, len(values) - 2]
    reasons = {r.source_row: r.reason for r in rejects}
    for i, expected in enumerate(MALFORMED, start=len(CONVERSATIONS)):
        assert reasons[i].startswith("malformed conversation") and expected in reasons[i], reasons[i]
    assert reasons[len(values) - 1].startswith("duplicate prompt (same as row 0)")
    assert conversation_problem(CONVERSATIONS[1]) is None
    # a conversation's id is stable and differs from its last turn's text alone
    assert prompt_id(CONVERSATIONS[2]) == prompt_id(list(CONVERSATIONS[2])) != prompt_id(GOOD_PROMPTS[2])


def test_chat_template_covers_the_whole_conversation_and_long_ones_lose_old_turns(engine):
    formatter = PromptFormatter(engine.tokenizer, 10_000)
    prompt, reject, truncated = formatter.prepare(PromptRow(0, CONVERSATIONS[0]))
    assert reject is None and not truncated and prompt.messages == CONVERSATIONS[0]
    want = engine.tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False, add_generation_prompt=True)
    assert prompt.text == want and SYSTEM["content"] in prompt.text
    assert prompt.reward_input == CONVERSATIONS[0] and json.loads(prompt.raw_prompt) == CONVERSATIONS[0]
    # too long: the oldest non-system turns go first, the system turn and the last turn stay
    long_chat = [SYSTEM] + [{"role": r, "content": "word " * 30} for r in ("user", "assistant")] * 3 + [
        {"role": "user", "content": GOOD_PROMPTS[4]}]
    full = len(formatter.render(long_chat)[1])
    short = len(formatter.render([SYSTEM, long_chat[-1]])[1])
    cut, reject, truncated = PromptFormatter(engine.tokenizer, (full + short) // 2).prepare(PromptRow(5, long_chat))
    assert reject is None and truncated and cut.messages[0] == SYSTEM and cut.messages[-1] == long_chat[-1]
    assert len(cut.messages) < len(long_chat) and len(cut.token_ids) <= (full + short) // 2
    assert cut.prompt_id == prompt_id(long_chat)
    _, reject, _ = PromptFormatter(engine.tokenizer, short - 1).prepare(PromptRow(5, long_chat))
    assert reject is not None and reject.reason == "prompt cannot be truncated to fit"


def test_the_reward_model_reads_the_whole_conversation(scorer):
    text = scorer.format(CONVERSATIONS[1], "Great blender.")
    want = scorer.tokenizer.apply_chat_template(CONVERSATIONS[1] + [{"role": "assistant", "content": "Great blender."}],
                                                tokenize=False)
    assert text == want and "Hello." in text
    assert scorer.format(GOOD_PROMPTS[0], "ok") == scorer.format([{"role": "user", "content": GOOD_PROMPTS[0]}], "ok")
    streamed = scorer.score([CONVERSATIONS[0], CONVERSATIONS[1]], ["Great.", "Bad."])
    scorer.open("conv", [CONVERSATIONS[0], CONVERSATIONS[1]], 1)
    try:
        assert scorer.extend("conv", [0, 1], ["Great.", "Bad."]) == pytest.approx(streamed, abs=1e-4)
    finally:
        scorer.close("conv")


def build(tiny_models, tmp_path, rows, output_format, column="messages"):
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{column: r} for r in rows])
    out = tmp_path / f"out-{output_format}"
    code = main(["--config", "configs/demo.yaml", "--prompts", str(prompts), "--output", str(out),
                 "--set", f"models.generator={tiny_models['generator']}",
                 "--set", f"models.reward={tiny_models['reward']}", "--set", "runtime.local=true",
                 "--set", f"data.prompt_column={column}", "--set", f"data.output_format={output_format}",
                 "--num-samples", "4", "--max-new-tokens", "12", "--set", "strategy.decision_token=4",
                 "--no-progress"])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def builds(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("conversational")
    rows = CONVERSATIONS + [MALFORMED["not a user turn"], GOOD_PROMPTS[5]]
    return {fmt: build(tiny_models, tmp, rows, fmt) for fmt in ("conversational", "standard")}


def test_conversational_output_is_trl_conversational_format(builds):
    out = builds["conversational"]
    table = pq.read_table(out / "train-00000.parquet")
    from pipeline.data.schema import MESSAGES

    assert all(table.schema.field(c).type.equals(MESSAGES) for c in ("prompt", "chosen", "rejected"))
    rows = table.to_pylist()
    assert len(rows) == 5
    by_id = {r["prompt_id"]: r for r in rows}
    for conversation in CONVERSATIONS:
        row = by_id[prompt_id(conversation)]
        assert row["prompt"] == conversation
        assert [m["role"] for m in row["chosen"]] == ["assistant"] == [m["role"] for m in row["rejected"]]
        assert row["chosen"][0]["content"] != row["rejected"][0]["content"]
    plain = by_id[prompt_id(GOOD_PROMPTS[5])]
    assert plain["prompt"] == [{"role": "user", "content": GOOD_PROMPTS[5]}]
    rejects = pq.read_table(out / "_rejects" / "part-00000.parquet").to_pylist()
    assert [(r["source_row"], r["reason"].split(" (")[0]) for r in rejects] == [(4, "malformed conversation")]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["prompts_in"] == 6 and manifest["pairs"] == 5 and manifest["prompts_rejected"] == 1


def test_standard_output_keeps_strings_with_the_conversation_templated(builds, engine):
    rows = pq.read_table(builds["standard"] / "train-00000.parquet").to_pylist()
    by_id = {r["prompt_id"]: r for r in rows}
    row = by_id[prompt_id(CONVERSATIONS[0])]
    assert isinstance(row["prompt"], str) and isinstance(row["chosen"], str)
    assert row["prompt"] == engine.tokenizer.apply_chat_template(CONVERSATIONS[0], tokenize=False,
                                                                 add_generation_prompt=True)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["conversational", "standard"])
def test_a_real_dpo_step_reads_either_format_as_written(builds, tiny_models, tmp_path, fmt):
    from pipeline.training.dpo import load_pairs, train_dpo

    pairs = load_pairs(str(builds[fmt]))
    assert len(pairs) == 5
    metrics = train_dpo(pairs, str(tiny_models["generator"]), str(tmp_path / "policy"), max_steps=2, batch_size=2,
                        learning_rate=1e-3, progress=False)
    assert metrics["steps"] == 2 and metrics["train_loss"] == pytest.approx(metrics["train_loss"])  # finite
    assert "rewards/margins" in metrics
