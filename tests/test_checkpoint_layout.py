"""A checkpoint directory as tierstack/checkpoint_layout.py reads it: which tag a directory
means, what is refused and how the refusal says what to give, which old tags go."""

from __future__ import annotations

from pathlib import Path

import pytest

from tierstack.checkpoint_layout import (ModelMap, find, latest_tag, model_map, older_tags,
                                         remove_format1, tags, verify, weight_names, write_latest,
                                         write_listing)
from tierstack.errors import DataCorruptionError, InvalidArgumentError


def _tag(directory: Path, name: str, model: ModelMap | None = None) -> Path:
    path = directory / name
    path.mkdir(parents=True)
    (path / "engine.pt").write_bytes(b"meta")
    (path / "block-00000.safetensors").write_bytes(b"block")
    write_listing(path, model)
    return path


def test_without_a_tag_the_latest_is_read_and_a_tag_directory_is_read_as_itself(tmp_path):
    for step in (9, 10, 2):
        _tag(tmp_path, f"global_step{step}")
    assert tags(tmp_path) == ["global_step2", "global_step9", "global_step10"]  # by step
    write_latest(tmp_path, "global_step9")
    assert latest_tag(tmp_path) == "global_step9" and not (tmp_path / ".latest.writing").exists()
    assert find(tmp_path) == tmp_path / "global_step9"
    assert find(tmp_path, "global_step10") == tmp_path / "global_step10"
    assert find(tmp_path / "global_step2") == tmp_path / "global_step2"  # one tag given directly


def test_what_cannot_be_read_is_refused_in_one_line_saying_what_to_give(tmp_path):
    _tag(tmp_path, "global_step1")
    _tag(tmp_path, "global_step2")
    with pytest.raises(InvalidArgumentError, match=r"has no 'latest' file and holds no checkpoint "
                                                   r"itself; give a tag \(tags there: global_step1, "
                                                   r"global_step2\)"):
        find(tmp_path)
    with pytest.raises(InvalidArgumentError, match=r"no checkpoint 'global_step3' in .*; give a tag "
                                                   r"saved there \(tags there: global_step1, global_step2\)"):
        find(tmp_path, "global_step3")
    (tmp_path / "latest").write_text("global_step7\n")
    with pytest.raises(InvalidArgumentError, match=r"latest names tag 'global_step7', but .* is not a "
                                                   r"checkpoint; give a tag saved there"):
        find(tmp_path)
    with pytest.raises(InvalidArgumentError, match="save a checkpoint there first"):
        find(_empty(tmp_path))
    with pytest.raises(InvalidArgumentError, match="no checkpoint directory"):
        find(tmp_path / "missing")
    with pytest.raises(InvalidArgumentError, match="plain name"):
        find(tmp_path, "../global_step1")


def _empty(tmp_path: Path) -> Path:
    path = tmp_path / "empty"
    path.mkdir()
    return path


def test_a_listed_file_that_changed_is_refused_and_format_1_names_no_model(tmp_path):
    model = ModelMap("model.layers", [0, 1], "bf16", 3, {"lm_head.weight": "model.embed_tokens.weight"})
    tag = _tag(tmp_path, "global_step3", model)
    assert model_map(tag, verify(tag)) == model
    old = _tag(tmp_path, "old")
    with pytest.raises(InvalidArgumentError, match=r"before tierstack checkpoints named their model's "
                                                   r"blocks \(format 1\): load it with load_checkpoint "
                                                   r"or --resume and save it again"):
        model_map(old, verify(old))
    (tag / "block-00000.safetensors").write_bytes(b"BLOCK")
    with pytest.raises(DataCorruptionError, match="block-00000.safetensors is missing or does not match"):
        verify(tag)


def test_older_tags_go_the_latest_stays_and_a_format_1_checkpoint_is_removed_once_replaced(tmp_path):
    format1 = tmp_path  # tierstack train's old layout: the checkpoint's files in the directory itself
    (format1 / "engine.pt").write_bytes(b"old meta")
    (format1 / "block-00000.safetensors").write_bytes(b"old block")
    write_listing(format1, None)
    (format1 / "notes.txt").write_text("the user's")  # written after: not the checkpoint's
    for step in (2, 4, 6):
        _tag(tmp_path, f"global_step{step}")
    write_latest(tmp_path, "global_step4")
    assert older_tags(tmp_path, 0) == []  # 0: keep every one
    assert older_tags(tmp_path, 1) == ["global_step2", "global_step6"]
    assert older_tags(tmp_path, 2) == ["global_step2"]
    remove_format1(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "global_step2", "global_step4", "global_step6", "latest", "notes.txt"]


def test_a_weight_s_state_is_told_from_a_weight_by_the_weight_beside_it():
    keys = ["w", "w.master", "w.exp_avg", "w.exp_avg_sq", "norm.step", "emb.master.weight", "x.step"]
    assert weight_names(keys) == ["w", "norm.step", "emb.master.weight", "x.step"]
