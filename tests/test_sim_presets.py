"""Preset files: every shipped preset loads, every number has a source, bad files fail clearly."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from kvsim.sim import PresetError, list_presets, load_preset, model_preset
from kvsim.sim.presets import load_preset_file

PRESETS = Path(__file__).resolve().parents[1] / "kvsim" / "presets"


@pytest.mark.parametrize("kind", ["gpus", "models", "runtimes"])
def test_all_shipped_presets_load(kind):
    names = list_presets(kind)
    assert names
    for n in names:
        p = load_preset(kind, n)
        assert p.name == n


def test_required_presets_exist():
    assert {"a100-80gb", "h100-sxm", "h200"} <= set(list_presets("gpus"))
    assert {"voxtral-mini-3b", "voxtral-small-24b", "qwen2.5-omni-3b", "minivox"} <= set(
        list_presets("models"))


@pytest.mark.parametrize(
    ("alias", "name"),
    [("minivox", "minivox"), ("voxtral-mini", "voxtral-mini-3b"), ("Voxtral-Mini-3B", "voxtral-mini-3b"),
     ("qwen-omni", "qwen2.5-omni-3b"), ("qwen2.5-omni-3b", "qwen2.5-omni-3b"),
     ("mistralai/Voxtral-Mini-3B-2507", "voxtral-mini-3b"), ("voxtral-small", "voxtral-small-24b")],
)
def test_model_aliases(alias, name):
    assert model_preset(alias).name == name


def test_unknown_model_lists_presets():
    with pytest.raises(PresetError, match=r"unknown model preset 'gpt'; available: .*voxtral-mini-3b"):
        model_preset("gpt")


def test_kv_bytes_match_notes():
    # 2 (K, V) x layers x kv-heads x head dim x 2 bytes: Voxtral-mini 122,880 B/token; Qwen2.5-Omni-3B 36,864
    assert model_preset("voxtral-mini-3b").kv_bytes_per_token == 122_880
    assert model_preset("qwen2.5-omni-3b").kv_bytes_per_token == 36_864
    assert model_preset("voxtral-mini-3b").kv_bytes_per_head_token == 512  # WnW hint: 2*128*2


def _write(tmp_path, src: str) -> Path:
    p = tmp_path / "g.toml"
    p.write_text(src)
    return p


def _gpu_src() -> str:
    return (PRESETS / "gpus" / "h100-sxm.toml").read_text()


def test_negative_value_names_file_and_field(tmp_path):
    p = _write(tmp_path, _gpu_src().replace("hbm_bandwidth_gbps = 3350.0", "hbm_bandwidth_gbps = -1.0"))
    with pytest.raises(PresetError, match=r"g\.toml: field 'hbm_bandwidth_gbps': must be > 0"):
        load_preset_file("gpus", p)


def test_fraction_out_of_range(tmp_path):
    p = _write(tmp_path, _gpu_src().replace("hbm_efficiency = 0.85", "hbm_efficiency = 85.0"))
    with pytest.raises(PresetError, match="'hbm_efficiency': must be a fraction"):
        load_preset_file("gpus", p)


def test_string_where_number_expected(tmp_path):
    p = _write(tmp_path, _gpu_src().replace("pcie_latency_us = 2.0", 'pcie_latency_us = "fast"'))
    with pytest.raises(PresetError, match="'pcie_latency_us': expected a number"):
        load_preset_file("gpus", p)


def test_missing_source(tmp_path):
    src = "\n".join(ln for ln in _gpu_src().splitlines() if not ln.startswith('pcie_gen = "'))
    p = _write(tmp_path, src)
    with pytest.raises(PresetError, match="'pcie_gen': no source"):
        load_preset_file("gpus", p)


def test_missing_field_and_unknown_field(tmp_path):
    src = "\n".join(ln for ln in _gpu_src().splitlines() if not ln.startswith("min_kernel_us = 2"))
    with pytest.raises(PresetError, match="'min_kernel_us': missing"):
        load_preset_file("gpus", _write(tmp_path, src))
    src = _gpu_src().replace("pcie_gen = 5", "pcie_gen = 5\nhbm_speed = 3")
    with pytest.raises(PresetError, match="'hbm_speed': unknown field"):
        load_preset_file("gpus", _write(tmp_path, src))


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(PresetError, match="not valid TOML"):
        load_preset_file("gpus", _write(tmp_path, "name = "))
    with pytest.raises(PresetError, match="no such preset file"):
        load_preset_file("gpus", tmp_path / "nope.toml")


def test_every_source_is_nonempty_and_numbers_have_sources():
    for kind in ("gpus", "models", "runtimes"):
        for f in (PRESETS / kind).glob("*.toml"):
            data = tomllib.loads(f.read_text())
            for k, v in data.items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    assert data["sources"].get(k, "").strip(), f"{f.name}: {k} has no source"


@pytest.mark.parametrize(
    ("old", "new", "field", "expect"),
    [
        ("hbm_bandwidth_gbps = 3350.0", 'hbm_bandwidth_gbps = "3.35 TB/s"', "hbm_bandwidth_gbps", 3350.0),
        ("pcie_latency_us = 2.0", 'pcie_latency_us = "2000 ns"', "pcie_latency_us", 2.0),
        ("graph_launch_us = 10.0", 'graph_launch_us = "0.01 ms"', "graph_launch_us", 10.0),
        ("hbm_capacity_gib = 79.6", 'hbm_capacity_gib = "81559 MiB"', "hbm_capacity_gib", 81559 / 1024),
    ],
)
def test_values_with_units_are_converted(tmp_path, old, new, field, expect):
    p = _write(tmp_path, _gpu_src().replace(old, new))
    assert getattr(load_preset_file("gpus", p), field) == pytest.approx(expect)


def test_unknown_unit_names_field(tmp_path):
    p = _write(tmp_path, _gpu_src().replace("hbm_bandwidth_gbps = 3350.0", 'hbm_bandwidth_gbps = "3 parsecs"'))
    with pytest.raises(PresetError, match=r"field 'hbm_bandwidth_gbps': unknown unit 'parsecs'"):
        load_preset_file("gpus", p)
    p = _write(tmp_path, _gpu_src().replace("hbm_bandwidth_gbps = 3350.0", 'hbm_bandwidth_gbps = "-3 TB/s"'))
    with pytest.raises(PresetError, match="must be > 0"):
        load_preset_file("gpus", p)
