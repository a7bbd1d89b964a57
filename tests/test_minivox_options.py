"""Config dataclasses as command lines: every field an option with its default, type and help."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import pytest

from kvsim.minivox.align import AlignConfig
from kvsim.minivox.align import parse_args as align_args
from kvsim.minivox.options import add_options, option
from kvsim.minivox.swap import SwapConfig
from kvsim.minivox.swap import parse_args as swap_args
from kvsim.minivox.train import TrainConfig, build_parser, config_from_args


@dataclass
class _Demo:
    count: int = option(3, "how many")
    path: Path | None = option(None, "where", type=Path)
    loud: bool = option(False, "shout")
    kind: str = option("a", "which", choices=["a", "b"])


def _parser(config: type) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    add_options(ap, config)
    return ap


def test_each_field_parses_to_its_type_and_defaults_to_the_field_default():
    assert vars(_parser(_Demo).parse_args([])) == asdict(_Demo())
    got = vars(_parser(_Demo).parse_args(["--count", "7", "--path", "x/y", "--loud", "--kind", "b"]))
    assert got == {"count": 7, "path": Path("x/y"), "loud": True, "kind": "b"}


def test_choices_are_enforced():
    with pytest.raises(SystemExit):
        _parser(_Demo).parse_args(["--kind", "c"])


def test_help_shows_each_fields_help_and_default():
    text = _parser(_Demo).format_help()
    for phrase in ("how many (default: 3)", "where (default: None)", "shout", "which (default: a)"):
        assert phrase in " ".join(text.split())


def test_a_field_without_help_is_refused_by_name():
    @dataclass
    class Bare:
        n: int = 1

    with pytest.raises(TypeError, match="Bare.n"):
        _parser(Bare)


@pytest.mark.parametrize("config", [TrainConfig, AlignConfig, SwapConfig])
def test_every_minivox_training_option_has_help(config):
    for f in fields(config):
        assert f.metadata.get("help"), f"{config.__name__}.{f.name} has no help"


def test_train_and_align_command_lines_round_trip_their_defaults():
    assert config_from_args(build_parser().parse_args([])) == TrainConfig()
    assert align_args([]) == AlignConfig()
    assert swap_args([]) == SwapConfig()
    cfg = config_from_args(build_parser().parse_args(["--split-words", "0.1", "--no-bf16"]))
    assert (cfg.split_words, cfg.bf16) == (0.1, False)
