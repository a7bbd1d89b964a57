"""minivox extra training text: WordNet parsing and leak-free filtering against held-out text."""

from __future__ import annotations

from pathlib import Path

from kvsim.minivox.extra_text import load_extra_texts, parse_wordnet_line

VERB = ('00003142 29 v 02 exhale 0 expire 2 006 + 00844254 n 0000 | expel air; '
        '"Exhale when you lift the weight"; "force out the air"  ')
ADJ = ('00001740 00 a 01 able(a) 0 005 | (usually followed by `to\') having the necessary means '
       'or skill or know-how or authority to do something; "able to swim"  ')


def test_parse_wordnet_line_reads_lemmas_definition_and_examples():
    lemmas, definition, examples = parse_wordnet_line(VERB)
    assert lemmas == ["exhale", "expire"]
    assert definition == "expel air"
    assert examples == ["Exhale when you lift the weight", "force out the air"]
    lemmas, definition, _ = parse_wordnet_line(ADJ)
    assert lemmas == ["able"]  # the (a) marker is dropped
    assert definition.startswith("(usually followed by")
    assert parse_wordnet_line("  1 This software and database is being provided") is None


def _fixture(tmp: Path) -> tuple[Path, Path]:
    wn, fortunes = tmp / "wordnet", tmp / "fortunes"
    wn.mkdir()
    fortunes.mkdir()
    (wn / "data.verb").write_text(VERB + "\n")
    (wn / "data.adj").write_text(ADJ + "\n")
    (wn / "data.noun").write_text(
        '00002000 03 n 01 mirth 0 000 | great merriment; "there was mirth at the old inn"; '
        '"The kettle sang a merry little tune"  \n')
    (wn / "data.adv").write_text("")
    (fortunes / "anarchism").write_text(
        "Things tend to organise themselves in the end.\n\t\t-- Alan Moore\n%\n"
        "Exhale when you lift the weight\n%\nshort one\n")
    return wn, fortunes


def test_extra_texts_skip_base_and_heldout_text(tmp_path):
    wn, fortunes = _fixture(tmp_path)
    base = ["Exhale when you lift the weight."]  # a base fortune (any split)
    heldout = ["And the kettle sang a merry little tune, said she."]  # quotes a WordNet example
    texts = load_extra_texts(base, heldout, fortunes, wn)
    assert "Things tend to organise themselves in the end." in texts  # attribution dropped
    assert "There was mirth at the old inn." in texts  # example, capitalised
    assert "Exhale, expel air." not in texts  # fewer than 4 words
    assert not any("Exhale when" in t for t in texts)  # equals a base fortune
    assert not any("kettle" in t for t in texts)  # inside a held-out text
    assert len(texts) == len(set(texts))
    assert load_extra_texts(base, heldout, fortunes, wn) == texts  # stable order
    assert load_extra_texts([], [], fortunes, wn) != texts


def test_extra_texts_name_the_missing_package(tmp_path):
    import pytest

    with pytest.raises(FileNotFoundError, match="fortune-anarchism"):
        load_extra_texts([], [], tmp_path, tmp_path)
    (tmp_path / "anarchism").write_text("Things tend to organise themselves in the end.\n")
    with pytest.raises(FileNotFoundError, match="wordnet-base"):
        load_extra_texts([], [], tmp_path, tmp_path / "nowhere")
