"""Comma-separated options: one reading for every command, and a list given but empty is a
one-line error, never a traceback or a silent fall back to the default."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from kvsim.commands._options import OptionError
from kvsim.specs import option_items, split_items

runner = CliRunner()


def test_items_of_one_or_repeated_values():
    assert split_items(["a, b", "c"], "-x", "thing") == ["a", "b", "c"]
    assert option_items(" a,b ,c", "--x") == ["a", "b", "c"]
    assert option_items(["a,b", "c"], "--x") == ["a", "b", "c"]


@pytest.mark.parametrize("absent", [None, []])
def test_an_option_not_given_is_no_items(absent):
    assert option_items(absent, "--x") == []


@pytest.mark.parametrize(("given", "needle"), [
    ("", "no gpu given (--gpu)"), (",", "no gpu given (--gpu)"), ([" "], "no gpu given (--gpu)"),
    ("a,,b", "--gpu 'a,,b': empty item"), (["a", "b,"], "--gpu 'b,': empty item"),
])
def test_a_list_given_but_empty_or_with_a_hole_names_the_option(given, needle):
    with pytest.raises(OptionError) as info:
        option_items(given, "--gpu", "gpu")
    assert str(info.value).startswith(needle)


@pytest.mark.parametrize(("args", "flag"), [
    (["simulate", "--table", "wnw4", "--gpu", ""], "--gpu"),
    (["simulate", "--policy", "full", "--model", "voxtral-mini-3b", "--gpu", ","], "--gpu"),
    (["simulate", "--policy", "full", "--model", "voxtral-mini-3b", "--mode", "sync,"], "--mode"),
    (["study", "table4", "--gpu", ","], "--gpu"),
    (["study", "table4", "--tidal", ""], "--tidal"),
    (["study", "table4", "--calibration-traces", ","], "--calibration-traces"),
    (["study", "table5", "--policy", ","], "--policy"),
    (["study", "table5", "--ids", ","], "--ids"),
    (["study", "table5", "--live-runs", "a,,b"], "--live-runs"),
])
def test_commands_reject_an_empty_list_in_one_line_before_any_work(args, flag, tmp_path):
    if args[0] == "study":
        args = [*args, "--model", "tiny", "-o", str(tmp_path / "o")]
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    assert isinstance(res.exception, SystemExit) and "Traceback" not in res.output
    assert flag in res.output and len(res.output.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_replay_rejects_empty_sim_modes_before_replaying(tmp_path):
    from tests.conftest import make_trace

    make_trace(tmp_path / "t.kvtrace")
    res = runner.invoke(app, ["replay", str(tmp_path / "t.kvtrace"), "-p", "full", "--simulate", "h100-sxm",
                              "--sim-mode", ",", "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "no mode given (--sim-mode)" in res.output
    assert not (tmp_path / "o" / "runs.parquet").exists()


@pytest.mark.parametrize("ids", ["", ",", "a,,b"])
def test_live_rejects_empty_ids(ids, tmp_path):
    import numpy as np
    import soundfile as sf

    sf.write(str(tmp_path / "a.wav"), np.zeros(16000, np.float32) + 0.01, 16000)
    res = runner.invoke(app, ["live", str(tmp_path), "--model", "tiny", "--ids", ids, "-o", str(tmp_path / "o")])
    assert res.exit_code == 2 and "--ids" in res.output and "Traceback" not in res.output
    assert not (tmp_path / "o" / "runs.parquet").exists()


@pytest.mark.parametrize(("args", "needle"), [
    (["alignment", "--layers", ","], "no layer given (--layers)"),
    (["alignment", "--layers", "1,x"], "option --layers: '1,x' is not a comma-separated list of integers"),
    (["study", "voxzip-decay", "--gamma", ""], "no gamma given (--gamma)"),
    (["study", "voxzip-decay", "--gamma", "0.9,,0.95"], "--gamma '0.9,,0.95': empty item"),
])
def test_number_lists_name_the_option(args, needle, tmp_path):
    from tests.conftest import make_trace

    make_trace(tmp_path / "t.kvtrace")
    res = runner.invoke(app, [*args, str(tmp_path / "t.kvtrace"), "-o", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output
