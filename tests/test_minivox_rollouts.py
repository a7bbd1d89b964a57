"""Free-running rollouts (kvsim.minivox.rollouts): where the reference resumes, what is scored
and guided, and that the writer decodes greedily over one cache."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kvsim.minivox.guided import GuideTargets
from kvsim.minivox.rollouts import (
    GreedyWriter,
    begins_word,
    cut_points,
    resume_index,
    roll_out,
    rollout_batch,
    rollout_guides,
)
from kvsim.minivox.train import Batch, TrainConfig, check_training_options

REF = list(range(100, 160))  # a reference of 60 distinct tokens


@pytest.mark.parametrize(("written", "expected"), [
    (REF[20:28], 28),  # read in place: resume after the last word written
    (REF[20:23] + [7] + REF[24:28], 28),  # one substituted token
    (REF[20:22] + REF[30:34], 34),  # a skip within the window: resume after it
    (REF[5:13], 20),  # a loop over earlier words: back to the cut
    ([1, 2, 3, 4], 20),  # invented text
    (REF[40:46], 20),  # a skip beyond the window (20 + 16): back to the cut
    ([1, REF[22], 2, REF[25], 3], 20),  # single shared tokens are no evidence
    ([], 20),  # nothing written
])
def test_resume_index(written: list[int], expected: int) -> None:
    assert resume_index(REF, 20, written, window=16) == expected


def test_a_lone_shared_token_counts_with_min_block_one() -> None:
    assert resume_index(REF, 20, [1, REF[25], 3], window=16, min_block=1) == 26


def test_cut_points_fall_on_word_starts_inside_the_bounds_and_apart() -> None:
    starts = torch.zeros(300, dtype=torch.bool)
    starts[::3] = True
    for seed in range(20):
        cuts = cut_points(starts, 4, 10, torch.Generator().manual_seed(seed), first=16)
        assert cuts == sorted(cuts) and 1 <= len(cuts) <= 4
        assert all(bool(starts[c]) and 16 <= c < 300 - 10 - 1 for c in cuts)
        assert all(b - a >= 40 for a, b in zip(cuts, cuts[1:], strict=False))
    same = [cut_points(starts, 4, 10, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert same[0] == same[1]


def test_no_cut_in_a_transcript_too_short_for_a_passage() -> None:
    starts = torch.ones(16 + 10 + 1, dtype=torch.bool)
    assert cut_points(starts, 3, 10, torch.Generator().manual_seed(0)) == []


class _ScriptedWriter:
    """Writes the given passages in turn and records the transcript it was handed each time."""

    def __init__(self, passages: list[list[int]]) -> None:
        self.passages, self.seen = list(passages), []

    def write(self, transcript: list[int], tokens: int) -> list[int]:
        self.seen.append(list(transcript))
        return self.passages.pop(0)[:tokens]


def test_roll_out_splices_passages_and_resumes_the_reference() -> None:
    ref = REF + [2]  # the end token last
    writer = _ScriptedWriter([REF[10:12] + [9, 9], [7, 7, 7, 7]])
    answer, rollouts = roll_out(ref, [10, 30], writer, tokens=4, window=8)
    assert writer.seen == [REF[:10], REF[:12] + [9, 9] + REF[12:30]]
    assert answer.tokens == REF[:12] + [9, 9] + REF[12:30] + [7] * 4 + REF[30:] + [2]
    assert answer.reference_index == (list(range(10)) + [-1] * 4 + list(range(12, 30))
                                      + [-1] * 4 + list(range(30, 61)))
    assert [(r.cut, r.written, r.resume) for r in rollouts] == [
        (10, (REF[10], REF[11], 9, 9), 12), (30, (7, 7, 7, 7), 30)]


def test_a_cut_the_reference_already_resumed_past_is_skipped() -> None:
    writer = _ScriptedWriter([REF[10:16]])
    answer, rollouts = roll_out(REF, [10, 14], writer, tokens=6, window=12)
    assert len(rollouts) == 1 and answer.tokens == REF[:16] + REF[16:]


def _toy_batch(prompt: int, ref: list[int], d: int = 4):
    table = torch.nn.Embedding(200, d)
    model = SimpleNamespace(get_input_embeddings=lambda: table)
    embeds = torch.randn(1, prompt + len(ref), d, requires_grad=True)
    labels = torch.full((1, prompt + len(ref)), -100)
    labels[0, prompt - 1:prompt - 1 + len(ref)] = torch.tensor(ref)
    spans = torch.stack([torch.arange(len(ref)), torch.arange(len(ref)) + 1], dim=1)
    guide = GuideTargets(prompt - 1 + torch.arange(len(ref)), torch.arange(1, prompt - 2), spans)
    return model, Batch(embeds, torch.ones_like(labels), labels, [guide])


def test_rollout_batch_scores_and_guides_the_reference_only() -> None:
    p, ref = 6, REF[:40] + [2]
    model, batch = _toy_batch(p, ref)
    writer = _ScriptedWriter([[5, 5, 5]])
    out, rollouts = rollout_batch(model, batch, lambda t: True, 1, 3,
                                  torch.Generator().manual_seed(0), end_id=2, writer=writer)
    (r,) = rollouts
    cut = r.cut
    answer = ref[:cut] + [5, 5, 5] + ref[cut:]
    assert out.embeds.shape[1] == p + len(answer) == out.labels.shape[1] == out.mask.shape[1]
    assert torch.equal(out.embeds[0, :p], batch.embeds[0, :p])
    assert torch.equal(out.embeds[0, p:], model.get_input_embeddings()(torch.tensor(answer)))
    want = torch.full((p + len(answer),), -100)
    want[p - 1:p - 1 + cut] = torch.tensor(ref[:cut])
    want[p - 1 + cut + 3:p - 1 + len(answer)] = torch.tensor(ref[cut:])
    assert torch.equal(out.labels[0], want)
    assert int((out.labels != -100).sum()) == len(ref)  # every reference token still scored
    g = out.guides[0]
    written = set(range(p - 1 + cut, p - 1 + cut + 3))
    assert written.isdisjoint(g.query_positions.tolist())
    assert len(g.query_positions) == len(ref)
    for q, span in zip(g.query_positions.tolist(), g.spans.tolist(), strict=True):
        assert span[0] == ref.index(int(out.labels[0, q]))  # reference token i: span [i, i + 1)
    out.embeds.sum().backward()  # the audio's embeddings keep their gradient
    assert batch.embeds.grad is not None and bool(batch.embeds.grad[0, :p].ne(0).all())


def test_rollout_guides_keep_weights_and_skip_the_unguided_end_token() -> None:
    guide = GuideTargets(torch.arange(4, 7), torch.arange(2), torch.tensor([[0, 1]] * 3),
                         torch.tensor([1.0, 2.0, 3.0]))
    index = torch.tensor([0, -1, -1, 1, 2, 3])  # reference token 3 (the end) has no span
    g = rollout_guides(guide, index, p=5)
    assert g.query_positions.tolist() == [4, 7, 8]
    assert g.weights.tolist() == [1.0, 2.0, 3.0]


def test_rollouts_need_a_batch_of_one() -> None:
    model, batch = _toy_batch(4, REF[:30])
    two = Batch(batch.embeds.expand(2, -1, -1), batch.mask.expand(2, -1), batch.labels.expand(2, -1))
    with pytest.raises(ValueError, match="one example"):
        rollout_batch(model, two, lambda t: True, 1, 3, torch.Generator(), end_id=2)


def _tiny_decoder():
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, vocab_size=40)
    torch.manual_seed(0)
    lm = LlamaModel(cfg).to(torch.float64).eval()
    head = torch.nn.Linear(32, 40, bias=False).to(torch.float64)
    return SimpleNamespace(model=SimpleNamespace(language_model=lm), lm_head=head,
                           get_input_embeddings=lambda: lm.embed_tokens)


def _full_logits(model, prompt: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    x = torch.cat([prompt, model.get_input_embeddings()(torch.tensor([tokens]))], dim=1)
    return model.lm_head(model.model.language_model(inputs_embeds=x).last_hidden_state[0, -1])


@torch.no_grad()
def test_greedy_writer_writes_the_argmax_of_a_full_forward_across_calls() -> None:
    """Two passages over one cache, the second after more reference tokens: each written token
    is the argmax of an uncached forward over everything before it. float64 throughout, so a
    cached and an uncached logit differ by ~1e-15 and 1e-9 separates them from a wrong token
    (a stale or missing cache entry moves the logits by O(0.1))."""
    model = _tiny_decoder()
    prompt = torch.randn(1, 5, 32, dtype=torch.float64)
    writer = GreedyWriter(model, prompt, end_id=-1)
    transcript = [3, 4, 5]
    for extra in ([], [6, 7]):
        transcript += extra
        written = writer.write(list(transcript), 4)
        assert len(written) == 4
        for token in written:
            logits = _full_logits(model, prompt, transcript)
            assert logits[token] >= logits.max() - 1e-9
            transcript.append(token)


@torch.no_grad()
def test_greedy_writer_stops_before_the_end_token() -> None:
    model = _tiny_decoder()
    prompt = torch.randn(1, 5, 32, dtype=torch.float64)
    first = GreedyWriter(model, prompt, end_id=-1).write([3, 4], 3)
    stopped = GreedyWriter(model, prompt, end_id=first[1]).write([3, 4], 3)
    assert stopped == first[:1]
    writer = GreedyWriter(model, prompt, end_id=-1)
    writer.write([3, 4], 2)
    with pytest.raises(ValueError, match="extend"):
        writer.write([9, 9, 9, 9], 2)


def test_begins_word_reads_the_byte_level_space() -> None:
    tok = SimpleNamespace(convert_ids_to_tokens=lambda i: {1: "Ġthe", 2: "cat", 3: "."}[i])
    assert [begins_word(tok)(i) for i in (1, 2, 3)] == [True, False, False]


@pytest.mark.parametrize(("rollouts", "tokens"), [(-1, 32), (2, 0)])
def test_bad_rollout_options_are_refused(rollouts: int, tokens: int) -> None:
    with pytest.raises(ValueError, match="--rollouts"):
        check_training_options(TrainConfig(rollouts=rollouts, rollout_tokens=tokens))
