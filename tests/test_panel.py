"""The panel of development corpora: tools/make_panel.py on a tiny msrc21-like and coco128-like
source made here (answers known by construction), the panel's figures, means and targets
(tasks.bench.panel), and `wsseg bench panel` end to end on two tiny corpora."""
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.conftest import load_tool

MSRC = ["building", "grass", "tree", "cow", "sheep", "sky", "aeroplane", "water", "face", "car", "bicycle", "flower",
        "sign", "bird", "book", "chair", "road", "cat", "dog", "body", "boat"]
C = {name: i for i, name in enumerate(MSRC)}
H, W = 12, 16


def _tool():
    return load_tool("make_panel")


def _write(root: Path, classes: list[str], items: list[tuple[str, str, np.ndarray]]) -> None:
    """A dataset folder: each item (id, split, mask) gets a random photo and tags = its mask's classes."""
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    (root / "classes.txt").write_text("".join(f"{c}\n" for c in classes))
    rng = np.random.default_rng(0)
    rows = ["image_id,split,labels"]
    for iid, split, mask in items:
        Image.fromarray(rng.integers(0, 255, (H, W, 3), dtype=np.uint8)).save(root / "images" / f"{iid}.jpg")
        Image.fromarray(mask.astype(np.uint8)).save(root / "masks" / f"{iid}.png")
        tags = [classes[v] for v in np.unique(mask) if v != 255 and classes[v] != "background"]
        rows.append(f"{iid},{split},{';'.join(tags)}")
    (root / "labels.csv").write_text("\n".join(rows) + "\n")


def _mask(*parts: tuple[int, slice, slice], fill: int) -> np.ndarray:
    m = np.full((H, W), fill, np.uint8)
    for value, ys, xs in parts:
        m[ys, xs] = value
    return m


def source(root: Path) -> Path:
    """msrc21/: a cow on grass with a void strip (train), a person's body and face under sky (train),
    a car and a dog on a road (val), stuff only (train); coco128/: four images with a person and one
    with a dog only, all train."""
    msrc = [
        ("a", "train", _mask((C["cow"], slice(2, 8), slice(3, 9)), (255, slice(None), slice(14, 16)), fill=C["grass"])),
        ("b", "train", _mask((C["body"], slice(4, 12), slice(5, 11)), (C["face"], slice(1, 4), slice(6, 10)),
                             fill=C["sky"])),
        ("c", "val", _mask((C["car"], slice(6, 12), slice(0, 8)), (C["dog"], slice(6, 12), slice(10, 14)),
                           fill=C["road"])),
        ("d", "train", _mask((C["tree"], slice(0, 6), slice(None)), fill=C["building"])),
    ]
    _write(root / "msrc21", MSRC, msrc)
    coco = [(f"p{i}", "train", _mask((1, slice(2, 10), slice(i, i + 6)), fill=0)) for i in range(1, 5)]
    coco.append(("p5", "train", _mask((2, slice(2, 10), slice(2, 8)), fill=0)))
    _write(root / "coco128", ["background", "person", "dog"], coco)
    return root


def _read(corpus: Path) -> tuple[list[str], list[list[str]], dict[str, np.ndarray]]:
    classes = (corpus / "classes.txt").read_text().split("\n")[:-1]
    rows = [line.split(",") for line in (corpus / "labels.csv").read_text().splitlines()]
    masks = {r[0]: np.asarray(Image.open(corpus / "masks" / f"{r[0]}.png")) for r in rows[1:]}
    return classes, rows, masks


def test_the_panel_merges_classes_keeps_void_and_splits(tmp_path, capsys):
    tool = _tool()
    data = source(tmp_path / "data")
    assert tool.main([str(data), str(tmp_path / "panel")]) == 0
    panel = tmp_path / "panel"
    a, b, c = (np.asarray(Image.open(data / "msrc21" / "masks" / f"{i}.png")) for i in "abc")

    classes, rows, masks = _read(panel / "animals")
    assert classes == ["background", "animal"] and rows[0] == ["image_id", "split", "labels"]
    assert rows[1:] == [["a", "train", "animal"], ["c", "val", "animal"]]
    assert np.array_equal(masks["a"], np.where(a == 255, 255, (a == C["cow"]).astype(np.uint8)))  # grass: background
    assert (masks["a"][:, 14:] == 255).all()                                                       # void kept
    assert np.array_equal(masks["c"], (c == C["dog"]).astype(np.uint8))                           # car, road: background
    assert (panel / "animals" / "train.txt").read_text() == "a\n" and (panel / "animals" / "val.txt").read_text() == "c\n"
    assert (panel / "animals" / "images" / "a.jpg").read_bytes() == (data / "msrc21" / "images" / "a.jpg").read_bytes()

    classes, rows, masks = _read(panel / "people")
    assert classes == ["background", "person"] and rows[1:] == [["b", "train", "person"]]
    assert np.array_equal(masks["b"], np.isin(b, [C["body"], C["face"]]).astype(np.uint8))      # body + face, sky 0
    _, rows, masks = _read(panel / "vehicles")
    assert rows[1:] == [["c", "val", "vehicle"]] and np.array_equal(masks["c"], (c == C["car"]).astype(np.uint8))
    _, rows, _ = _read(panel / "objects")
    assert [r[0] for r in rows[1:]] == ["a", "c"]  # the person is no object of the 13; stuff only: no image

    classes, rows, masks = _read(panel / "msrc-objects")
    assert classes == ["background", "cow", "sheep", "aeroplane", "person", "car", "bicycle", "flower", "sign", "bird",
                       "book", "chair", "cat", "dog", "boat"]
    assert rows[1:] == [["a", "train", "cow"], ["b", "train", "person"], ["c", "val", "car;dog"]]
    assert set(np.unique(masks["a"])) == {0, 1, 255} and (masks["a"][a == C["cow"]] == 1).all()
    assert np.array_equal(masks["b"], np.where(np.isin(b, [C["body"], C["face"]]), 4, 0))
    assert np.array_equal(masks["c"], np.select([c == C["car"], c == C["dog"]], [5, 13], 0))

    # coco128 has one split: a seeded one, a fifth of the images to val; the dog-only image is left out
    classes, rows, masks = _read(panel / "coco-persons")
    split = tool.seeded_split(["p1", "p2", "p3", "p4"])
    assert classes == ["background", "person"] and [r[0] for r in rows[1:]] == ["p1", "p2", "p3", "p4"]
    assert {r[0]: r[1] for r in rows[1:]} == split and sorted(split.values()) == ["train", "train", "train", "val"]
    assert tool.seeded_split(["p4", "p3", "p2", "p1"]) == split  # the order the ids come in does not matter

    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:4] == ["corpus", "train", "val", "all"]
    assert out[1].split()[:4] == ["animals", "1", "1", "2"] and "animal (cow+sheep+bird+dog+cat)" in out[1]
    assert out[6].split()[:4] == ["msrc-objects", "2", "1", "3"] and "person (face+body)" in out[6]
    assert json.loads((panel / "panel.json").read_text())["people"]["images"] == {"train": 1}
    assert list(json.loads((panel / "panel.json").read_text())) == list(tool.PANEL)

    # the same source again, elsewhere: the same bytes
    assert tool.main([str(data), str(tmp_path / "again")]) == 0
    for f in sorted(p for p in panel.rglob("*") if p.is_file()):
        assert (tmp_path / "again" / f.relative_to(panel)).read_bytes() == f.read_bytes(), f


def test_a_missing_or_damaged_source_is_one_line_and_nothing_is_written(tmp_path, capsys):
    tool = _tool()
    data = source(tmp_path / "data")
    (data / "coco128" / "classes.txt").rename(data / "coco128" / "names.txt")
    assert tool.main([str(data), str(tmp_path / "panel")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "coco128: no classes.txt" in err and not (tmp_path / "panel").exists()
    # the msrc21 corpora alone do not need coco128
    assert tool.main([str(data), str(tmp_path / "panel"), "--corpora", "people"]) == 0
    assert sorted(p.name for p in (tmp_path / "panel").iterdir()) == ["panel.json", "people"]
    capsys.readouterr()
    (data / "msrc21" / "masks" / "c.png").write_bytes(b"\x89PNG broken")
    assert tool.main([str(data), str(tmp_path / "p2"), "--corpora", "vehicles"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "c cannot be read" in err and not (tmp_path / "p2" / "vehicles").exists()
    assert tool.main([str(tmp_path / "nowhere"), str(tmp_path / "p3")]) == 2
    assert "no such data folder" in capsys.readouterr().err
    assert tool.main([str(data), str(tmp_path / "p3"), "--corpora", "horses"]) == 2
    assert "no corpus horses in the panel" in capsys.readouterr().err
