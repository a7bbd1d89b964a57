"""Wrong passages (kvsim.minivox.wrong_passages): which inputs are replaced, by what."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsim.minivox.guided import GuideTargets
from kvsim.minivox.train import Batch, TrainConfig, ramp_factor, train
from kvsim.minivox.wrong_passages import (
    passage_sources,
    replaceable,
    text_pool,
    weighted_guides,
    wrong_passage_batch,
)

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


def test_other_source_blocks_are_cut_from_the_pool_never_from_the_transcript():
    model = _model()
    batch, ids = _batch(model, 201)
    pool = torch.arange(300, 380)  # tokens no transcript holds
    out = wrong_passage_batch(model, batch, 0.2, 16, torch.Generator().manual_seed(3), pool)
    token = out.embeds.argmax(-1)
    changed = (token != ids).nonzero().tolist()
    starts = [k for b, k in changed if [b, k - 1] not in changed]
    assert len(starts) == round(0.2 * 200 / 16) and len(changed) == 16 * len(starts)
    for k in starts:  # 16 consecutive pool tokens
        block = token[0, k:k + 16]
        assert int(block[0]) >= 300 and int(block[-1]) < 380
        assert torch.equal(block, torch.arange(int(block[0]), int(block[0]) + 16))
    with pytest.raises(ValueError, match="text pool has 8 tokens"):
        wrong_passage_batch(model, batch, 0.2, 16, torch.Generator(), torch.arange(8))


def test_text_pool_joins_a_seeded_draw_of_the_texts():
    calls = []

    def tokenizer(text, add_special_tokens):
        calls.append(text)
        return {"input_ids": [len(w) for w in text.split()]}

    texts = ["a", "bb", "ccc", "dddd"]
    pool = text_pool(tokenizer, texts, torch.Generator().manual_seed(0), max_texts=3)
    assert len(pool) == 3 and len(set(pool.tolist())) == 3  # three distinct texts
    assert set(pool.tolist()) <= {1, 2, 3, 4}
    again = text_pool(tokenizer, texts, torch.Generator().manual_seed(0), max_texts=3)
    assert torch.equal(pool, again)
    with pytest.raises(ValueError, match="need training text"):
        text_pool(tokenizer, [], torch.Generator())


def test_guide_weight_marks_the_queries_at_and_after_each_block():
    model = _model()
    batch, ids = _batch(model, 201)
    queries = torch.arange(3, 3 + 201)  # every scored position predicts a token
    guide = GuideTargets(queries, torch.arange(3), torch.zeros((201, 2), dtype=torch.long))
    batch = Batch(batch.embeds, batch.mask, batch.labels, guides=[guide, None])
    plain = wrong_passage_batch(model, batch, 0.2, 16, torch.Generator().manual_seed(3))
    assert plain.guides is batch.guides  # weight 1: the guides untouched
    out = wrong_passage_batch(model, batch, 0.2, 16, torch.Generator().manual_seed(3),
                              guide_weight=3.0)
    assert torch.equal(out.embeds, plain.embeds) and out.guides[1] is None
    token = out.embeds.argmax(-1)
    changed = {k for b, k in (token != ids).nonzero().tolist()}
    starts = sorted(k for k in changed if k - 1 not in changed)
    heavy = {q for k in starts for q in range(k, k + 32)} & set(queries.tolist())
    weights = out.guides[0].weights
    assert weights is not None and guide.weights is None  # a new target, the old one kept
    for i, q in enumerate(queries.tolist()):
        assert weights[i] == (3.0 if q in heavy else 1.0)


def test_weighted_guides_keeps_earlier_weights_and_skips_missing_rows():
    guide = GuideTargets(torch.arange(5), torch.arange(2), torch.zeros((5, 2), dtype=torch.long),
                         torch.tensor([1.0, 2.0, 2.0, 1.0, 1.0]))
    out = weighted_guides(guide, torch.tensor([2, 3]), 5.0)
    assert out.weights.tolist() == [1.0, 2.0, 5.0, 5.0, 1.0]
    assert guide.weights.tolist() == [1.0, 2.0, 2.0, 1.0, 1.0]
    assert weighted_guides(None, torch.tensor([1]), 5.0) is None
    assert weighted_guides(guide, torch.tensor([1]), 1.0) is guide


def test_augment_ramp_rises_linearly_to_the_full_share():
    assert [ramp_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert ramp_factor(0, 0) == 1.0
    assert TrainConfig().augment_ramp == 0 and TrainConfig().wrong_source == "same"
    assert TrainConfig().wrong_guide_weight == 1.0


def test_bad_source_weight_or_ramp_fails_before_the_model_loads(tmp_path):
    for cfg in (TrainConfig(wrong_source="elsewhere"), TrainConfig(wrong_guide_weight=-1.0),
                TrainConfig(augment_ramp=-5)):
        with pytest.raises(ValueError, match="--wrong-source"):
            train(tmp_path, tmp_path / "run", cfg, None)
