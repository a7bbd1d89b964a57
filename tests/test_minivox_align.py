"""Stage-1 CTC alignment of the minivox projector (kvsim.minivox.align)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvsim.minivox.align import CTCHead, greedy_decode, length_batches, valid_tokens


def _logits(path: list[int], vocab: int = 6) -> torch.Tensor:
    out = torch.full((len(path), vocab), -5.0)
    out[torch.arange(len(path)), torch.tensor(path)] = 5.0
    return out


def test_greedy_decode_collapses_repeats_and_drops_blanks():
    assert greedy_decode(_logits([0, 3, 3, 0, 3, 2, 2, 0, 0, 1]), 10) == [3, 3, 2, 1]
    assert greedy_decode(_logits([0, 0, 0]), 3) == []
    # positions past `length` (zero padding of the last window) are ignored
    assert greedy_decode(_logits([4, 0, 5, 5]), 2) == [4]


def test_length_batches_cover_each_clip_once_within_the_token_budget():
    rng = np.random.default_rng(1)
    items = [(torch.zeros(int(n), 1), [1], "") for n in rng.integers(50, 800, size=97)]
    batches = length_batches(items, 2000, np.random.default_rng(0))
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(97))
    for b in batches:
        longest = max(items[k][0].shape[0] for k in b)
        assert len(b) == 1 or len(b) * longest <= 2000
    again = length_batches(items, 2000, np.random.default_rng(0))
    assert all(np.array_equal(x, y) for x, y in zip(batches, again, strict=True))


def test_valid_tokens_trims_window_padding():
    assert valid_tokens(10.0, 375) == 127  # ceil(10 * 12.5) + 2
    assert valid_tokens(29.99, 375) == 375
    assert valid_tokens(45.0, 750) == 565


def test_ctc_through_frozen_embeddings_learns_a_readable_projection():
    """A projector trained by CTC against frozen embedding rows recovers the token sequence,
    and its outputs at the emitting positions point at the right embedding rows."""
    torch.manual_seed(0)
    vocab, dim, feat = 7, 16, 12
    emb = torch.randn(vocab, dim)
    codes = torch.randn(vocab + 1, feat)  # feature pattern per token; row 0 = silence

    def clip(tokens: list[int]) -> torch.Tensor:
        frames = []
        for t in tokens:
            frames += [0, t + 1, t + 1, 0]
        return codes[torch.tensor(frames)] + 0.1 * torch.randn(len(frames), feat)

    proj = nn.Sequential(nn.Linear(feat, dim, bias=False), nn.GELU(), nn.Linear(dim, dim, bias=False))
    head = CTCHead(emb)
    opt = torch.optim.Adam(list(proj.parameters()) + list(head.parameters()), lr=2e-2)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        seqs = [torch.randint(0, vocab, (5,), generator=g).tolist() for _ in range(8)]
        x = torch.stack([clip(s) for s in seqs])
        logp = F.log_softmax(head(proj(x)), -1).transpose(0, 1)
        tgt = torch.tensor([t + 1 for s in seqs for t in s])
        loss = F.ctc_loss(logp, tgt, torch.full((8,), x.shape[1]), torch.full((8,), 5), blank=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    seq = [3, 1, 4, 1, 5]
    with torch.no_grad():
        y = proj(clip(seq))
        decoded = [k - 1 for k in greedy_decode(head(y), y.shape[0])]
    assert decoded == seq
    # the emitting frames (middle of each token) point at the token's embedding
    cos = F.normalize(y[1::4], dim=-1) @ F.normalize(emb, dim=-1).T
    assert cos.argmax(-1).tolist() == seq
    assert cos[torch.arange(5), torch.tensor(seq)].min() > 0.5


def _synthetic_corpus():
    """(vocab, feature width, clip maker, 64 training clips, CTC head, fresh aligner): clips
    whose frames encode BPE ids of a five-token vocabulary, noise added."""
    from kvsim.minivox.align import CTCAligner, projector

    torch.manual_seed(0)
    vocab = [11, 23, 37, 41, 58]  # BPE ids as they occur in transcripts
    feat = 12
    codes = torch.randn(len(vocab) + 1, feat)

    def clip(ids: list[int]):
        frames = []
        for t in ids:
            frames += [0, vocab.index(t) + 1, vocab.index(t) + 1, 0]
        x = codes[torch.tensor(frames)] + 0.1 * torch.randn(len(frames), feat)
        return x, ids, " ".join(map(str, ids))

    g = torch.Generator().manual_seed(1)
    train = [clip([vocab[k] for k in torch.randint(0, 5, (5,), generator=g).tolist()])
             for _ in range(64)]
    head = CTCHead(torch.randn(len(vocab), 576))
    return vocab, feat, clip, train, head, CTCAligner(projector(feat, None), head, vocab, bf16=False)


def test_an_interrupted_stage_1_leaves_no_finished_projector(tmp_path):
    """fit_and_save: evaluations write the partial file; only the run's end writes --out (the
    recipe skips a stage whose output exists) and removes the partial file."""
    from kvsim.minivox.align import AlignConfig, fit_and_save, partial_path

    *_, train, _, aligner = _synthetic_corpus()
    out = tmp_path / "align.safetensors"
    assert partial_path(out) == tmp_path / "align.partial.safetensors"
    cfg = AlignConfig(epochs=2, batch_tokens=160, lr=1e-2, eval_every=4, out=out)
    calls = []

    def interrupted() -> float:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return 0.5

    with pytest.raises(KeyboardInterrupt):
        fit_and_save(aligner, train, cfg, interrupted)
    assert not out.exists() and partial_path(out).is_file()
    assert steps_saved(partial_path(out)) == 4
    assert fit_and_save(aligner, train, cfg, lambda: 0.25) == (16, 0.25)
    assert out.is_file() and not partial_path(out).exists()
    assert steps_saved(out) == 16


def steps_saved(path) -> int:
    """The step count an aligner's saved projector records."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        return int(f.metadata()["steps"])


def test_fit_trains_a_ctc_aligner_that_transcribes_and_saves(tmp_path):
    """The stage-1 loop (fit + CTCAligner) end to end on a synthetic corpus: non-contiguous
    BPE ids map through the compact vocabulary and back, the saved projector reloads, and
    --no-bf16 reaches the aligner's configuration."""
    from kvsim.minivox.align import AlignConfig, CTCAligner, fit, parse_args, projector

    vocab, feat, clip, train, head, aligner = _synthetic_corpus()
    cfg = AlignConfig(epochs=30, batch_tokens=160, lr=1e-2, eval_every=10**6, out=tmp_path / "p.st")
    evaluated: list[int] = []
    steps = fit(aligner, train, cfg, lambda step: evaluated.append(step) or 0.0)
    assert steps == 30 * 8 and evaluated == []  # 64 clips of 20 frames, 8 per batch
    test = [clip([41, 11, 58, 23, 37]), clip([37, 37, 11])]
    decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    assert aligner.transcribe(test, decode) == [t for _, _, t in test]
    aligner.save(cfg.out, steps, 0.0)
    again = CTCAligner(projector(feat, cfg.out), head, vocab, bf16=False)
    assert again.transcribe(test, decode) == [t for _, _, t in test]
    assert not cfg.out.with_suffix(".tmp").exists()
    assert parse_args(["--no-bf16", "--stop-step", "5"]).bf16 is False
    assert parse_args([]) == AlignConfig()
    wide = parse_args(["--encoder", "base", "--train-splits", "train"])
    assert (wide.encoder, wide.train_splits) == ("base", "train")
    with pytest.raises(ValueError, match=f"^{re.escape(str(cfg.out))}: a projector for 12 input features, "
                       "this encoder gives 24 \\(--encoder\\)$"):
        projector(2 * feat, cfg.out)
