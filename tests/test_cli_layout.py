"""The commands read at 80 columns through a pipe, in a log (CSV, markdown), and as a shell
glob hands them their arguments; ``kvsim trace`` fails fast on bad inputs; the recall chart
draws one line per (trace, policy)."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
from typer.testing import CliRunner

from kvsim.cli import app
from tests.conftest import make_trace

runner = CliRunner()
NARROW = {"COLUMNS": "80"}  # what `... | cat` gives rich: no terminal, 80 columns
LONG_NAMES = ("a-rather-long-trace-name-0001", "second-trace-with-long-name")
POLICIES = ("full", "snapkv(window=8)", "streaming", "pyramidkv")


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tr")
    for i, name in enumerate(LONG_NAMES):
        make_trace(d / f"{name}.kvtrace", preset="minivox", seconds=6, steps=5, seed=i)
    (d / "README.md").write_text("not a trace\n")  # what `traces/*` also expands to
    return d


@pytest.fixture(scope="module")
def replay_out(traces, tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("run")
    args = ["replay", *map(str, sorted(traces.iterdir())), "-p", "full,snapkv:window=8,streaming,pyramidkv",
            "-b", "0.2,0.45", "-o", str(out), "--simulate", "h100-sxm", "--sim-mode", "sync"]
    return out, runner.invoke(app, args, env=NARROW)


def _assert_whole_names(text: str, names) -> None:
    assert "…" not in text, text
    for name in names:
        assert name in text, f"{name!r} cut or missing in:\n{text}"


def test_replay_glob_with_a_readme_and_its_tables_at_80_columns(replay_out, traces) -> None:
    out, res = replay_out
    assert res.exit_code == 0, res.output
    assert res.stderr.count("README.md") == 1 and "skipped:" in res.stderr  # reported once
    _assert_whole_names(res.stdout, LONG_NAMES + POLICIES + ("0.45",))
    assert "simulated on h100-sxm" in res.stdout


@pytest.mark.parametrize("fmt", ["csv", "markdown"])
def test_replay_formats_for_logs(traces, tmp_path, fmt) -> None:
    res = runner.invoke(app, ["replay", str(traces), "-p", "full,snapkv:window=8", "-o", str(tmp_path),
                              "--format", fmt, "--wide"], env=NARROW)
    assert res.exit_code == 0, res.output
    if fmt == "csv":
        frame = pl.read_csv(io.StringIO(res.stdout))
        stored = pl.read_parquet(tmp_path / "results.parquet")
        assert frame.height == stored.height == 4
        assert {"trace", "label", "r_gpu_cpu", "topk_jaccard"} <= set(frame.columns)  # --wide: all
        assert sorted(frame["label"]) == sorted(stored["label"])
    else:
        lines = res.stdout.strip().splitlines()
        assert lines[0].startswith("| trace | policy |") and len(lines) == 2 + 4
        _assert_whole_names(res.stdout, LONG_NAMES + ("snapkv(window=8)",))


def test_policies_shows_every_default_of_every_policy() -> None:
    from kvsim.policies import registry

    res = runner.invoke(app, ["policies"], env=NARROW)
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 80
    for name, cls in registry.available().items():
        assert f"\n{name}  (" in "\n" + res.stdout
        for key, value in cls.hyperparameters().items():
            assert f"{key} = {value!r}" in " ".join(res.stdout.split()), (name, key)
    csv = pl.read_csv(io.StringIO(runner.invoke(app, ["policies", "--format", "csv"]).stdout))
    expected = sum(max(len(c.hyperparameters()), 1) for c in registry.available().values())
    assert csv.height == expected and set(csv["policy"]) == set(registry.available())


def test_info_validate_mismatch_simulate_take_a_glob(replay_out, traces) -> None:
    args = [str(p) for p in sorted(traces.iterdir())]
    for cmd in ("info", "validate", "mismatch"):
        res = runner.invoke(app, [cmd, *args], env=NARROW)
        assert res.exit_code == 0, (cmd, res.output)
        assert res.stderr.count("README.md") == 1, (cmd, res.stderr)
        _assert_whole_names(res.stdout, LONG_NAMES)
    res = runner.invoke(app, ["info", str(traces / "README.md")])
    assert res.exit_code == 2 and "no *.kvtrace trace among" in res.output
    res = runner.invoke(app, ["simulate", str(replay_out[0])], env=NARROW)
    assert res.exit_code == 0, res.output
    _assert_whole_names(res.stdout, [f"{LONG_NAMES[0]}__snapkv(window=8)__0.45"])


def test_simulate_csv_parses_and_matches_the_parquet(tmp_path) -> None:
    res = runner.invoke(app, ["simulate", "--policy", "wnw", "--model", "voxtral-mini-3b", "-g", "h100-sxm,h200",
                              "--format", "csv", "--wide", "-o", str(tmp_path)])
    assert res.exit_code == 0, res.output
    frame = pl.read_csv(io.StringIO(res.stdout))
    stored = pl.read_parquet(tmp_path / "sim_results.parquet")
    assert frame["gpu"].to_list() == stored["gpu"].to_list() == ["h100-sxm", "h200"]
    # raw values: CSV keeps the shortest repr of each float64, so the round trip is exact
    assert frame["ms_per_token_mean"].to_list() == stored["ms_per_token_mean"].to_list()


PROBE = """
import sys, time
from typer.testing import CliRunner
from kvsim.cli import app
t0 = time.perf_counter()
res = CliRunner().invoke(app, ["trace", "--model", "qwen-omni", *sys.argv[1:]])
print(res.exit_code, round(time.perf_counter() - t0, 2), "torch" in sys.modules,
      "transformers" in sys.modules)
print(res.output)
"""


@pytest.mark.parametrize("case", ["missing", "empty-folder", "not-audio", "unreadable"])
def test_trace_checks_inputs_before_loading_a_model(tmp_path, case) -> None:
    arg = tmp_path / "audio"
    if case == "empty-folder":
        arg.mkdir()
    elif case == "not-audio":
        arg = tmp_path / "notes.txt"
        arg.write_text("x")
    elif case == "unreadable":
        arg = tmp_path / "a.wav"
        arg.write_bytes(b"RIFF not really a wave file")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", PROBE, str(arg), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    code, _, torch_loaded, transformers_loaded = proc.stdout.split("\n")[0].split()
    assert code == "2", proc.stdout + proc.stderr
    assert torch_loaded == "False" and transformers_loaded == "False"  # no model stack touched
    assert str(arg) in proc.stdout and "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists() and time.perf_counter() - t0 < 60


def test_trace_writes_to_traces_by_default(tmp_path, monkeypatch) -> None:
    from tests.fixtures.checkpoints import tiny_checkpoint, write_tone

    ckpt = tiny_checkpoint("voxtral", tmp_path)
    (tmp_path / "audio").mkdir()
    write_tone(tmp_path / "audio" / "talk.wav", 1.0)
    monkeypatch.chdir(tmp_path)
    res = runner.invoke(app, ["trace", "--model", str(ckpt), "audio/", "--max-new-tokens", "2",
                              "--aligner", "none"])
    assert res.exit_code == 0, res.output
    assert [p.name for p in (tmp_path / "traces").glob("*.kvtrace")] == ["talk.kvtrace"]


def test_recall_chart_one_line_per_trace_and_policy(replay_out) -> None:
    from kvsim.plots import recall_vs_rgpu

    frame = pl.read_parquet(replay_out[0] / "results.parquet")
    spec = recall_vs_rgpu(frame).to_dict()
    assert spec["facet"]["field"] == "trace"  # one panel per trace: no line crosses traces
    marks = [layer["mark"]["type"] for layer in spec["spec"]["layer"]]
    assert marks == ["line", "point"]
    enc = spec["spec"]["layer"][0]["encoding"]
    assert enc["color"]["field"] == "label" and enc["y"]["field"] == "attn_recall"
    assert "aggregate" not in enc["y"]  # points are runs, not means over traces
    assert enc["order"]["field"] == "budget"


def test_help_texts_have_no_hard_line_breaks() -> None:
    """--help rewraps a paragraph only when it is one line: a newline inside a paragraph of a
    docstring or an option's help makes ragged lines at any width."""
    import typer.main

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        for paragraph in (command.help or "").strip().split("\n\n"):
            assert "\n" not in paragraph.strip(), (name, paragraph)
        for param in command.params:
            assert "\n" not in (getattr(param, "help", None) or ""), (name, param.name)


def test_replay_of_the_shipped_traces_fits_80_columns(tmp_path) -> None:
    """The compact column set is sized for the shipped traces: every policy's row, names
    whole, within 80 columns (the --wide table may be wider)."""
    from kvsim.policies import registry

    res = runner.invoke(app, ["replay", "-p", "all", "--max-steps", "3", "-o", str(tmp_path)], env=NARROW)
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout
    names = [p.name.removesuffix(".kvtrace") for p in (Path(__file__).parents[1] / "traces").glob("*.kvtrace")]
    _assert_whole_names(res.stdout, names + [n for n in registry.available() if not n.startswith("_")])


def test_live_table_at_80_columns(tmp_path) -> None:
    import numpy as np
    import soundfile as sf

    noise = (0.1 * np.random.default_rng(0).standard_normal(16000 * 4)).astype(np.float32)
    sf.write(str(tmp_path / "talk.wav"), noise, 16000)
    (tmp_path / "talk.txt").write_text("some reference words")
    res = runner.invoke(app, ["live", str(tmp_path / "talk.wav"), "--model", "tiny", "-p",
                              "full,snapkv:window=8,pyramidkv", "-b", "0.45", "--max-new-tokens", "3",
                              "--transform", "none,affpool:0.5", "--no-plot", "-o", str(tmp_path / "o")],
                        env=NARROW)
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout
    _assert_whole_names(res.stdout, ("snapkv(window=8)", "pyramidkv", "affpool:0.5", "0.45"))


SHIPPED = Path(__file__).parents[1] / "traces"


def test_replay_simulate_and_alignment_of_the_shipped_traces_fit_80_columns(tmp_path) -> None:
    """The compact sets of `replay --simulate`'s second table and of `alignment` are sized for
    the shipped traces' names: within 80 columns, every name whole."""
    names = [p.name.removesuffix(".kvtrace") for p in SHIPPED.glob("*.kvtrace")]
    res = runner.invoke(app, ["replay", str(SHIPPED), "--max-steps", "3", "-o", str(tmp_path / "r"),
                              "--simulate", "h100-sxm"], env=NARROW)
    assert res.exit_code == 0, res.output
    assert "simulated on h100-sxm" in res.stdout
    assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout
    _assert_whole_names(res.stdout, names)
    res = runner.invoke(app, ["alignment", str(SHIPPED)], env=NARROW)
    assert res.exit_code == 0, res.output
    assert max(len(line) for line in res.stdout.splitlines()) <= 80, res.stdout
    _assert_whole_names(res.stdout, names)
