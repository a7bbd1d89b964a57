"""``-p``/``-b`` parsing (kvsim/specs.py): every bad spelling is one error before any work,
naming the option, the policy and the parameter."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.specs import parse_budgets, parse_policies
from tests.conftest import make_trace

runner = CliRunner()


@pytest.mark.parametrize("args", [[""], [","], [" , "], ["", ""]])
def test_no_policy_is_an_error_naming_p(args: list[str]) -> None:
    with pytest.raises(ValueError, match=r"no policy given \(-p/--policy\)"):
        parse_policies(args, 0.2)


@pytest.mark.parametrize("arg", ["full,,snapkv", "full,", ",full"])
def test_an_empty_policy_item_is_an_error_naming_p(arg: str) -> None:
    with pytest.raises(ValueError, match=r"-p/--policy .*: empty item"):
        parse_policies([arg], 0.2)


@pytest.mark.parametrize("text", ["0.2,,0.4", "0.2,", ",0.2", "0.2, ,0.4"])
def test_an_empty_budget_item_is_an_error_naming_b(text: str) -> None:
    with pytest.raises(ValueError, match=r"-b/--budget .*: empty item"):
        parse_budgets(text)


@pytest.mark.parametrize(("text", "needle"), [
    ("", "no budget given (-b/--budget)"), (" , ", "no budget given (-b/--budget)"), ("abc", "-b/--budget 'abc': not a number"),
    ("0.2,1.5", "option -b/--budget must be in (0, 1], got 1.5"),
    ("nan", "option -b/--budget must be in (0, 1], got nan"),
])
def test_budget_errors_name_b(text: str, needle: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_budgets(text)
    assert needle in str(info.value)


def test_budgets_as_before() -> None:
    assert parse_budgets(" 0.2, 0.4 ") == [0.2, 0.4]
    assert [s.label for s in parse_policies(["full, snapkv:window=8", "streaming"], 0.2)] == \
        ["full", "snapkv(window=8)", "streaming"]


def test_a_parameter_given_twice_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match=r"-p snapkv:window=5:window=7: window given twice"):
        parse_policies(["snapkv:window=5:window=7"], 0.2)


@pytest.mark.parametrize("salt", ["-1", "-7", "1.5", "True"])
def test_random_salt_is_checked_up_front(salt: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_policies([f"random:salt={salt}"], 0.2)
    assert "random" in str(info.value) and "salt" in str(info.value)
    assert parse_policies(["random:salt=3"], 0.2)[0].params == {"salt": 3}


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_trace(tmp_path_factory.mktemp("t") / "t.kvtrace", steps=4)


@pytest.mark.parametrize(("args", "needles"), [
    (["-p", ""], ["no policy given", "-p"]),
    (["-p", ","], ["no policy given", "-p"]),
    (["-p", "full,,snapkv"], ["-p/--policy", "empty item"]),
    (["-b", "0.2,,0.4"], ["-b/--budget", "empty item"]),
    (["-b", ""], ["no budget given", "-b"]),
    (["-p", "snapkv:window=5:window=7"], ["window given twice"]),
    (["-p", "random:salt=-1"], ["random", "salt must be >= 0, got -1"]),
])
def test_replay_refuses_in_one_line_before_work(trace: Path, tmp_path: Path, args: list[str],
                                                needles: list[str]) -> None:
    out = tmp_path / "out"
    res = runner.invoke(app, ["replay", str(trace), *args, "-o", str(out)])
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), res.output
    assert all(n in lines[0] for n in needles), res.output
    assert not out.exists()
