"""Parallel scheduled sampling (kvsim.minivox.scheduled): which inputs are replaced, by what."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsim.minivox.scheduled import mixed_batch, sampled_positions
from kvsim.minivox.train import Batch, TrainConfig, train

V = 11  # vocabulary of the toy model


def _labels() -> torch.Tensor:
    """Row 0: a prompt of 3 positions, then 5 labels at positions 2-6 (the last the end
    token), then padding; row 1: a prompt of 2, then 3 labels at positions 1-3."""
    labels = torch.full((2, 9), -100)
    labels[0, 2:7] = torch.tensor([4, 5, 6, 7, 1])
    labels[1, 1:4] = torch.tensor([8, 9, 1])
    return labels


class _ShiftModel:
    """A real embedding table and output head around a decoder that maps token t's embedding
    to the hidden state whose greedy token is t + 3 (mod V): the prediction at every position
    is known, and it counts its forward passes."""

    def __init__(self) -> None:
        self.table = torch.nn.Embedding(V, V)
        self.table.weight.data = torch.eye(V) * 2.0
        self.lm_head = torch.nn.Linear(V, V, bias=False)
        self.lm_head.weight.data = torch.eye(V)
        shift = torch.roll(torch.eye(V), 3, dims=0)
        self.passes = 0

        def language_model(inputs_embeds, attention_mask, use_cache):
            self.passes += 1
            return SimpleNamespace(last_hidden_state=inputs_embeds @ shift.T)

        self.model = SimpleNamespace(language_model=language_model)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.table


def _batch(model: _ShiftModel, ids: torch.Tensor) -> Batch:
    embeds = model.table(ids).detach().requires_grad_(True)
    return Batch(embeds, torch.ones_like(ids), _labels())


def test_only_transcript_inputs_that_feed_a_scored_prediction_are_drawn() -> None:
    labels = _labels()
    everything = sampled_positions(labels, 1.0, torch.Generator().manual_seed(0))
    expected = torch.zeros_like(everything)
    expected[0, 3:7] = True  # inputs 3-6 are labels 2-5, and positions 3-6 are scored
    expected[1, 2:4] = True
    assert torch.equal(everything, expected)
    assert not sampled_positions(labels, 0.0, torch.Generator().manual_seed(0)).any()


def test_the_draw_is_the_share_and_a_function_of_the_seed() -> None:
    labels = torch.zeros((200, 401), dtype=torch.long)
    labels[:, 0] = -100  # every input but the first two columns' is mixable
    a = sampled_positions(labels, 0.3, torch.Generator().manual_seed(5))
    assert abs(a.float().mean().item() * 401 / 400 - 0.3) < 0.01
    assert torch.equal(a, sampled_positions(labels, 0.3, torch.Generator().manual_seed(5)))
    assert not torch.equal(a, sampled_positions(labels, 0.3, torch.Generator().manual_seed(6)))


@pytest.mark.parametrize("share", [1.0, 0.5])
def test_replaced_inputs_are_the_previous_positions_greedy_tokens(share: float) -> None:
    model = _ShiftModel()
    ids = torch.tensor([[0, 0, 2, 4, 5, 6, 7, 1, 1], [0, 3, 8, 9, 1, 1, 1, 1, 1]])
    batch = _batch(model, ids)
    drawn = sampled_positions(batch.labels, share, torch.Generator().manual_seed(1))
    mixed = mixed_batch(model, batch, share, torch.Generator().manual_seed(1))
    assert model.passes == 1
    assert mixed.labels is batch.labels and mixed.mask is batch.mask
    for b, k in drawn.nonzero().tolist():  # greedy at k - 1 is (its input + 3) mod V
        assert torch.equal(mixed.embeds[b, k], model.table.weight[(ids[b, k - 1] + 3) % V])
    assert torch.equal(mixed.embeds[~drawn], batch.embeds[~drawn])
    assert drawn.any() and (share == 1.0) == bool(drawn.sum() == 6)
    # the mixed inputs carry no gradient back to the teacher inputs they replaced
    mixed.embeds.sum().backward()
    assert torch.equal(batch.embeds.grad[drawn], torch.zeros_like(batch.embeds.grad[drawn]))
    assert torch.equal(batch.embeds.grad[~drawn], torch.ones_like(batch.embeds.grad[~drawn]))


def test_nothing_drawn_means_no_first_pass() -> None:
    model = _ShiftModel()
    batch = _batch(model, torch.zeros((2, 9), dtype=torch.long))
    assert mixed_batch(model, batch, 0.0, torch.Generator().manual_seed(0)) is batch
    assert model.passes == 0


def test_teacher_forcing_is_the_default() -> None:
    assert TrainConfig().sampled_share == 0.0


@pytest.mark.parametrize("share", [-0.1, 1.5])
def test_a_share_outside_0_to_1_fails_before_the_model_loads(tmp_path, share: float) -> None:
    with pytest.raises(ValueError, match="--sampled-share"):
        train(tmp_path, tmp_path / "run", TrainConfig(sampled_share=share), None)
