"""python -m kvsim.minivox.evaluate --summarise: what it reads, and how it refuses bad files."""

from __future__ import annotations

import json

import pytest

from kvsim.minivox.evaluate import main, read_records


def _rec(split="test_long", cid="test_long-00000", **extra):
    return {"split": split, "id": cid, "wer": 0.5, "errors": 1, "ref_words": 2,
            "n_gen": 3, "hyp": "a b", "ref": "a c", **extra}


def _write(path, recs, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs) + tail)
    return path


def test_records_of_several_files_in_order(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_rec(cid="c0"), _rec(cid="c2")], tail="\n")
    b = _write(tmp_path / "b.jsonl", [_rec(cid="c1"), _rec(split="test_new", cid="c0")])
    assert [(r["split"], r["id"]) for r in read_records([a, b])] == [
        ("test_long", "c0"), ("test_long", "c2"), ("test_long", "c1"), ("test_new", "c0")]


def test_a_clip_twice_is_refused_naming_both_places(tmp_path):
    """The same shard passed twice would count its clips twice in the corpus WER."""
    a = _write(tmp_path / "a.jsonl", [_rec(cid="c0"), _rec(cid="c1")])
    with pytest.raises(ValueError) as exc:
        read_records([a, a])
    msg = str(exc.value)
    assert "test_long/c0" in msg and f"{a}: line 1" in msg and "twice" in msg


def test_a_line_that_is_not_json_names_file_and_line(tmp_path):
    a = _write(tmp_path / "a.jsonl", [_rec()], tail='{"split": "t", "id"\n')
    with pytest.raises(ValueError, match=rf"{a}: line 2: not a JSON record"):
        read_records([a])
    b = _write(tmp_path / "b.jsonl", [], tail="[1, 2]\n")
    with pytest.raises(ValueError, match=rf"{b}: line 1: not a JSON record"):
        read_records([b])


def test_a_record_without_its_clip_is_refused(tmp_path):
    a = _write(tmp_path / "a.jsonl", [{"split": "t", "wer": 0.1}])
    with pytest.raises(ValueError, match=rf"{a}: line 1: no field 'id'"):
        read_records([a])


def test_missing_field_names_the_field(tmp_path):
    rec = _rec()
    del rec["hyp"]
    a = _write(tmp_path / "a.jsonl", [rec])
    with pytest.raises(ValueError, match=rf"{a}: line 1: no field 'hyp'"):
        read_records([a], ("hyp", "ref"))


@pytest.mark.parametrize("content", [None, "not json\n"])
def test_summarise_bad_file_is_one_line(tmp_path, capsys, content):
    path = tmp_path / "e.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SystemExit) as exc:
        main(["--summarise", str(path)])
    assert str(exc.value).startswith(f"error: {path}")
    assert "\n" not in str(exc.value)
