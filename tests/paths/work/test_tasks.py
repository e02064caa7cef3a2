"""`paths gen-tasks arithmetic`: every family's records have their answer and a right worked
solution, levels 1-2 mix expressions and word problems for any levels list, operands respect
--max-operand, the default mix is the original one, output is seeded, bad options fail clearly."""

from __future__ import annotations

import ast
import json
import operator
import re
from collections import Counter

import pytest
from click.testing import CliRunner

from cli.main import main
from paths.work.tasks import FAMILIES, arithmetic

STEP = re.compile(r"(-?\d+) ([+*-]) (-?\d+) = (-?\d+)\.")
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def safe_eval(text: str) -> int:
    """The value of an expression of integers, +, -, * and parentheses (nothing else parses)."""
    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        assert isinstance(node, ast.Constant) and isinstance(node.value, int), ast.dump(node)
        return node.value
    return ev(ast.parse(text, mode="eval").body)


def check_solution(r: dict) -> list[tuple[int, str, int]]:
    """Every step `a op b = c` is right, chains on the last result, and ends in `Answer: <answer>`."""
    found = STEP.findall(r["solution"])
    assert len(found) == r["level"], r
    assert " ".join(f"{a} {op} {b} = {c}." for a, op, b, c in found) + f" Answer: {r['answer']}" == r["solution"], r
    value = int(found[0][0])
    for a, op, b, c in found:
        assert int(a) == value and {"+": operator.add, "-": operator.sub, "*": operator.mul}[op](int(a), int(b)) == int(c), r
        value = int(c)
    assert str(value) == r["answer"] and re.search(r"Answer:\s*-?\d+$", r["solution"]), r
    return [(int(a), op, int(b)) for a, op, b, _ in found]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_has_its_answer_and_a_right_solution(family):
    records = arithmetic(100, [1, 2, 3, 4, 5], seed=3, families=[family])
    assert {r["family"] for r in records} == {family} and {r["level"] for r in records} == {1, 2, 3, 4, 5}
    for r in records:
        steps = check_solution(r)
        ops = {op for _, op, _ in steps}
        if family == "word":
            assert r["prompt"].count(".") >= r["level"] and all(b == 2 for _, op, b in steps if op == "*"), r
            continue
        expr = re.fullmatch(r"Compute (.*)\. Give the final answer as 'Answer: <number>'\.\n", r["prompt"]).group(1)
        assert safe_eval(expr) == int(r["answer"]), r
        assert ops <= set({"add": "+", "sub": "-", "mul": "*", "mixed": "+-*"}[family]), r
        assert [int(x) for x in re.findall(r"\d+", expr)] == [steps[0][0]] + [b for _, _, b in steps], r


@pytest.mark.parametrize("levels", [[1, 2], [2], [1, 2, 3, 4], [2, 1, 1]])
def test_levels_one_and_two_mix_expressions_and_word_problems(levels):
    records = arithmetic(400, levels)
    for level in {1, 2} & set(levels):
        kinds = Counter(r["family"] for r in records if r["level"] == level)
        assert set(kinds) == {"mixed", "word"} and abs(kinds["word"] - kinds["mixed"]) <= 0.1 * sum(kinds.values()), (level, kinds)
    assert all(r["family"] == "mixed" for r in records if r["level"] > 2)  # the default mix: stories at levels 1-2 only
    four = arithmetic(400, levels, families=["add", "sub", "mul", "word"])
    for level in set(levels):
        kinds = Counter(r["family"] for r in four if r["level"] == level)
        assert set(kinds) == {"add", "sub", "mul", "word"} and max(kinds.values()) - min(kinds.values()) <= 0.1 * sum(kinds.values()), (level, kinds)


def test_default_mix_keeps_the_original_prompts():
    got = [(r["id"], r["prompt"], r["answer"]) for r in arithmetic(3, [1, 2, 3])]
    assert got == [
        ("arith-0-0", "Compute 13 - 2. Give the final answer as 'Answer: <number>'.\n", "11"),
        ("arith-0-1", "Chen has 9 stamps. Chen gives away 5. Then the number of stamps doubles. How many stamps does Chen have now? Give the final answer as 'Answer: <number>'.\n", "8"),
        ("arith-0-2", "Compute 19 + 10 + 6 + 3. Give the final answer as 'Answer: <number>'.\n", "38"),
    ]


def test_max_operand_bounds_every_operand():
    for r in arithmetic(300, [1, 2, 3], families=list(FAMILIES), max_operand=5):
        for i, (a, op, b) in enumerate(check_solution(r)):
            if i == 0:
                assert 1 <= a <= 5, r
            assert (2 if op == "*" else 1) <= b <= 5, r
    default = [check_solution(r) for r in arithmetic(300, [1, 2, 3], families=["add", "sub", "mul", "mixed"])]
    assert max(s[0][0] for s in default) == 20 and max(b for s in default for _, _, b in s) == 12  # today's ranges


def test_same_arguments_give_the_same_records():
    args = dict(n=50, levels=[1, 3], seed=5, families=["add", "word"], max_operand=9)
    assert arithmetic(**args) == arithmetic(**args) != arithmetic(**{**args, "seed": 6})


def test_cli_writes_and_counts_families(tmp_path):
    out = tmp_path / "t.jsonl"
    result = CliRunner().invoke(main, ["gen-tasks", "arithmetic", "--n", "40", "--levels", "1,2", "--families", "add,sub,mul,word", "--max-operand", "9", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "add 10, sub 10, mul 10, word 10" in result.output
    assert out.read_text() == "".join(json.dumps(r) + "\n" for r in arithmetic(40, [1, 2], 0, ["add", "sub", "mul", "word"], 9))


@pytest.mark.parametrize("args, message", [
    (["--families", "add,div"], "--families 'add,div' has unknown 'div': choose from add, sub, mul, mixed, word"),
    (["--families", ","], "has no family"),
    (["--max-operand", "1"], "--max-operand must be >= 2, got 1"),
])
def test_bad_options_fail_with_one_line(tmp_path, args, message):
    result = CliRunner().invoke(main, ["gen-tasks", "arithmetic", "--n", "5", "--out", str(tmp_path / "t.jsonl"), *args])
    assert result.exit_code != 0 and message in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "t.jsonl").exists()
