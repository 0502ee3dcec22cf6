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
    assert np.array_equal(masks["c"], (c == C["dog"]).astype(np.uint8))                           # car, road: 0
    assert (panel / "animals" / "train.txt").read_text() == "a\n"
    assert (panel / "animals" / "val.txt").read_text() == "c\n"
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


# ---------------------------------------------------------------------------- the panel's figures
def _quality(ours: float, cam: float, crf: float, grabcut: float | None, object_class: str | None = None,
             images: int = 10) -> dict:
    """A `bench quality` result with these figures: the object class's IoU (one class), else the mIoUs."""
    names = ["background", object_class] if object_class else ["background", "a", "b"]
    res = {"images": images, "split": "train", "eval_images": 3, "eval_split": "val", "final_round": 1,
           "wsss_model_miou": 0.5, "supervised_model_miou": 0.6, "pseudo_label_miou": ours,
           "baselines": {"cam": {"miou": cam}, "cam_crf": {"miou": crf}}, "per_class_iou": {}}
    if grabcut is not None:
        res["baselines"]["box_grabcut"] = {"miou": grabcut}
    for source, v in (("ours", ours), ("cam", cam), ("cam_crf", crf), ("box_grabcut", grabcut)):
        if v is not None:  # the object class at v, the background elsewhere: the mIoU is not the object IoU
            res["per_class_iou"][source] = {n: (v if n == object_class else 0.9) for n in names}
    if object_class:
        res["pseudo_label_miou"] = (ours + 0.9) / 2
    return res


def test_panel_figures_means_and_targets_known_by_construction():
    from wsseg.tasks.bench import panel as bp

    rows = {"dogs": bp.corpus_figures(_quality(0.70, 0.30, 0.35, 0.50, "dog"), "one-class", "dog"),
            "cars": bp.corpus_figures(_quality(0.50, 0.20, 0.25, 0.60, "car"), "one-class", "car"),
            "many": bp.corpus_figures(_quality(0.80, 0.40, 0.45, 0.60), "many-class", None),
            "all": bp.corpus_figures(_quality(0.81, 0.60, 0.62, None), "no background", None)}
    assert rows["dogs"]["measure"] == "object IoU" and rows["dogs"]["ours"] == 0.70
    assert rows["dogs"]["pseudo_label_miou"] == pytest.approx(0.80)  # not the figure of a one-class corpus
    assert rows["many"]["measure"] == "mIoU" and (rows["many"]["ours"], rows["many"]["box_grabcut"]) == (0.80, 0.60)
    assert rows["all"]["box_grabcut"] is None
    res = bp.panel_result(rows, at_defaults=True)
    mean = res["one_class_mean"]
    assert mean["corpora"] == ["dogs", "cars"]
    assert mean["ours"] == pytest.approx(0.60) and mean["box_grabcut"] == pytest.approx(0.55)
    assert mean["cam"] == pytest.approx(0.25) and mean["cam_crf"] == pytest.approx(0.30)
    t = {x["name"]: x for x in res["targets"]}
    # 0.60 against 0.55 + 0.10; cars below its own GrabCut
    assert t["one-class mean"]["met"] is False and t["one-class mean"]["threshold"] == pytest.approx(0.65)
    below = t["no one-class corpus below its box GrabCut"]
    assert below["below"] == ["cars"] and below["met"] is False
    assert t["many mIoU"]["met"] is True                                          # 0.80 >= 0.75
    assert t["many over the baselines"]["threshold"] == pytest.approx(0.70) and t["many over the baselines"]["met"]
    assert t["msrc21 train"]["met"] is None and "not in the panel" in t["msrc21 train"]["note"]
    table = bp.markdown(res)
    assert ("| dogs | one-class (dog) | train: 10, val: 3 | object IoU | 0.700 | 0.300 | 0.350 | 0.500 | +0.200 |"
            in table)
    assert "| one-class mean (2) | | | object IoU | 0.600 | 0.250 | 0.300 | 0.550 | +0.050 |" in table
    assert "| all | no background |" in table and "| 0.620 | - | - |" in table
    assert "above their mean box GrabCut: NOT MET (0.600 against 0.650)" in table
    assert "(below: cars)" in table and "many: mIoU at least 0.75: met (0.800 against 0.750)" in table
    # msrc21 in the panel is judged; a one-class corpus that failed leaves the one-class targets unjudged
    rows["msrc21"] = rows.pop("all")
    rows["cars"] = {"kind": "one-class", "object_class": "car", "error": "RuntimeError: out of memory"}
    res = bp.panel_result(rows, at_defaults=False)
    t = {x["name"]: x for x in res["targets"]}
    assert t["msrc21 train"]["met"] is True and res["failed"] == ["cars"]
    assert t["one-class mean"]["met"] is None and t["no one-class corpus below its box GrabCut"]["met"] is None
    assert res["one_class_mean"]["corpora"] == ["dogs"] and res["one_class_mean"]["ours"] == pytest.approx(0.70)
    table = bp.markdown(res)
    assert "| cars | one-class | - | failed: RuntimeError: out of memory |" in table
    assert "this run used another" in table


def test_the_panel_lists_its_corpora_and_refuses_a_missing_one(tmp_path):
    from wsseg.tasks.bench import panel as bp

    for name in ("zeta", "alpha", "people"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "labels.csv").write_text("image_id,split,labels\n")
    (tmp_path / "notes").mkdir()
    assert [n for n, _ in bp.corpus_folders(tmp_path)] == ["alpha", "people", "zeta"]
    (tmp_path / "panel.json").write_text(json.dumps({"people": {}, "gone": {}}))
    assert [n for n, _ in bp.corpus_folders(tmp_path)] == ["people", "alpha", "zeta"]
    assert [n for n, _ in bp.corpus_folders(tmp_path, ["zeta", "people"])] == ["zeta", "people"]
    with pytest.raises(ValueError, match="no corpus horses .* the panel holds: alpha, people, zeta"):
        bp.corpus_folders(tmp_path, ["horses"])
    with pytest.raises(ValueError, match="make_panel.py"):
        bp.corpus_folders(tmp_path / "nowhere")
    assert bp.corpus_kind(["background", "dog"], "background") == ("one-class", "dog")
    assert bp.corpus_kind(["background", "dog", "cat"], "background") == ("many-class", None)
    assert bp.corpus_kind(["dog", "cat"], None) == ("no background", None)


# ---------------------------------------------------------------------------- wsseg bench panel
#: a tiny msrc21-like source from the bundled sample: animals (cow, bird, cat, dog with a person) and
#: a car to train on, a sheep and a book to evaluate on
TRAIN, VAL = ["1_10_s", "12_6_s", "16_27_s", "17_28_s", "15_14_s"], ["9_19_s", "13_2_s"]
TINY = ["--set", "classifier.epochs=1", "--set", "classifier.size=64", "--set", "classifier.width=8",
        "--set", "classifier.batch_size=8", "--set", "classifier.cam_scales=[1.0]", "--set", "mil.iterations=1",
        "--set", "proposals.epochs=1", "--set", "segmentation.epochs=1", "--set", "segmentation.crop=64",
        "--set", "segmentation.batch_size=4", "--set", "segmentation.num_workers=0", "--set", "shard_size=8",
        "--rounds", "1"]


@pytest.mark.command("bench panel")
def test_bench_panel_runs_bench_quality_on_each_corpus_and_prints_one_table(tmp_path, prefect_harness, cluster,
                                                                           capsys, one_torch_thread):
    from conftest import copy_sample
    from wsseg.flows import cli
    from wsseg.tasks.bench.report import collect, render

    src = copy_sample(tmp_path / "msrc21", TRAIN + VAL)
    rows = (src / "labels.csv").read_text().splitlines()
    (src / "labels.csv").write_text("\n".join(rows[:1] + [r.replace(",train,", ",val,") if r.split(",")[0] in VAL
                                                          else r for r in rows[1:]]) + "\n")
    tool, panel = _tool(), tmp_path / "panel"
    for name in ("animals", "msrc-objects"):
        tool.build(src, tool.PANEL[name], panel / name)
    run, out = tmp_path / "run", tmp_path / "res" / "panel.json"
    argv = ["bench", "panel", "--panel", str(panel), "--run-dir", str(run), "--out", str(out),
            "--dask-address", cluster, *TINY]
    args = cli.parser().parse_args(argv)
    run.mkdir()
    assert args.func(args) == 0
    printed = capsys.readouterr()

    res = json.loads(out.read_text())
    assert list(res["corpora"]) == ["animals", "msrc-objects"] and res["failed"] == [] and not res["at_defaults"]
    assert res["provenance"]["load_average"]["end"] is not None
    for name, kind in (("animals", "one-class"), ("msrc-objects", "many-class")):
        row = res["corpora"][name]
        q = json.loads((tmp_path / "res" / "panel" / f"{name}.json").read_text())
        assert row["kind"] == kind and row["result"] == str(tmp_path / "res" / "panel" / f"{name}.json")
        assert row["images"] == q["images"] == (4 if name == "animals" else 5) and row["eval_images"] == 1 + (
            name != "animals")
        # the corpus's figures are its bench quality result's: the object's IoU, or the mIoU
        if kind == "one-class":
            assert row["object_class"] == "animal" and row["measure"] == "object IoU"
            assert all(row[s] == q["per_class_iou"][s]["animal"] for s in ("ours", "cam", "cam_crf", "box_grabcut"))
        else:
            assert row["ours"] == q["pseudo_label_miou"] and row["measure"] == "mIoU"
            assert all(row[s] == q["baselines"][s]["miou"] for s in ("cam", "cam_crf", "box_grabcut"))
        assert all(0.0 <= row[s] <= 1.0 for s in ("ours", "cam", "cam_crf", "box_grabcut"))
        # its provenance: the bench quality command that gives these figures alone
        cmd = q["provenance"]["command"]
        assert cmd.startswith(f"wsseg bench quality --data {panel / name} --run-dir {run / name}")
        assert "--set classifier.epochs=1" in cmd and "--rounds 1" in cmd and q["provenance"]["part_of"]
        assert q["config"]["classifier"]["epochs"] == 1 and Path(q["run_dir"]) == run / name
    # the one-class means (one corpus here) and the targets judged from them
    animals, many = res["corpora"]["animals"], res["corpora"]["msrc-objects"]
    assert res["one_class_mean"]["corpora"] == ["animals"]
    assert all(res["one_class_mean"][s] == animals[s] for s in ("ours", "cam", "cam_crf", "box_grabcut"))
    t = {x["name"]: x for x in res["targets"]}
    assert t["one-class mean"]["met"] == (animals["ours"] >= animals["box_grabcut"] + 0.10)
    assert t["msrc-objects mIoU"]["met"] == (many["ours"] >= 0.75)
    best = max(many["cam"], many["cam_crf"], many["box_grabcut"])
    assert t["msrc-objects over the baselines"]["threshold"] == pytest.approx(best + 0.10)
    # one table on stdout (also OUT.md), progress on stderr
    assert "| animals | one-class (animal) | train: 4, val: 1 | object IoU |" in printed.out
    assert "| msrc-objects | many-class | train: 5, val: 2 | mIoU |" in printed.out
    assert "| one-class mean (1) |" in printed.out and printed.out.count("| ours |") == 1
    assert out.with_suffix(".md").read_text() in printed.out
    assert "[panel 1/2] animals: one-class (animal)" in printed.err and "[panel 2/2] msrc-objects: mIoU" in printed.err
    # wsseg bench report renders the panel's JSON (and its corpora's beside it)
    results, _ = collect([tmp_path / "res"])
    assert sorted(r.kind for r in results) == ["panel", "quality", "quality"]
    page = render(results, "wsseg bench report res")
    assert "## How good are the labels on the panel of corpora?" in page and "| one-class mean (1) |" in page
