"""Rewards: exact number reading (each misreading of the float version), gold answers refused
up front, both call conventions with None and bad values, and math-verify on GSM8K / MATH forms."""

from __future__ import annotations

import sys
import threading
from fractions import Fraction

import pytest

from paths.errors import ConfigurationError, DataError
from paths.work.rewards import BUILTIN, Reward, check_answers, extract_answer, format_reward, length_penalty, load_reward, math_answer, parse_number, score


# -- reading numbers ------------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("Answer: 1,234", 1234),                    # was 1
    ("\\boxed{1,234}", 1234),                   # was 234
    ("\\boxed{\\frac{1}{2}}", Fraction(1, 2)),  # was 2
    ("so it is .5", Fraction(1, 2)),            # was 5
    ("Answer: \u22123", -3),                    # U+2212, was 3
    ("Answer: \u20134", -4),                    # en dash
    ("\\boxed{-\\dfrac{3}{4}}", Fraction(-3, 4)),
    ("\\boxed{\\tfrac{-1}{2}}", Fraction(-1, 2)),
    ("\\boxed{\\left(\\frac{1}{2}\\right)} no", None),  # not one number: no guess
    ("\\boxed{x = 5\\text{ cm}}", 5),
    ("\\boxed{1{,}000}", 1000),
    ("\\boxed{2^{10}}", None),                  # not a plain number: no guess at 10
    ("Answer: 3/4", Fraction(3, 4)),
    ("answer is 12 because 3*4", 12),           # after "answer is", not the last number
    ("\\boxed{7} then Answer: 8 and \\boxed{9} and 10", 9),  # the last \boxed wins
    ("Answer: 8, then 10", 8),
    ("first 3 then 7", 7),
    ("1, 2, 3", 3),                             # a list is not 123
    ("1,2345", 2345),                           # not a thousands group
    ("5-3 makes 2", 2),
    ("Answer: -3.5", Fraction(-7, 2)),
    ("it is 12.0", 12),
    ("3/0", None),
    ("nothing", None),
])
def test_extract_answer(text, want):
    assert extract_answer(text) == want and (want is None or isinstance(extract_answer(text), Fraction))


@pytest.mark.parametrize("text, want", [
    ("12", 12), (" 1,234 ", 1234), ("\u22123", -3), (".5", Fraction(1, 2)), ("0.25", Fraction(1, 4)), ("3/4", Fraction(3, 4)),
    ("\\frac{1}{2}", Fraction(1, 2)), ("-\\frac{1}{2}", Fraction(-1, 2)), ("twelve", None), ("1, 2", None), ("12 apples", None), ("", None),
])
def test_parse_number_needs_the_whole_string(text, want):
    assert parse_number(text) == want


def test_math_answer_is_exact():
    got = math_answer(["p"] * 6, ["Answer: 1000001", "Answer: 12", "it is 12.0", "\\boxed{0.5}", "Answer: 13", "Answer: 1,234"],
                      ["1000000", "12", "12", "\\frac{1}{2}", "12", "1234"])
    assert got == [0.0, 1.0, 1.0, 1.0, 0.0, 1.0]
    assert format_reward(["Give 'Answer: <number>'", "use \\boxed{}", "use \\boxed{}"], ["Answer: 1", "Answer: 1", "\\boxed{\\frac{1}{2}}"], [""] * 3) == [1.0, 0.0, 1.0]
    assert length_penalty(["p"] * 3, ["x" * 100, "x" * 300, "x" * 900], [""] * 3) == [0.0, -0.5, -1.0]


# -- gold answers ---------------------------------------------------------------------------------
def test_check_answers_names_the_record():
    rewards = [load_reward("math_answer"), load_reward("format")]
    check_answers(rewards, [{"answer": "12"}, {"answer": "\\frac{1}{2}"}, {"answer": "1,234"}], "rl")
    with pytest.raises(DataError, match=r"^dataset 'rl': record 'arith-0-7' has gold answer 'twelve' that reward 'math_answer' cannot parse: fix the answer field \(a number"):
        check_answers(rewards, [{"id": "arith-0-6", "answer": "3"}, {"id": "arith-0-7", "answer": "twelve"}], "rl")
    with pytest.raises(DataError, match="record 1 has gold answer '7 apples'"):
        check_answers(rewards, [{"answer": "3"}, {"answer": "7 apples"}], "rl")
    with pytest.raises(DataError, match="reward 'math_answer' needs answers but dataset 'X' has none: shard prompts with --answer-field"):
        check_answers(rewards, [{"answer": ""}, {"answer": " "}], "X")
    check_answers([load_reward("format")], [{"answer": "twelve"}], "rl")  # a reward that reads no answers checks none


# -- calling rewards ------------------------------------------------------------------------------
def positional(prompts, completions, answers):
    return [1.0 if c == a else 0.0 for c, a in zip(completions, answers)]


def by_level(prompts, completions, completion_ids, level, **kw):
    assert set(kw) == {"answer", "id"} and len(completion_ids) == len(completions)
    return [float(lv) for lv in level]


def only_named(completions, *, id):  # keyword-only, no **kwargs: gets only what it names
    return [float(len(i)) for i in id]


def some_none(prompts, completions, **kw):
    return [None if c == "skip" else 2.0 for c in completions]


def wants_missing(prompts, completions, completion_ids, difficulty):
    return [0.0] * len(completions)


FIELDS = {"answer": ["a", "b", "c"], "id": ["x", "yy", "zzz"], "level": [1, 2, 3]}
ARGS = (["p"] * 3, ["a", "skip", "q"], [[1], [2, 3], [4]])


def rewards_of(*fns, weight=1.0):
    from paths.work.rewards import Reward

    return [Reward.of(f"tests:{f.__name__}", f, weight) for f in fns]


def test_both_conventions_and_none():
    rs = rewards_of(positional, by_level, only_named, some_none)
    assert [r.keywords for r in rs] == [False, True, True, True] and rs[2].accepts == {"completions", "id"}
    total, means = score(rs, *ARGS, FIELDS)
    assert total == [1 + 1 + 1 + 2, 0 + 2 + 2, 0 + 3 + 3 + 2]  # "skip" gets no value from some_none: the others still count
    assert means == {"tests:positional": 1 / 3, "tests:by_level": 2.0, "tests:only_named": 2.0, "tests:some_none": 2.0}
    assert score(rewards_of(some_none, weight=0.5), *ARGS, FIELDS)[0] == [1.0, 0.0, 1.0]


def test_builtins_load_and_run_through_score():
    assert {"math_answer", "format", "length_penalty", "math_verify"} <= set(BUILTIN)
    total, means = score([load_reward("math_answer=2"), load_reward("format=0.5")], ["Answer: <number>"] * 2, ["Answer: 12", "Answer: 1,234"], [[1], [2]],
                         {"answer": ["12", "1234"], "id": ["a", "b"]})
    assert total == [2.5, 2.5] and means == {"math_answer": 1.0, "format": 1.0}


def all_none(prompts, completions, answers):
    return [None] * len(completions)


def wrong_count(prompts, completions, answers):
    return [1.0]


def nan(prompts, completions, answers):
    return [float("nan")] * len(completions)


def text(prompts, completions, answers):
    return ["good"] * len(completions)


@pytest.mark.parametrize("fn, message", [
    (all_none, r"^reward 'tests:all_none' returned only None for 3 completions: return a float for at least one, or drop it from --reward$"),
    (wrong_count, r"^reward 'tests:wrong_count' returned 1 values for 3 completions: it must return one float"),
    (nan, r"^reward 'tests:nan' returned NaN or infinity: fix the reward function$"),
    (text, r"^reward 'tests:text' returned a value that is not a number"),
    (wants_missing, r"^reward 'tests:wants_missing' takes difficulty but the prompt records have only answer, id, level: add the field"),
])
def test_bad_reward_values(fn, message):
    with pytest.raises(DataError, match=message):
        score(rewards_of(fn), *ARGS, FIELDS)


# -- math-verify ----------------------------------------------------------------------------------
def test_math_verify_without_the_library(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails as if not installed
    with pytest.raises(ConfigurationError, match=r"^--reward math_verify needs the math-verify library: pip install 'paths\[math\]'$"):
        load_reward("math_verify")


def test_math_verify_gsm8k_and_math_forms():
    pytest.importorskip("math_verify")
    fn = load_reward("math_verify").fn
    gsm8k = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"
    completions = ["48 + 24 makes 72, so the answer is \\boxed{72}", "so the answer is \\boxed{73}", "Answer: 12", "$0.5$", "\\boxed{\\sqrt{2}/2}", "\\boxed{1/3}"]
    golds = [gsm8k, "72", "12", "\\frac{1}{2}", "\\frac{\\sqrt2}{2}", "0.5"]
    assert fn(["p"] * 6, completions, golds) == [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    check_answers([load_reward("math_verify")], [{"answer": g} for g in golds], "math")
    with pytest.raises(DataError, match="record 0 has gold answer '' that reward 'math_verify' cannot parse"):
        check_answers([load_reward("math_verify")], [{"answer": ""}, {"answer": "3"}], "math")


def test_math_verify_off_the_main_thread():
    """Its default timeouts use SIGALRM, which a thread may not set: the reward turns them off there."""
    pytest.importorskip("math_verify")
    out: list = []
    worker = threading.Thread(target=lambda: out.append(load_reward("math_verify").fn(["p"], ["\\boxed{\\frac{2}{4}}"], ["0.5"])))
    worker.start()
    worker.join()
    assert out == [[1.0]]


@pytest.mark.parametrize("text, want", [
    ("I will answer 2 questions. Total: 9", Fraction(9)),  # 'answer' as a verb is not 'Answer:'
    ("\\boxed{\\frac12}", Fraction(1, 2)),  # MATH's shorthand
    ("\\boxed{3.}", Fraction(3)),
    ("\\boxed{20} and then \\boxed{}", Fraction(20)),  # the last box that holds a number
])
def test_extract_answer_reads_what_a_review_found(text, want):
    assert extract_answer(text) == want


def test_a_reward_by_name_without_kwargs_and_one_returning_an_array():
    import numpy as np

    def by_name(completions, solution):
        return [float(c == s) for c, s in zip(completions, solution)]

    def array(prompts, completions, answers):
        return np.ones(len(completions))

    total, means = score([Reward.of("by_name", by_name), Reward.of("array", array, 0.5)], ["p", "q"], ["a", "b"], [[1], [2]], {"answer": ["1", "2"], "solution": ["a", "x"]})
    assert total == [1.5, 0.5] and means == {"by_name": 0.5, "array": 1.0}
