"""User policies without forking: ``-p package.module:ClassName`` and the public invariant
checks (kvsim.testing), on the worked example under examples/my_policy."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from typer.testing import CliRunner

from examples.my_policy.recent_heavy import RecentHeavy
from kvsim.cli import app
from kvsim.core.invariants import InvariantViolation
from kvsim.policies import Policy, Tier, registry
from kvsim.policies.base import PolicyContext, PrefillView, StepView, full_tiers
from kvsim.policies.scoring import ScoringPolicy
from kvsim.specs import parse_policies
from kvsim.testing import check_policy
from tests.conftest import make_trace

EXAMPLE = "examples.my_policy.recent_heavy:RecentHeavy"


@pytest.fixture(autouse=True)
def _registry_restored():
    """Loading a user policy registers it: undo that, so other tests see the shipped set."""
    registry.available()
    before = dict(registry._REGISTRY)
    yield
    registry._REGISTRY.clear()
    registry._REGISTRY.update(before)


def test_example_loaded_by_module_path_passes_the_invariant_checks() -> None:
    (spec,) = parse_policies([f"{EXAMPLE}:recency=0.25"], 0.3)
    assert (spec.name, spec.params, spec.source) == ("recent_heavy", {"recency": 0.25}, EXAMPLE)
    assert registry.get("recent_heavy") is RecentHeavy
    runs = check_policy(EXAMPLE, params={"recency": 0.25}, budgets=(0.15, 0.5, 0.85),
                        seeds=(3,), steps=4)
    assert len(runs) == 2 * 3  # presets x budgets


def test_example_appears_in_replay_output(tmp_path: Path) -> None:
    # two traces and --jobs 2: spawned worker processes must load the user's class themselves
    make_trace(tmp_path / "tr" / "a.kvtrace", seconds=6, steps=4, seed=1)
    make_trace(tmp_path / "tr" / "b.kvtrace", seconds=5, steps=4, seed=2)
    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["replay", str(tmp_path / "tr"), "-p", f"{EXAMPLE}:recency=0.2",
                                   "-p", "snapkv", "-b", "0.3", "-o", str(out), "--jobs", "2"],
                             env={"COLUMNS": "250"})  # the table, unwrapped
    assert res.exit_code == 0, res.output
    table = pl.read_parquet(out / "results.parquet")
    assert set(table["label"]) == {"recent_heavy(recency=0.2)", "snapkv"}
    assert "recent_heavy" in res.output
    mine = table.filter(pl.col("policy") == "recent_heavy")
    assert mine.height == 2 and (mine["r_gpu"] <= 0.3 + 1e-12).all()


@dataclass
class _NotAPolicy:
    name = "not_a_policy"


@dataclass
class _Abstract(ScoringPolicy):
    name = "_abstract_user"


@dataclass
class _TakesSnapKVsName(ScoringPolicy):
    name = "snapkv"

    def score(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        raise AssertionError("never run")


@pytest.mark.parametrize(("spec", "needle"), [
    ("nosuchpkg.mod:Cls", "module 'nosuchpkg' not found"),
    ("examples.my_policy.recent_heavy:Missing", "has no attribute 'Missing'"),
    ("tests.test_user_policy:_NotAPolicy", "is not a subclass of kvsim.policies.Policy"),
    ("tests.test_user_policy:_Abstract", "is abstract (implement score)"),
    ("tests.test_user_policy:_TakesSnapKVsName", "the name 'snapkv' is taken"),
    (f"{EXAMPLE}:nosuch=1", "no hyperparameter nosuch"),
])
def test_bad_user_policy_is_one_clear_line(tmp_path: Path, spec: str, needle: str) -> None:
    make_trace(tmp_path / "t.kvtrace", seconds=4, steps=2)
    res = CliRunner().invoke(app, ["replay", str(tmp_path / "t.kvtrace"), "-p", spec,
                                   "-o", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert needle in res.output and "Traceback" not in res.output


@dataclass
class _Resurrects(Policy):
    """Breaks "GONE is absorbing": evicts half at prefill, brings everything back later."""

    name = "_resurrects"

    def prefill(self, ctx: PolicyContext, view: PrefillView) -> np.ndarray:
        self._tiers = full_tiers(ctx, Tier.GONE)
        self._tiers[..., : ctx.n_audio // 2] = Tier.GPU
        return self._tiers

    def decode_step(self, view: StepView) -> np.ndarray | None:
        return np.full_like(self._tiers, Tier.GPU)


def test_invariant_checks_catch_a_broken_user_policy() -> None:
    with pytest.raises(InvariantViolation):
        check_policy(_Resurrects, budgets=(0.5,), presets=("tiny",), seeds=(0,), steps=2)


def test_example_runs_in_live_decoding(tmp_path: Path) -> None:
    import soundfile as sf

    noise = 0.1 * np.random.default_rng(0).standard_normal(16000 * 4)
    sf.write(str(tmp_path / "c.wav"), noise.astype(np.float32), 16000)
    (tmp_path / "c.txt").write_text("some reference words")
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["live", str(tmp_path / "c.wav"), "--model", "tiny", "-p",
                                   f"{EXAMPLE}:recency=0.2", "-b", "0.4", "--max-new-tokens", "4",
                                   "-o", str(out)])
    assert res.exit_code == 0, res.output
    runs = pl.read_parquet(out / "runs.parquet")
    assert runs["policy"].to_list() == ["recent_heavy"]
    n_audio = 50  # 4 s at 12.5 audio tokens/s; a static per-head budget floor(r * T_a)
    # r_gpu is a mean over the decode steps of the same ratio: a few float64 ulps off
    assert runs["r_gpu"][0] == pytest.approx(int(0.4 * n_audio) / n_audio, abs=1e-12)
