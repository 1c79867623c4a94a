"""Reward functions: the entries of training.rewards, loading them, the built-in ones, and what a broken one does."""

from __future__ import annotations

import math

import pytest

from astrai import rewards as builtin
from astrai.common.reward_specs import RewardSpec, parse_rewards
from astrai.trainer.objectives.rewards import RewardError, load_reward, score

PROMPTS = ["What is 2 + 2?", "What is 10 * 100?", "Name a colour."]
FIELDS = {"answer": ["4", "1000", None]}


def test_entries_parse_as_text_or_objects_and_bad_ones_say_which_and_why():
    specs = parse_rewards(["astrai.rewards:exact_answer", {"function": "/data/r.py:brevity", "weight": 0.5}])
    assert specs == (RewardSpec("astrai.rewards:exact_answer"), RewardSpec("/data/r.py:brevity", 0.5))
    assert [spec.name for spec in specs] == ["exact_answer", "brevity"] and parse_rewards(None) == ()
    for bad, message in (
        ("astrai.rewards:exact_answer", "expected a list"),
        (["exact_answer"], "entry 0: function must be 'FILE.py:function'"),
        (["m:not-a-name"], "entry 0: function must be"),
        ([{"function": "m:f", "weight": "one"}], "entry 0: weight must be a finite number, got .one."),
        ([{"function": "m:f", "weight": math.nan}], "weight must be a finite number"),
        ([{"function": "m:f", "scale": 2}], "entry 0: expected 'FILE.py:function'"),
        (["a:f", "b:f"], "two reward functions named f"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_rewards(bad)


def test_a_file_and_a_module_load_and_their_weighted_sum_skips_what_does_not_apply(tmp_path):
    (tmp_path / "my rewards é.py").write_text(
        "def brevity(prompts, completions, **fields):\n    return [1.0 / (1 + len(c)) for c in completions]\n"
    )
    exact = load_reward(RewardSpec("astrai.rewards:exact_answer", 2.0))
    brevity = load_reward(RewardSpec(f"{tmp_path / 'my rewards é.py'}:brevity", 0.5))
    completions = ["2 + 2 = 4", "It is \\boxed{1,000}.", "Blue"]
    scores = score([exact, brevity], PROMPTS, completions, FIELDS)
    assert scores.by_function["exact_answer"] == [1.0, 1.0, None]
    assert scores.by_function["brevity"] == [1 / 10, 1 / 21, 1 / 5]
    assert scores.total == [2.0 + 0.05, 2.0 + 0.5 / 21, 0.1]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("    raise KeyError('answer')", "reward broken raised KeyError: 'answer' \\(on a batch whose first prompt is"),
        ("    return [1.0]", "reward broken returned 1 values for 3 completions"),
        ("    return 1.0", "reward broken returned float values for 3 completions"),
        ("    return [1.0, float('nan'), 0.0]", "gave nan for the completion of prompt 'What is 10 \\* 100\\?'"),
        ("    return [1.0, '1', 0.0]", "gave '1' \\(a str\\) for the completion"),
    ],
)
def test_a_broken_reward_function_stops_with_its_name_and_the_prompt(tmp_path, body, message):
    path = tmp_path / "broken.py"
    path.write_text(f"def broken(prompts, completions, **fields):\n{body}\n")
    with pytest.raises(RewardError, match=message):
        score([load_reward(RewardSpec(f"{path}:broken"))], PROMPTS, ["a", "b", "c"], FIELDS)


def test_functions_that_cannot_be_loaded_are_named(tmp_path):
    (tmp_path / "bad.py").write_text("import no_such_module_here\n")
    for function, message in (
        (f"{tmp_path}/missing.py:f", "is not a file"),
        (f"{tmp_path}/bad.py:f", "failed to load \\(ModuleNotFoundError"),
        ("no_such_module_here:f", "module no_such_module_here cannot be imported"),
        ("astrai.rewards:nothing", "astrai.rewards has no function nothing"),
    ):
        with pytest.raises(RewardError, match=message):
            load_reward(RewardSpec(function))


def test_the_built_in_rewards():
    assert builtin.final_answer("so \\boxed{\\frac{1}{2}} and then") == "\\frac{1}{2}"
    assert builtin.final_answer("<think>x</think><answer> 42 </answer>") == " 42 "
    assert builtin.final_answer("steps...\n#### 1,234\nDone.") == "1,234"
    assert builtin.final_answer("first 3 then 7.5.") == "7.5" and builtin.final_answer(" Paris ") == "Paris"
    assert builtin.final_answer("  ") is None
    assert builtin.normalise(" $1,000.50$. ") == builtin.normalise("2001/2") and builtin.normalise("Paris.") == "paris"
    assert builtin.normalise("4.0") == builtin.normalise("4") == builtin.normalise("4 cm") == builtin.normalise("4%")
    assert builtin.normalise("\u22125") == "-5" and builtin.value_of("1,2,3") is None
    # Exact values: a long integer is not a float.
    assert builtin.normalise("12345678901234567890") != builtin.normalise("12345678901234567891")
    for completion, answer, expected in (
        ("#### 72\nThat's all.", "72", 1.0),  # only the rest of the line after ####
        ("The answer is 1/2.", "0.5", 1.0),
        ("The answer is 5 cm.", "5 cm", 1.0),
        ("So the discount is 50%.", "50%", 1.0),
        ("1,2,3", "123", 0.0),
        ("\\boxed{-7}", "\u22127", 1.0),
    ):
        assert builtin.exact_answer([""], [completion], answer=[answer]) == [expected], (completion, answer)
    assert builtin.exact_answer(PROMPTS, ["4", "#### 1000", "red"], **FIELDS) == [1.0, 1.0, None]
    assert builtin.exact_answer(PROMPTS, ["5", "100", "x"], answer=["4", "1000", "x"]) == [0.0, 0.0, 1.0]
    assert builtin.think_format(
        PROMPTS, ["<think>a\nb</think>\n<answer>4</answer>", "<answer>4</answer>", "<think>a</think> 4"]
    ) == [1.0, 0.0, 0.0]
    assert builtin.length_target(PROMPTS, ["x" * 10, "x" * 15, "x" * 40], target_length=[10, 10, None]) == [
        1.0,
        0.5,
        None,
    ]
    assert builtin.length_target(PROMPTS, ["a", "b", "c"]) == [None, None, None]


def test_what_score_refuses_before_calling_anything(tmp_path):
    path = tmp_path / "exits.py"
    path.write_text("import sys\n\ndef leaves(prompts, completions, **fields):\n    sys.exit(3)\n")
    with pytest.raises(RewardError, match="reward leaves raised SystemExit: 3"):
        score([load_reward(RewardSpec(f"{path}:leaves"))], [], [], {})
    exact = load_reward(RewardSpec("astrai.rewards:exact_answer"))
    with pytest.raises(ValueError, match="two reward functions named exact_answer"):
        score([exact, exact], PROMPTS, ["1", "2", "3"], FIELDS)
    with pytest.raises(RewardError, match="a field named completions"):
        score([exact], PROMPTS, ["1", "2", "3"], {**FIELDS, "completions": [1, 2, 3]})
