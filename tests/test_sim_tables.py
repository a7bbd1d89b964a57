"""The documented tables are computed, and keep their qualitative shape."""

from __future__ import annotations

from kvsim.sim.tables import WNW_TABLE4, capacity_table, memory_over_steps, wnw_table4


def test_capacity_table_orders_policies():
    df = capacity_table(models=("minivox",), gpus=("a100-80gb",), runtimes=("hf-sdpa",),
                        audio_s=60.0)
    b = dict(zip(df["policy"], df["max_batch_hf-sdpa"], strict=True))
    tok = dict(zip(df["policy"], df["tok_s_hf-sdpa"], strict=True))
    assert b["full"] < b["wnw@0.2 sync"] <= b["snapkv@0.2"]
    assert tok["wnw@0.2 coalesced"] >= tok["wnw@0.2 sync"]
    assert (df["peak_gib_hf-sdpa"] <= 80.0).all()


def test_wnw_table4_columns_and_monotone_traffic():
    df = wnw_table4(gpu="h100-sxm", runtime="hf-eager", audio_s=60.0)
    assert df["tidal_heads"].to_list() == list(WNW_TABLE4)
    mb = df["mb_per_step"].to_list()
    assert all(b >= a for a, b in zip(mb, mb[1:], strict=False))
    assert (df["overlap_ms_mean"] <= df["sync_ms_mean"]).all()


def test_memory_over_steps_rises_linearly():
    df = memory_over_steps("voxtral-mini-3b", audio_s=30.0, budgets=(0.2,))
    full = df.filter(df["policy"] == "full")["gib"].to_numpy()
    snap = df.filter(df["policy"] == "snapkv")["gib"].to_numpy()
    assert full[-1] > full[0] and (snap < full).all()
