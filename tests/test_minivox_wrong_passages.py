"""Wrong passages (kvsim.minivox.wrong_passages): which inputs are replaced, by what."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsim.minivox.train import Batch, TrainConfig, train
from kvsim.minivox.wrong_passages import passage_sources, replaceable, wrong_passage_batch

V = 400  # vocabulary of the toy model: token t embeds as row t of the identity


def _model() -> SimpleNamespace:
    table = torch.nn.Embedding(V, V)
    table.weight.data = torch.eye(V)
    return SimpleNamespace(get_input_embeddings=lambda: table, table=table)


def _batch(model, n_transcript: int) -> tuple[Batch, torch.Tensor]:
    """One row: a prompt of 4 positions, a transcript of tokens 100, 101, ... (the last one
    the end token) at inputs 4 .. 4 + n - 1, labelled from position 3; a second row that is
    all prompt (no labels)."""
    length = 4 + n_transcript + 2
    ids = torch.zeros((2, length), dtype=torch.long)
    ids[0, 4:4 + n_transcript] = torch.arange(100, 100 + n_transcript)
    labels = torch.full((2, length), -100)
    labels[0, 3:3 + n_transcript] = ids[0, 4:4 + n_transcript]
    embeds = model.table(ids).detach()
    return Batch(embeds, torch.ones_like(ids), labels, guides=["kept"]), ids


def test_replaceable_inputs_are_transcript_tokens_that_feed_a_prediction():
    model = _model()
    batch, _ = _batch(model, 10)
    expected = torch.zeros_like(batch.labels, dtype=torch.bool)
    expected[0, 4:13] = True  # inputs 4-12 (not the end token at 13, whose position has no label)
    assert torch.equal(replaceable(batch.labels), expected)


def test_passages_are_blocks_of_distant_text_from_the_same_transcript():
    model = _model()
    batch, ids = _batch(model, 201)  # 200 replaceable inputs
    out = wrong_passage_batch(model, batch, 0.2, 16, torch.Generator().manual_seed(3))
    assert out.labels is batch.labels and out.mask is batch.mask and out.guides is batch.guides
    token = out.embeds.argmax(-1)  # the token each input now embeds
    changed = (token != ids).nonzero().tolist()
    assert changed and all(b == 0 and 4 <= k < 204 for b, k in changed)
    starts = [k for b, k in changed if [b, k - 1] not in changed]
    assert len(changed) == 16 * len(starts)  # whole blocks of 16
    assert len(starts) == round(0.2 * 200 / 16)
    for k in starts:  # each block is 16 consecutive transcript tokens from at least 32 away
        block = token[0, k:k + 16]
        assert torch.equal(block, torch.arange(int(block[0]), int(block[0]) + 16))
        assert abs(int(block[0]) - int(ids[0, k])) >= 32
    # the same draw for the same seed, another for another
    again = wrong_passage_batch(model, batch, 0.2, 16, torch.Generator().manual_seed(3))
    assert torch.equal(again.embeds, out.embeds)
    other = wrong_passage_batch(model, batch, 0.2, 16, torch.Generator().manual_seed(4))
    assert not torch.equal(other.embeds, out.embeds)


def test_no_passage_in_a_short_transcript_or_at_share_zero():
    model = _model()
    batch, _ = _batch(model, 40)  # 39 replaceable inputs < 3 blocks of 16
    assert passage_sources(39, 16, 0.5, torch.Generator().manual_seed(0)) == []
    assert wrong_passage_batch(model, batch, 0.5, 16, torch.Generator().manual_seed(0)) is batch
    assert wrong_passage_batch(model, batch, 0.0, 4, torch.Generator().manual_seed(0)) is batch


def test_teacher_forcing_is_the_default_and_bad_settings_fail_before_the_model_loads(tmp_path):
    assert TrainConfig().wrong_share == 0.0
    for cfg in (TrainConfig(wrong_share=1.5), TrainConfig(wrong_share=0.1, wrong_length=0)):
        with pytest.raises(ValueError, match="--wrong-share"):
            train(tmp_path, tmp_path / "run", cfg, None)
    with pytest.raises(ValueError, match="wrong_share"):
        wrong_passage_batch(_model(), _batch(_model(), 10)[0], -0.1, 4, torch.Generator())
