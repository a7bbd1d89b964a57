"""The stage-2 training schedule: which clips each step sees (no model needed)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from kvsim.minivox.train import (
    TrainConfig,
    batch_rows,
    check_training_options,
    data_step,
    joined_row,
    optimiser_step,
)

TRAIN = [{"id": f"train-{i:05d}", "text": f"short {i}"} for i in range(40)]
LONG = [{"id": f"train_long-{i:05d}", "text": f"long {i}"} for i in range(12)]


def test_without_long_clips_one_epoch_is_a_permutation() -> None:
    cfg = TrainConfig(batch=4, p_long=0.0, seed=5)
    ids = [r["id"] for s in range(10) for r in batch_rows(s, cfg, TRAIN, [])]
    assert sorted(ids) == sorted(r["id"] for r in TRAIN)  # 10 steps x 4 = 40 = one epoch
    assert ids != [r["id"] for r in TRAIN]  # shuffled
    # deterministic given the seed, different for another seed
    assert ids == [r["id"] for s in range(10) for r in batch_rows(s, cfg, TRAIN, [])]
    other = TrainConfig(batch=4, p_long=0.0, seed=6)
    assert ids != [r["id"] for s in range(10) for r in batch_rows(s, other, TRAIN, [])]


def test_concatenated_long_form_examples() -> None:
    cfg = TrainConfig(batch=4, p_long=0.0, p_concat=1.0, concat_max=4)
    sizes = Counter()
    for s in range(200):
        (row,) = batch_rows(s, cfg, TRAIN, LONG)
        parts = row["parts"]
        assert 2 <= len(parts) <= 4
        assert len({p["id"] for p in parts}) == len(parts)  # no clip twice in one example
        assert row["text"] == " ".join(p["text"] for p in parts)
        sizes[len(parts)] += 1
    assert set(sizes) == {2, 3, 4}


FORM = [{"id": f"train_longform-{i:05d}", "text": f"form {i}"} for i in range(7)]


def test_longform_steps_take_whole_clips_without_repeats_within_a_pass() -> None:
    cfg = TrainConfig(batch=4, p_long=0.0, p_concat=1.0, longform_split="train_longform", seed=3)
    ids = [r["id"] for s in range(21) for r in batch_rows(s, cfg, TRAIN, [], FORM)]
    assert len(ids) == 21  # one clip per step, never joined
    for k in range(3):  # each pass of 7 steps is a permutation, a different one per pass
        assert sorted(ids[7 * k: 7 * k + 7]) == sorted(r["id"] for r in FORM)
    assert ids[:7] != ids[7:14]
    # a mixture: the other steps are the short batches
    mix = TrainConfig(batch=4, p_long=0.0, p_concat=0.5, longform_split="train_longform")
    kinds = Counter(len(batch_rows(s, mix, TRAIN, [], FORM)) for s in range(1000))
    assert set(kinds) == {1, 4} and np.isclose(kinds[1] / 1000, 0.5, atol=0.05)


def test_mixture_shares_follow_the_config() -> None:
    cfg = TrainConfig(batch=4, p_long=0.25, p_concat=0.15)
    kinds = Counter()
    for s in range(2000):
        rows = batch_rows(s, cfg, TRAIN, LONG)
        if "parts" in rows[0]:
            kinds["concat"] += 1
        elif rows[0]["id"].startswith("train_long"):
            assert len(rows) == 2  # batch // 2 two-window clips
            kinds["long"] += 1
        else:
            assert len(rows) == 4
            kinds["short"] += 1
    assert np.isclose(kinds["long"] / 2000, 0.25, atol=0.04)
    assert np.isclose(kinds["concat"] / 2000, 0.15, atol=0.03)


def test_joined_row_keeps_the_clip_order() -> None:
    row = joined_row(LONG[3:6])
    assert [p["id"] for p in row["parts"]] == [r["id"] for r in LONG[3:6]]
    assert row["text"] == "long 3 long 4 long 5"


def test_joined_example_encoding_is_the_clips_back_to_back(tmp_path) -> None:
    from kvsim.minivox.train import encoder_cache_file, example_encoding

    rng = np.random.default_rng(0)
    encs = {r["id"]: rng.standard_normal((1500 * (i + 1), 8)).astype(np.float16)
            for i, r in enumerate(LONG[:3])}
    for r in LONG[:3]:
        np.save(encoder_cache_file(r, tmp_path), encs[r["id"]])
    # cached clips are read from the cache: no model, no audio needed
    out = example_encoding(None, None, joined_row(LONG[:3]), tmp_path)
    assert out.shape == (1500 * 6, 8)
    np.testing.assert_array_equal(out.numpy(), np.concatenate(list(encs.values())).astype(np.float32))
    single = example_encoding(None, None, LONG[1], tmp_path)
    np.testing.assert_array_equal(single.numpy(), encs[LONG[1]["id"]].astype(np.float32))


def _average_worker(rank: int, port: int, out: str) -> None:
    import os

    import torch

    from kvsim.minivox.train import average_across_ranks, data_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE="2", RANK=str(rank))
    world, got_rank = data_parallel()
    assert (world, got_rank) == (2, rank)
    a = torch.nn.Parameter(torch.zeros(3))
    b = torch.nn.Parameter(torch.zeros(2, 2))
    a.grad = torch.full((3,), float(rank + 1))  # rank 0: 1, rank 1: 2
    b.grad = None if rank == 0 else torch.full((2, 2), 4.0)  # an unused parameter on rank 0
    loss, flag = average_across_ranks([a, b], 10.0 * (rank + 1), float(rank == 1))
    torch.save({"a": a.grad, "b": b.grad, "loss": loss, "flag": flag}, f"{out}/{rank}.pt")
    torch.distributed.destroy_process_group()


def test_data_parallel_averages_gradients_and_scalars(tmp_path) -> None:
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_average_worker, args=(port, str(tmp_path)), nprocs=2, join=True)
    for rank in (0, 1):
        r = torch.load(tmp_path / f"{rank}.pt")
        assert torch.equal(r["a"], torch.full((3,), 1.5))
        assert torch.equal(r["b"], torch.full((2, 2), 2.0))  # (0 + 4) / 2
        assert r["loss"] == 15.0
        assert r["flag"] == 0.5  # one rank out of time: every rank sees > 0 and stops


def test_data_offset_continues_the_data_order_where_a_run_stopped() -> None:
    first = TrainConfig(batch=4, p_long=0.0, p_concat=0.5, longform_split="train_longform", seed=3)
    later = TrainConfig(**{**first.__dict__, "data_offset": 5})
    assert [data_step(s, later) for s in range(3)] == [5, 6, 7]
    assert data_step(2, later, world=2, rank=1) == 15  # (2 + 5) * 2 + 1
    # the ramps count optimiser steps from 0 whatever the offset
    assert all(optimiser_step(data_step(s, later, 2, r), later, 2) == s
               for s in range(4) for r in range(2))
    heard = [r["id"] for s in range(5) for r in batch_rows(data_step(s, first), first, TRAIN, [], FORM)]
    then = [r["id"] for s in range(5) for r in batch_rows(data_step(s, later), later, TRAIN, [], FORM)]
    assert then == [r["id"] for s in range(5, 10) for r in batch_rows(s, first, TRAIN, [], FORM)]
    assert then != heard
    with pytest.raises(ValueError, match="--data-offset -1"):
        check_training_options(TrainConfig(data_offset=-1))


def test_a_missing_split_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    import polars as pl

    from kvsim.minivox import train as T

    pl.DataFrame({"id": ["train_wide-00000"], "split": ["train_wide"],
                  "audio_path": ["audio/train_wide/train_wide-00000.flac"]}).write_parquet(
        tmp_path / "manifest.parquet")

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the manifest was checked")

    monkeypatch.setattr(T, "train", no_model)
    with pytest.raises(SystemExit) as e:
        T.main(["--data", str(tmp_path), "--train-splits", "train_wide", "--p-long", "0"])
    msg = str(e.value)
    assert "\n" not in msg and "manifest.parquet" in msg and "'dev'" in msg
    with pytest.raises(SystemExit, match="manifest not found"):
        T.main(["--data", str(tmp_path / "nowhere")])


def test_longform_rows_come_from_every_named_split_in_order(tmp_path):
    import polars as pl

    from kvsim.minivox.train import TrainingRows

    ids = ["train_longform_fast-00000", "train_longform_2-00000", "train_longform_2-00001",
           "train_wide-00000", "dev-00000"]
    pl.DataFrame({"id": ids, "split": [i.rsplit("-", 1)[0] for i in ids],
                  "audio_path": [f"audio/{i}.flac" for i in ids]}).write_parquet(
        tmp_path / "manifest.parquet")
    cfg = TrainConfig(p_long=0.0, p_concat=0.5, train_splits="train_wide",
                      longform_split="train_longform_fast,train_longform_2")
    rows = TrainingRows.read(tmp_path, cfg)
    assert [r["id"] for r in rows.longform] == ids[:3]
    assert [r["id"] for r in rows.train] == ["train_wide-00000"] and rows.long == []
    # without long-form steps no long-form split is read, a missing one included
    none = TrainingRows.read(tmp_path, TrainConfig(p_long=0.0, p_concat=0.0,
                                                   train_splits="train_wide", longform_split="gone"))
    assert none.longform == []
