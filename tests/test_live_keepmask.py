"""The keep-masks live decoding keeps between steps equal the masks built from scratch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsim.live.keepmask import KeepMasks


def from_scratch(read: np.ndarray, audio: np.ndarray, n: int) -> torch.Tensor:
    """The mask as built at every step before: all positions visible but the audio not read."""
    keep = torch.ones((read.shape[0], n), dtype=torch.bool)
    keep[:, torch.as_tensor(audio)] = torch.tensor(read)
    return keep


@pytest.mark.parametrize("contiguous", [True, False])
def test_kept_masks_equal_masks_built_from_scratch(contiguous):
    rng = np.random.default_rng(0)
    n_kv, n_prompt, n_layers = 3, 60, 2
    audio = np.arange(5, 45) if contiguous else np.sort(rng.choice(n_prompt, 40, replace=False))
    masks = KeepMasks(audio, n_layers)
    read = [rng.random((n_kv, audio.size)) < 0.5 for _ in range(n_layers)]
    # long enough to outgrow the spare room, so that a layer's mask is reallocated
    for step in range(KeepMasks.SPARE + 40):
        n = n_prompt + step + 1
        for layer in range(n_layers):
            if step % 7 == layer:  # the read set changes at some steps only
                read[layer] = rng.random((n_kv, audio.size)) < 0.5
            got = masks.get(layer, read[layer], n, torch.device("cpu"))
            assert got.shape == (n_kv, n)
            assert torch.equal(got, from_scratch(read[layer], audio, n)), (step, layer)


def test_a_read_changed_in_place_is_seen_and_a_full_read_masks_nothing():
    audio = np.arange(2, 12)
    masks = KeepMasks(audio, 1)
    read = np.ones((2, audio.size), dtype=bool)
    assert masks.get(0, read, 20, torch.device("cpu")) is None
    read[1, 3] = False
    assert torch.equal(masks.get(0, read, 20, torch.device("cpu")), from_scratch(read, audio, 20))
    read[1, 3], read[0, 0] = True, False  # the same array, changed in place
    assert torch.equal(masks.get(0, read, 21, torch.device("cpu")), from_scratch(read, audio, 21))
