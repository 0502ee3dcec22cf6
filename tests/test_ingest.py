"""tasks.corpus.ingest: layouts, implicit background, and errors that name the file."""
import numpy as np
import pytest

from conftest import copy_sample
from wsseg.tasks.corpus.ingest import IngestError, load_image, load_mask, read_source


def test_folder_layout(tmp_path, sample_dir):
    items, classes = read_source(sample_dir)
    assert len(items) == 64 and classes.n == 21 and classes.background is None
    assert all(it.mask_path is not None for it in items)
    assert {t for it in items for t in it.tags} == set(classes.names)


def test_unknown_tag_names_the_file(tmp_path):
    src = copy_sample(tmp_path / "d", ["12_25_s"])
    (src / "labels.csv").write_text("image_id,labels\n12_25_s,grass;unicorn\n")
    with pytest.raises(IngestError, match=r"labels.csv: image '12_25_s' has unknown tag\(s\) \['unicorn'\]"):
        read_source(src)


def test_missing_image_names_the_file(tmp_path):
    src = copy_sample(tmp_path / "d", ["12_25_s"])
    (src / "labels.csv").write_text("image_id,labels\n12_25_s,grass\nnope,grass\n")
    with pytest.raises(IngestError, match=r"images/nope\.\*: image file missing"):
        read_source(src)


def test_unreadable_image_names_the_file(tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    with pytest.raises(ValueError, match="bad.jpg: not a readable image"):
        load_image(bad)


def test_mask_size_mismatch(tmp_path, sample_dir):
    with pytest.raises(ValueError, match="mask is 320x213 but the image is 10x10"):
        load_mask(sample_dir / "masks" / "12_25_s.png", (10, 10))


def test_implicit_background(tmp_path):
    src = copy_sample(tmp_path / "d", ["12_25_s", "10_3_s"])
    (src / "classes.txt").write_text("background\nbird\nflower\n")
    (src / "labels.csv").write_text("image_id,labels\n12_25_s,bird\n10_3_s,flower\n")
    items, classes = read_source(src)
    assert classes.background == 0 and classes.names[0] == "background"
    assert classes.tag_vector(items[0].tags).tolist() == [True, True, False]


def test_voc_layout(tmp_path, sample_dir):
    root = tmp_path / "voc"
    (root / "JPEGImages").mkdir(parents=True)
    (root / "Annotations").mkdir()
    (root / "ImageSets" / "Segmentation").mkdir(parents=True)
    import shutil
    shutil.copy(sample_dir / "images" / "12_25_s.jpg", root / "JPEGImages" / "2007_000001.jpg")
    (root / "Annotations" / "2007_000001.xml").write_text(
        "<annotation><object><name>bird</name></object><object><name>bird</name></object></annotation>")
    (root / "ImageSets" / "Segmentation" / "train.txt").write_text("2007_000001\n")
    items, classes = read_source(root)
    assert classes.names[0] == "background" and classes.background == 0 and classes.n == 21
    assert items[0].tags == ("bird",) and items[0].split == "train"
    assert load_image(items[0].image_path).shape == (213, 320, 3)


def test_corpus_changes_sorts_each_image():
    """Each image of the new manifest's keys is added, changed (content), retagged (tags or split)
    or unchanged against the manifest before, in the new manifest's order; the ids gone are removed."""
    import pyarrow as pa

    from wsseg.tasks.corpus.ingest import corpus_changes

    def keys(*rows):
        return pa.table({"image_id": [r[0] for r in rows], "sha256": [r[1] * 64 for r in rows],
                         "tags": [list(r[2]) if len(r) > 2 else ["x"] for r in rows],
                         "split": [r[3] if len(r) > 3 else "train" for r in rows]},
                        schema=pa.schema([("image_id", pa.string()), ("sha256", pa.string()),
                                          ("tags", pa.list_(pa.string())), ("split", pa.string())]))

    before = keys(("a", "1"), ("b", "2"), ("c", "3"), ("d", "4"), ("f", "6", ("x", "y")), ("g", "7"))
    now = keys(("g", "7", ("x",), "val"), ("a", "1"), ("c", "9"), ("d", "4", ("y",)), ("e", "5"),
               ("f", "6", ("y", "x")))
    assert corpus_changes(before, now) == {"added": ["e"], "removed": ["b"], "changed": ["c"],
                                           "retagged": ["g", "d", "f"]}
    empty = keys()
    assert corpus_changes(empty, now)["added"] == ["g", "a", "c", "d", "e", "f"]
    assert corpus_changes(now, now) == {"added": [], "removed": [], "changed": [], "retagged": []}


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def test_ingest_again_decodes_only_what_changed(tmp_path, monkeypatch):
    """The shard of an ingest again hashes the files; an unchanged image or mask is not decoded
    and nothing is written, a changed mask is read again. The shard writes one pack of images and
    one of masks, read once the ingest is accepted."""
    from PIL import Image

    from wsseg.tasks.store import Store
    from wsseg.tasks.wsss import pipeline as pl

    src = copy_sample(tmp_path / "d", ["12_25_s", "10_3_s"])
    items = {i: dict(image_path=str(src / "images" / f"{i}.jpg"), mask_path=str(src / "masks" / f"{i}.png"),
                     tags=["grass"], split="train", line=None) for i in ("12_25_s", "10_3_s")}
    run = str(tmp_path / "run")
    first = pl.ingest_shard(run, list(items), items, 21)
    assert first["decoded"] == 2 and all(r["has_mask"] for r in first["records"])
    assert not Store(run).has_stored_image("12_25_s")  # staged until the ingest is accepted
    Store(run).commit_staged(first["staged"])
    corpus = tmp_path / "run" / "corpus"
    assert [f.split("/")[0] for f in _files(corpus) if f.endswith(".pack")] == ["images", "masks"]
    assert len(_files(corpus)) == 8  # a pack, its keys and index, and the group's packs.json, for each
    assert Store(run).image_shape("12_25_s") == Store(run).image("12_25_s").shape
    stamps = _files(corpus)
    decoded = []
    monkeypatch.setattr(pl, "decode_image", lambda *a, **k: decoded.append(a) or (_ for _ in ()).throw(AssertionError))
    masks = []
    real_mask = pl.load_mask
    monkeypatch.setattr(pl, "load_mask", lambda *a, **k: masks.append(a[0]) or real_mask(*a, **k))
    again = pl.ingest_shard(run, list(items), items, 21)
    assert again["decoded"] == 0 and not decoded and not masks
    assert again["records"] == first["records"]
    assert _files(corpus) == stamps  # nothing written, nothing staged
    m = np.asarray(Image.open(src / "masks" / "12_25_s.png")).copy()
    m[:4, :4] = 255
    Image.fromarray(m).save(src / "masks" / "12_25_s.png")
    res = pl.ingest_shard(run, list(items), items, 21)
    assert [p.name for p in masks] == ["12_25_s.png"] and not decoded
    # the new mask waits in the staging area until the ingest flow accepts the source
    assert res["staged"] == ["12_25_s"] and Store(run).mask("12_25_s")[0, 0] != 255
    Store(run).commit_staged(res["staged"])
    assert Store(run).mask("12_25_s")[0, 0] == 255
