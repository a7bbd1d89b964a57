"""scripts/train_minivox.sh retrains the shipped adapter: its commands (printed with DRY_RUN=1)
parse with the trainer's own command line, chain each run to the one before, and ask for the
training configuration stored in the shipped adapter and in the kept adapters of its lineage."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
from safetensors import safe_open

from kvsim.minivox.train import TrainConfig, build_parser, config_from_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_minivox.sh"
# options that say how a run was driven (its clock, where it stopped), not what it learned
DRIVING = {"max_minutes", "stop_step"}

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def dry_run(data: Path, **env: str) -> list[list[str]]:
    """The commands the script prints with DRY_RUN=1 (``data`` written as D)."""
    env = {**os.environ, "DRY_RUN": "1", "PYTHON": "python", **env}
    out = subprocess.run(["bash", str(SCRIPT), str(data)], env=env, capture_output=True,
                         text=True, check=True, cwd=ROOT)
    lines = [ln[2:].replace(str(data), "D") for ln in out.stderr.splitlines() if ln.startswith("+ ")]
    # `run` echoes "$*", which drops the quotes around `python -c CODE`: keep CODE whole
    return [ln.split(" ", 2) if ln.startswith("python -c ") else shlex.split(ln) for ln in lines]


@pytest.fixture(scope="module")
def commands(tmp_path_factory) -> list[list[str]]:
    return dry_run(tmp_path_factory.mktemp("d"))


def phases(commands: list[list[str]]) -> list[tuple[str, object, TrainConfig]]:
    """(run folder, parsed arguments, config) of every training command, in order."""
    out = []
    for argv in commands:
        if argv[:3] == ["python", "-m", "kvsim.minivox.train"] and "--run" in argv:
            args = build_parser().parse_args(argv[3:])
            out.append((str(args.run), args, config_from_args(args)))
    return out


def stored(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def kept_config(meta: dict[str, str]) -> dict:
    """The training configuration a kept adapter stores, with the defaults of options it
    predates filled in."""
    return {**asdict(TrainConfig()), **json.loads(meta["train_config"])}


def learned(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in DRIVING}


@pytest.mark.parametrize("adapter, run", [
    ("minivox/adapter.safetensors", "D/runN10"),
    ("minivox/experiments/novels-368.safetensors", "D/runN10"),
    ("minivox/experiments/longform-308.safetensors", "D/runW"),
    ("minivox/experiments/longform-210.safetensors", "D/runS"),
    ("minivox/experiments/longform-speed.safetensors", "D/runM"),
])
def test_last_phase_of_each_kept_run_asks_for_its_stored_config(commands, adapter, run):
    meta = stored(ROOT / adapter)
    kept = kept_config(meta)
    last = [cfg for r, _, cfg in phases(commands) if r == run][-1]
    assert learned(asdict(last)) == learned(kept)
    # the phase stops at the step the kept adapter was saved at
    assert (last.stop_step or last.steps) == int(meta["step"])


def test_shipped_lineage_matches_the_phases(commands):
    lineage = stored(ROOT / "minivox/adapter.safetensors")["lineage"]
    stops = {}
    for run, _, cfg in phases(commands):
        stops[run] = (cfg.stop_step, cfg.steps, cfg.seed)
    assert stops["D/runL"][0] == 80 and "runL 80 steps" in lineage
    assert stops["D/runM"][0] == 60 and "runM 60" in lineage
    assert stops["D/runS"][0] == 210 and stops["D/runS"][2] == 8 and "runS 210 (seed 8)" in lineage
    assert stops["D/runW"][:2] == (98, 100) and "runW 98 of 100" in lineage
    assert stops["D/runN10"] == (60, 60, 10) and lineage.endswith(
        "runN10 60 (seed 10, --longform-split train_longform_novels)")


def test_every_run_starts_from_an_adapter_the_script_made_before(commands):
    made: set[str] = set()
    for argv in commands:
        if argv[:3] == ["python", "-m", "kvsim.minivox.train"] and "--run" in argv:
            args = build_parser().parse_args(argv[3:])
            for init in (args.init_adapter, args.init_projector):
                if init is not None:
                    assert str(init) in made, f"{args.run} starts from {init}, not made yet"
            made.add(f"{args.run}/last.safetensors")
        elif argv[:2] == ["python", "-c"] and "compact_adapter" in argv[2]:
            made.add(argv[2].split("'")[3])
        elif argv[:3] == ["python", "-m", "kvsim.minivox.align"]:
            made.add(argv[argv.index("--out") + 1])
    assert commands[-1][:2] == ["python", "-c"]
    assert "'D/runN10/last.safetensors', 'minivox/adapter.safetensors'" in commands[-1][2]


def test_another_encoder_runs_the_same_recipe_in_its_own_folders(commands, tmp_path):
    """ENCODER=base: the same commands, each told the encoder, its stage-1 projectors and runs
    under D/encoder-base (the features under D/enc_cache_base, the trainer's own choice)."""
    base = dry_run(tmp_path, ENCODER="base")
    assert len(base) == len(commands)
    for argv, plain in zip(base, commands, strict=True):
        if argv[:3] in (["python", "-m", "kvsim.minivox.train"], ["python", "-m", "kvsim.minivox.align"]):
            assert argv[argv.index("--encoder") + 1] == "base", argv
            assert plain[plain.index("--encoder") + 1] == "tiny.en", plain
        if argv[:3] == ["python", "-m", "kvsim.minivox.data"]:
            assert argv == plain  # one corpus for both encoders
    runs = [r for r, _, _ in phases(base)]
    assert runs and all(r.startswith("D/encoder-base/run") for r in runs)
    assert [r.replace("D/encoder-base/", "D/") for r in runs] == [r for r, _, _ in phases(commands)]
    assert "'D/encoder-base/runN10/last.safetensors', 'minivox/adapter.safetensors'" in base[-1][2]


# the novels' first stage (docs/results/minivox-training.md, twenty-second run), shipped since
# 2026-12-07: the command that trained it, from the runW adapter shipped before it, as the docs
# give it
NOVELS_ARGV = shlex.split(
    "--data D --run D/runN10 --seed 10 --batch 4 --lr 5e-5 --lora-lr 3.5e-4 --warmup 10 "
    "--steps 60 --threads 1 --p-long 0.2 --p-concat 0.6 --longform-split train_longform_novels "
    "--train-splits train_wide --align-weight 1.0 --align-end --speed-perturb 0.9,1.0,1.1 "
    "--lora-targets q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --no-bf16 "
    "--eval-every 100000 --ckpt-every 5 --init-adapter minivox/experiments/longform-308.safetensors")


def test_shipped_adapter_is_the_documented_novels_continuation_of_runW():
    shipped = ROOT / "minivox/adapter.safetensors"
    assert shipped.read_bytes() == (ROOT / "minivox/experiments/novels-368.safetensors").read_bytes()
    meta = stored(shipped)
    kept = kept_config(meta)
    documented = config_from_args(build_parser().parse_args(NOVELS_ARGV))
    assert learned(kept) == learned(asdict(documented))
    assert int(meta["step"]) == documented.steps
    runw = stored(ROOT / "minivox/experiments/longform-308.safetensors")["lineage"]
    assert meta["lineage"] == f"{runw} -> runN10 60 (seed 10, --longform-split train_longform_novels)"


def test_script_starts_the_novels_from_the_float16_runW_adapter(commands):
    """runN10 was trained from the shipped (float16) runW adapter, not from runW's float32
    checkpoint: the script compacts runW first and starts the novels from that."""
    (_, args, _), = [p for p in phases(commands) if p[0] == "D/runN10"]
    assert str(args.init_adapter) == "D/runW/kept.safetensors"
    documented = build_parser().parse_args(NOVELS_ARGV)
    assert documented.longform_split == args.longform_split == "train_longform_novels"
