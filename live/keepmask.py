"""The keep-masks of the masking path of live decoding, kept from one decode step to the next.

At every decode step and layer attention reads the non-audio positions and the audio a policy
keeps (and selects) per KV-head. Building that (H_kv, N) mask from scratch at every step and
layer costs an allocation of the whole context and a scatter of the audio columns; here each
layer keeps one mask with room to grow, the positions past the prompt are already visible, and
the audio columns are rewritten only when what the policy reads there changed (WnW's tiers
change at a few steps; a query-aware policy's selection may change at every step).
"""

from __future__ import annotations

import numpy as np
import torch


class KeepMasks:
    """Per-layer keep-masks ``(H_kv, N)`` bool, True where attention may read.

    Parameters
    ----------
    audio_positions : (T_a,) int
        Absolute positions of the audio, sorted.
    n_layers : int
        Decoder layers.
    """

    #: room added beyond the context length when a layer's mask is (re)allocated
    SPARE = 256

    def __init__(self, audio_positions: np.ndarray, n_layers: int) -> None:
        audio = np.asarray(audio_positions, dtype=np.int64)
        lo, hi = int(audio[0]), int(audio[-1]) + 1
        self._contiguous = hi - lo == len(audio)
        self._audio_np = audio
        self._audio_slice = slice(lo, hi)
        self._audio_t: torch.Tensor | None = None
        self._masks: list[torch.Tensor | None] = [None] * n_layers
        self._written: list[np.ndarray | None] = [None] * n_layers  # audio columns as written

    def get(self, layer: int, read: np.ndarray, n: int, device: torch.device) -> torch.Tensor | None:
        """The keep-mask of ``layer`` for a context of ``n`` positions, or None when ``read``
        (H_kv, T_a) bool keeps every audio position (nothing to mask).

        The returned tensor is a view valid until the next call for this layer.
        """
        if read.all():
            return None
        keep = self._mask(layer, read.shape[0], n, device)
        written = self._written[layer]
        if written is None or not np.array_equal(written, read):
            written = np.array(read, dtype=bool)  # a copy: ``read`` may change in place later
            keep[:, self._audio_index(device)] = torch.from_numpy(written).to(device)
            self._written[layer] = written
        return keep[:, :n]

    def get_device(self, layer: int, read: torch.Tensor, n: int) -> torch.Tensor:
        """:meth:`get` for a ``read`` (H_kv, T_a) bool tensor on the model's device (a
        selection made there): its audio columns are written at every call, since finding out
        whether they changed would read them back to the host. Never None."""
        keep = self._mask(layer, read.shape[0], n, read.device)
        self._written[layer] = None  # the host copy no longer describes the mask
        keep[:, self._audio_index(read.device)] = read
        return keep[:, :n]

    def _mask(self, layer: int, n_kv: int, n: int, device: torch.device) -> torch.Tensor:
        """The layer's mask, (re)allocated all True with room to grow when it is missing,
        too short or on another device (nothing written in it then)."""
        keep = self._masks[layer]
        if keep is None or keep.shape[1] < n or keep.device != device:
            keep = torch.ones((n_kv, n + self.SPARE), dtype=torch.bool, device=device)
            self._masks[layer], self._written[layer] = keep, None
        return keep

    def _audio_index(self, device: torch.device) -> slice | torch.Tensor:
        if self._contiguous:
            return self._audio_slice
        if self._audio_t is None or self._audio_t.device != device:
            self._audio_t = torch.as_tensor(self._audio_np, device=device)
        return self._audio_t
