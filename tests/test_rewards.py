import doctest
import textwrap
import threading
import time

import pytest

from deployrl.rewards import grading as rewards, sandbox as reward_sandbox
from deployrl.rewards.grading import (
    REWARDS,
    extract_final_answer,
    format_reward,
    get_reward,
    last_boxed,
    math_reward,
    overlong_penalty,
    reasoning_gym_reward,
)
from deployrl.rewards.sandbox import RewardScores, score_completions


def test_doctests():
    result = doctest.testmod(rewards, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 15
    assert result.failed == 0


@pytest.mark.parametrize(
    "completion, reference, expected",
    [
        (r"The answer is \boxed{1/2}.", "0.5", 1.0),
        (r"The answer is \boxed{1/2}.", r"\frac{1}{2}", 1.0),
        (r"so $x = \boxed{\frac12}$", "1/2", 1.0),
        (r"\boxed{0.5}", r"\dfrac{1}{2}", 1.0),
        (r"\boxed{\frac{2}{4}}", "0.5", 1.0),
        (r"\boxed{0.51}", "0.5", 0.0),
        (r"\boxed{2}", r"\frac{1}{2}", 0.0),
        ("I cannot solve this.", "0.5", 0.0),
        ("", "7", 0.0),
        (r"\boxed{}", "7", 0.0),
        # the last box counts, not the first
        (r"first \boxed{3}, on reflection \boxed{4}", "4", 1.0),
        (r"first \boxed{4}, on reflection \boxed{3}", "4", 0.0),
        # LaTeX with text and units
        (r"She earns \boxed{\$18} a day.", "18", 1.0),
        (r"\boxed{18 \text{ dollars}}", "18", 1.0),
        (r"\boxed{45 \text{ minutes}}", "45", 1.0),
        (r"\boxed{90^\circ}", "90", 1.0),
        (r"\boxed{1,000}", "1000", 1.0),
        (r"\boxed{\text{(C)}}", r"\text{(C)}", 1.0),
        (r"\boxed{\left( 3, \frac{\pi}{2} \right)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"\boxed{(3, \pi/2)}", r"\left( 3, \frac{\pi}{2} \right)", 1.0),
        (r"\boxed{x = 5}", "5", 1.0),
        (r"\boxed{84, 69}", "69, 84", 1.0),
        (r"\boxed{69}", "69, 84", 0.0),
        (r"\boxed{\sqrt{8}}", r"2\sqrt{2}", 1.0),
        # no box: math-verify's own extraction (answer anchors, then the last expression)
        ("So the final answer is 12.", "12", 1.0),
        ("2 + 2 = 4, so the result is 4", "4", 1.0),
        # scientific notation, percentages, numeric references
        (r"\boxed{4.5 \times 10^{33}}", "4.5e33", 1.0),
        (r"\boxed{4.5e33}", r"4.5 \times 10^{33}", 1.0),
        (r"\boxed{4.6 \times 10^{33}}", "4.5e33", 0.0),
        (r"\boxed{4.2}", r"4.2\%", 1.0),
        (r"\boxed{4.2\%}", r"4.2\%", 1.0),
        (r"\boxed{27}", 27.0, 1.0),
        (r"\boxed{27}", 27, 1.0),
        (r"\boxed{b}", ["a", "b"], 1.0),
    ],
)
def test_math_reward_cases(completion, reference, expected):
    assert math_reward(completion, reference) == expected


def test_math_reward_rejects_empty_reference():
    scores = score_completions(math_reward, [r"\boxed{1}", r"\boxed{1}"], ["", None])
    assert scores.values == [0.0, 0.0] and scores.failures == 2


def test_math_reward_from_a_worker_thread():
    out = {}

    def run():
        out["direct"] = math_reward(r"\boxed{\frac{1}{2}}", "0.5")
        out["batch"] = score_completions(math_reward, [r"\boxed{3}", r"\boxed{4}"], ["3", "3"])

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    assert out["direct"] == 1.0
    assert out["batch"].values == [1.0, 0.0]
    assert out["batch"].failures == out["batch"].timeouts == 0


def test_last_boxed_and_final_answer():
    assert last_boxed(r"\boxed{a} and \boxed{\frac{1}{\sqrt{2}}}") == r"\frac{1}{\sqrt{2}}"
    assert last_boxed(r"\fbox{5}") == "5"
    assert last_boxed(r"\boxed{a} then \boxed{unclosed") == "a"
    assert last_boxed("nothing") is None
    assert extract_final_answer("<answer>1</answer> <answer>\n 2 \n</answer>") == "2"
    assert extract_final_answer(r"<answer>x</answer> \boxed{y}") == "x"  # tags win over a box


def test_format_reward():
    assert format_reward(r"thinking... \boxed{x+1}", None) == 1.0
    assert format_reward(r"\boxed{ }", None) == 0.0
    assert format_reward("<answer>3</answer>", None) == 0.0


def test_reasoning_gym_reward_uses_the_dataset_scorer():
    entry = {"question": "Calculate 2 - -1.", "answer": "3", "metadata": {"source_dataset": "basic_arithmetic"}}
    assert reasoning_gym_reward("<answer>3</answer>", entry) == 1.0
    assert reasoning_gym_reward(r"so \boxed{3}", entry) == 1.0
    assert reasoning_gym_reward("<answer>4</answer>", entry) == 0.0
    assert reasoning_gym_reward("2 - -1 = 3", entry) == 1.0  # no tags: the last number
    assert reasoning_gym_reward("<answer>4</answer> and 3", entry) == 0.0  # tags win
    assert reasoning_gym_reward("no idea", entry) == 0.0
    with pytest.raises(ValueError, match="reasoning-gym entry"):
        reasoning_gym_reward("<answer>3</answer>", "3")


def test_overlong_penalty():
    assert overlong_penalty(0, 100, 20) == 0.0
    assert overlong_penalty(80, 100, 20) == 0.0
    assert overlong_penalty(81, 100, 20) == pytest.approx(-0.05)
    assert overlong_penalty(95, 100, 20) == pytest.approx(-0.75)
    assert overlong_penalty(100, 100, 20) == -1.0
    assert overlong_penalty(150, 100, 20) == -1.0
    assert overlong_penalty(100, 100, 0) == 0.0 and overlong_penalty(101, 100, 0) == -1.0
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(10, 100, 200)
    with pytest.raises(ValueError, match="max_length"):
        overlong_penalty(10, 0, 0)


def test_get_reward_names_and_errors():
    assert set(REWARDS.names()) == {"math", "reasoning_gym", "format"}
    assert get_reward("format") is format_reward
    with pytest.raises(ValueError) as err:
        get_reward("fromat")
    assert "Did you mean 'format'" in str(err.value) and "math, reasoning_gym" in str(err.value)
    with pytest.raises(ValueError, match="cannot import module 'no_such_module_xyz'"):
        get_reward("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="module 'deployrl.rewards.grading' has no attribute 'nope'"):
        get_reward("deployrl.rewards.grading:nope")
    with pytest.raises(ValueError, match="not callable"):
        get_reward("deployrl.rewards.grading:REWARDS")
    with pytest.raises(ValueError, match="package.module:function"):
        get_reward(":f")


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A user module with rewards that work, raise, hang (CPU-bound) and return junk."""
    (tmp_path / "my_user_rewards.py").write_text(
        textwrap.dedent(
            """
            def length_reward(completion, reference):
                return float(len(completion) == reference)

            def raising_reward(completion, reference):
                if completion == "bad":
                    raise KeyError("no such thing")
                return 1.0

            def hanging_reward(completion, reference):
                if completion == "hang":
                    while True:
                        pass
                return 1.0

            def dying_reward(completion, reference):
                if completion == "die":
                    import os
                    os._exit(3)
                return 1.0

            def junk_reward(completion, reference):
                return "one" if completion == "junk" else float("nan") if completion == "nan" else 1.0
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return lambda name: get_reward(f"my_user_rewards:{name}")


def test_user_reward_by_import_path(user_rewards):
    scores = score_completions(user_rewards("length_reward"), ["abc", "ab"], [3, 3])
    assert scores == RewardScores(values=[1.0, 0.0], failures=0, timeouts=0)


def test_raising_reward_scores_zero_and_is_counted(user_rewards):
    scores = score_completions(user_rewards("raising_reward"), ["ok", "bad", "ok"], [None] * 3)
    assert scores.values == [1.0, 0.0, 1.0]
    assert scores.failures == 1 and scores.timeouts == 0
    assert "KeyError" in scores.errors[0]


def test_hanging_reward_is_stopped_and_the_run_goes_on(user_rewards):
    fn = user_rewards("hanging_reward")
    scores = score_completions(fn, ["ok", "hang", "ok", "hang"], [None] * 4, timeout_s=1.0)
    assert scores.values == [1.0, 0.0, 1.0, 0.0]
    assert scores.timeouts == 2 and scores.failures == 0
    # the killed workers are replaced
    assert score_completions(fn, ["ok"] * 3, [None] * 3, timeout_s=5.0).values == [1.0] * 3


def test_a_reward_that_kills_its_worker_is_a_failure(user_rewards):
    scores = score_completions(user_rewards("dying_reward"), ["ok", "die", "ok"], [None] * 3)
    assert scores.values == [1.0, 0.0, 1.0] and scores.failures == 1 and scores.timeouts == 0
    assert "worker died" in scores.errors[0]


def test_idle_workers_killed_from_outside_are_replaced(user_rewards):
    fn = user_rewards("length_reward")
    assert score_completions(fn, ["a", "b"], [1, 1]).values == [1.0, 1.0]
    for worker in list(reward_sandbox._pool()._idle):
        worker.proc.kill()
        worker.proc.wait()
    scores = score_completions(fn, ["a", "b", "c"], [1, 1, 1])
    assert scores.values == [1.0] * 3 and scores.failures == 0


def test_non_numeric_rewards_count_as_failures(user_rewards):
    scores = score_completions(user_rewards("junk_reward"), ["junk", "nan", "ok"], [None] * 3)
    assert scores.values == [0.0, 0.0, 1.0] and scores.failures == 2


def test_in_process_fallback_for_unpicklable_functions():
    def closure_reward(completion, reference):  # a local function cannot go to a worker
        if completion == "bad":
            raise ValueError("boom")
        if completion == "slow":
            time.sleep(3)
        return 0.5

    scores = score_completions(closure_reward, ["ok", "bad", "slow"], [None] * 3, timeout_s=0.5)
    assert scores.values == [0.5, 0.0, 0.0]
    assert scores.failures == 1 and scores.timeouts == 1


def test_score_completions_from_a_thread_with_a_user_function(user_rewards):
    out = {}
    fn = user_rewards("hanging_reward")
    thread = threading.Thread(target=lambda: out.update(s=score_completions(fn, ["hang", "ok"], [0, 0], timeout_s=1.0)))
    thread.start()
    thread.join(120)
    assert out["s"].values == [0.0, 1.0] and out["s"].timeouts == 1


def test_score_completions_checks_arguments():
    with pytest.raises(ValueError, match="2 completions but 1 references"):
        score_completions(format_reward, ["a", "b"], [None])
    with pytest.raises(ValueError, match="timeout_s"):
        score_completions(format_reward, ["a"], [None], timeout_s=0)
    assert score_completions(format_reward, [], []) == RewardScores(values=[])


def test_math_grading_that_hangs_is_stopped():
    # sympy needs about 20 s to compare these two polynomials (and forever for some inputs)
    slow = (r"\boxed{(x+1)^{3000}}", "(x+2)^{3000}")
    scores = score_completions(math_reward, [slow[0], r"\boxed{1}"], [slow[1], "1"], timeout_s=1.0)
    # the timeout count shows the grading was stopped: finishing it would have scored 0
    assert scores.values == [0.0, 1.0] and scores.timeouts == 1 and scores.failures == 0
