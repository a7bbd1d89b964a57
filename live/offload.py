"""Physical offload: audio KV that is not GPU-resident really leaves the device cache.

After prefill every decoder layer's cache is replaced by an :class:`OffloadLayer` whose device
tensor holds, in this order, the non-audio prompt positions before the end of the audio span,
the *resident* audio positions of each KV-head (sorted by position, padded to the layer's
largest per-head count; padding slots are masked out), then the prompt positions after the
audio and the generated tokens. A host mirror of every audio K/V (pinned when the device is
CUDA) is the CPU tier; recalled positions are gathered there into a pinned staging buffer and
copied to the device on a separate copy stream (on CPU: a host-to-host copy, so the path runs
and is tested without an accelerator). Positions leaving the GPU tier are simply dropped from
the rebuilt device tensor, whose old storage is freed.

Attention is permutation invariant over keys (they are post-RoPE), so this layout computes the
same function as the masking emulation (:mod:`kvsim.live.attention`); the tests check that both
paths produce the same tokens (WnW, ArkVale).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.cache_utils import DynamicLayer


@dataclass
class TransferStats:
    """What the physical path actually moved (host -> device)."""

    h2d_tokens: int = 0  #: (kv-head, position) pairs copied
    h2d_bytes: int = 0
    copies: int = 0  #: host->device copy calls issued
    rebuilds: int = 0  #: device tensor rebuilds (tier changes applied)


class OffloadLayer(DynamicLayer):
    """One layer's KV cache with the audio span physically compacted per KV-head."""

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        audio_positions: np.ndarray,
        resident: np.ndarray,
        stats: TransferStats,
        copy_stream: torch.cuda.Stream | None = None,
    ) -> None:
        super().__init__()
        if keys.shape[0] != 1:
            raise ValueError("physical offload supports batch size 1 only")
        self.device = keys.device
        self.is_initialized = True
        self.stats = stats
        self.copy_stream = copy_stream
        n = keys.shape[2]
        audio = np.asarray(audio_positions, dtype=np.int64)
        last = int(audio[-1])
        is_audio = np.zeros(n, dtype=bool)
        is_audio[audio] = True
        pre = np.flatnonzero(~is_audio[: last + 1])
        post = np.arange(last + 1, n)
        self.n_audio = len(audio)
        self.n_pre = len(pre)
        pin = self.device.type == "cuda"
        # host mirror of every audio position = the CPU tier (K and V), (H_kv, T_a, D)
        a_idx = torch.as_tensor(audio, device=self.device)
        self.host_k = keys[0].index_select(1, a_idx).to("cpu").contiguous()
        self.host_v = values[0].index_select(1, a_idx).to("cpu").contiguous()
        if pin:
            self.host_k, self.host_v = self.host_k.pin_memory(), self.host_v.pin_memory()
        h_kv = keys.shape[1]
        self.slot_pos = np.zeros((h_kv, 0), dtype=np.int64)
        self.slot_valid = np.zeros((h_kv, 0), dtype=bool)
        self.resident = np.zeros((h_kv, self.n_audio), dtype=bool)
        pre_t = torch.as_tensor(pre, device=self.device)
        post_t = torch.as_tensor(post, device=self.device)
        self.keys = torch.cat([keys.index_select(2, pre_t), keys.index_select(2, post_t)], dim=2)
        self.values = torch.cat([values.index_select(2, pre_t), values.index_select(2, post_t)], dim=2)
        self.logical_len = n
        self._staging: list[torch.Tensor] = []
        # the device audio slots start empty; fill them from the host mirror (prefill tiers)
        self.sync(resident, count_transfers=False)

    # ------------------------------------------------------------------ transformers API
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.logical_len += key_states.shape[-2]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.logical_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.logical_len + query_length, 0

    # ------------------------------------------------------------------ tiers
    @property
    def n_slots(self) -> int:
        return self.slot_pos.shape[1]

    def device_audio_bytes(self) -> int:
        """Bytes of audio K+V held on the device by this layer (padding slots included)."""
        return 2 * self.keys.shape[1] * self.n_slots * self.keys.shape[3] * self.keys.element_size()

    def sync(self, resident: np.ndarray, count_transfers: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Make the device slots hold exactly ``resident`` (H_kv, T_a) bool; return the device
        keys/values. Kept positions move device->device, new ones come from the host mirror."""
        resident = np.asarray(resident, dtype=bool)
        if np.array_equal(resident, self.resident):
            return self.keys, self.values
        h_kv, t_a = resident.shape
        counts = resident.sum(1)
        c_new = int(counts.max()) if h_kv else 0
        new_pos = np.zeros((h_kv, c_new), dtype=np.int64)
        new_valid = np.arange(c_new)[None, :] < counts[:, None]
        for h in range(h_kv):
            new_pos[h, : counts[h]] = np.flatnonzero(resident[h])
        old_slot = np.full((h_kv, t_a), -1, dtype=np.int64)
        for h in range(h_kv):
            ok = self.slot_valid[h]
            old_slot[h, self.slot_pos[h, ok]] = np.flatnonzero(ok)
        src = old_slot[np.arange(h_kv)[:, None], new_pos]
        from_dev = new_valid & (src >= 0)
        from_host = new_valid & (src < 0)
        d = self.keys.shape[3]
        dev = self.device
        c_old = self.n_slots
        old_k = self.keys[0, :, self.n_pre : self.n_pre + c_old]
        old_v = self.values[0, :, self.n_pre : self.n_pre + c_old]
        new_k = torch.zeros((h_kv, c_new, d), dtype=self.keys.dtype, device=dev)
        new_v = torch.zeros_like(new_k)
        hh, ss = np.nonzero(from_dev)
        if len(hh):
            h_t, s_t = torch.as_tensor(hh, device=dev), torch.as_tensor(ss, device=dev)
            o_t = torch.as_tensor(src[hh, ss], device=dev)
            new_k[h_t, s_t] = old_k[h_t, o_t]
            new_v[h_t, s_t] = old_v[h_t, o_t]
        hh, ss = np.nonzero(from_host)
        if len(hh):
            k_dev, v_dev = self._recall(torch.as_tensor(hh), torch.as_tensor(new_pos[hh, ss]))
            h_t, s_t = torch.as_tensor(hh, device=dev), torch.as_tensor(ss, device=dev)
            new_k[h_t, s_t] = k_dev
            new_v[h_t, s_t] = v_dev
            if count_transfers:
                n = len(hh)
                self.stats.h2d_tokens += n
                self.stats.h2d_bytes += 2 * n * d * self.keys.element_size()
                self.stats.copies += 2
        post_k = self.keys[:, :, self.n_pre + c_old :]
        post_v = self.values[:, :, self.n_pre + c_old :]
        pre_k = self.keys[:, :, : self.n_pre]
        pre_v = self.values[:, :, : self.n_pre]
        # the old tensors are dropped here: their device memory is released to the allocator
        self.keys = torch.cat([pre_k, new_k[None], post_k], dim=2)
        self.values = torch.cat([pre_v, new_v[None], post_v], dim=2)
        self.slot_pos, self.slot_valid, self.resident = new_pos, new_valid, resident.copy()
        if count_transfers:
            self.stats.rebuilds += 1
        return self.keys, self.values

    def _recall(self, heads: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather (head, position) pairs from the host mirror and copy them to the device (on a
        copy stream when CUDA; the compute stream waits for it)."""
        flat = heads * self.n_audio + pos
        d = self.host_k.shape[2]
        hk = self.host_k.view(-1, d)
        hv = self.host_v.view(-1, d)
        cuda = self.device.type == "cuda"
        # gather into a (pinned, on CUDA) staging buffer: one contiguous copy per K and V
        sk = torch.empty((len(flat), d), dtype=hk.dtype, pin_memory=cuda)
        sv = torch.empty((len(flat), d), dtype=hv.dtype, pin_memory=cuda)
        torch.index_select(hk, 0, flat, out=sk)
        torch.index_select(hv, 0, flat, out=sv)
        if not cuda:
            return sk, sv  # host-to-host: the "device" is the CPU
        compute = torch.cuda.current_stream(self.device)
        stream = self.copy_stream or compute
        with torch.cuda.stream(stream):
            k_dev = sk.to(self.device, non_blocking=True)
            v_dev = sv.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        compute.wait_event(event)
        # allocated on the copy stream, used on the compute stream
        k_dev.record_stream(compute)
        v_dev.record_stream(compute)
        self._staging = [sk, sv]  # keep the pinned buffers alive until the copy has run
        return k_dev, v_dev

    # ------------------------------------------------------------------ attention helpers
    def keep_mask(self, read: np.ndarray) -> torch.Tensor | None:
        """Keep-mask over the physical keys (H_kv, N'): audio slots that are valid and read;
        None when every slot is read (the stock attention path applies)."""
        slots = self.slot_valid & np.take_along_axis(read, self.slot_pos, axis=1)
        if slots.all():
            return None
        keep = torch.ones((self.keys.shape[1], self.keys.shape[2]), dtype=torch.bool, device=self.device)
        keep[:, self.n_pre : self.n_pre + self.n_slots] = torch.as_tensor(slots, device=self.device)
        return keep

    def audio_columns(self, probs: torch.Tensor) -> torch.Tensor:
        """Scatter physical attention probabilities (H_q, N') back to audio columns (H_q, T_a)."""
        h_q = probs.shape[0]
        h_kv = self.slot_pos.shape[0]
        g = h_q // h_kv
        slots = probs[:, self.n_pre : self.n_pre + self.n_slots]
        valid = torch.as_tensor(self.slot_valid, device=probs.device).repeat_interleave(g, dim=0)
        idx = torch.as_tensor(self.slot_pos, device=probs.device).repeat_interleave(g, dim=0)
        out = torch.zeros((h_q, self.n_audio), dtype=probs.dtype, device=probs.device)
        return out.scatter_add_(1, idx, slots * valid)


def install_offload(cache, audio_positions: np.ndarray, tiers_gpu: np.ndarray, device: torch.device) -> TransferStats:
    """Replace every layer of a prefilled ``DynamicCache`` by an :class:`OffloadLayer` holding on
    the device only the audio positions with ``tiers_gpu[layer]`` (L, H_kv, T_a) True."""
    stats = TransferStats()
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None
    for i, layer in enumerate(list(cache.layers)):
        cache.layers[i] = OffloadLayer(layer.keys, layer.values, audio_positions, tiers_gpu[i], stats, stream)
    return stats
