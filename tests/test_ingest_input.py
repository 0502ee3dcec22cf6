"""Bad input at ingest: one test per kind, on files the test makes. Each problem is reported on
one line naming the file, the problem and what to do; the cheap checks need no decoding; with
--skip-invalid every valid image is ingested and the counts reconcile."""
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import copy_sample
from wsseg.tasks.corpus import ingest as ing
from wsseg.tasks.corpus.ingest import IngestError, check_headers, check_source, decode_image, load_mask, read_source
from wsseg.tasks.store import Store
from wsseg.tasks.wsss import pipeline as pl

IDS = ["12_25_s", "10_3_s"]  # two sample photos, 320x213


def _png_claiming(path: Path, width: int, height: int) -> Path:
    """A tiny PNG whose IHDR claims ``width`` x ``height`` (a decompression bomb's header)."""
    Image.new("L", (8, 8)).save(path)
    data = bytearray(path.read_bytes())
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])) & 0xFFFFFFFF)
    path.write_bytes(bytes(data))
    return path


def _replace_image(src: Path, iid: str, make) -> Path:
    (src / "images" / f"{iid}.jpg").unlink()
    (src / "masks" / f"{iid}.png").unlink()
    return make(src / "images" / f"{iid}.png")


def test_decompression_bomb_refused_from_header(tmp_path):
    src = copy_sample(tmp_path / "d", IDS)
    bomb = _replace_image(src, "10_3_s", lambda p: _png_claiming(p, 30000, 30000))
    assert bomb.stat().st_size < 200
    with pytest.raises(IngestError, match=r"10_3_s\.png: 30000x30000 = 900 Mpx \(from its header\) is above "
                                          r"the limit of 89\.5 Mpx.*raise --max-pixels") as e:
        read_source(src)
    assert len(e.value.problems) == 1
    # a raised limit (method C's large images) lets the header pass; nothing was decoded to decide
    assert check_headers(check_source(src, max_pixels=10**9).items, max_pixels=10**9) == {}
    assert check_source(src, max_pixels=10**9).rejected == []


def test_tiny_image_refused_below_min_side(tmp_path):
    src = copy_sample(tmp_path / "d", IDS)
    _replace_image(src, "10_3_s", lambda p: Image.new("RGB", (4, 4), (9, 9, 9)).save(p) or p)
    with pytest.raises(IngestError, match=rf"10_3_s\.png: 4x4 has a side under the minimum of {ing.MIN_SIDE} px"):
        read_source(src)
    assert [it.image_id for it in check_source(src, min_side=4).items] == IDS


def test_skip_invalid_skips_every_per_row_problem(tmp_path):
    src = copy_sample(tmp_path / "d", IDS)
    for iid in ("a.b", "tiny"):
        (src / "images" / f"{iid}.jpg").write_bytes((src / "images" / "12_25_s.jpg").read_bytes())
    _png_claiming(src / "images" / "big2.png", 30000, 30000)
    Image.new("RGB", (4, 4)).save(src / "images" / "tiny2.png")
    (src / "labels.csv").write_text(
        "image_id,split,labels\n"
        "12_25_s,train,grass;sheep\n"   # valid
        "10_3_s,train,unicorn\n"        # unknown tag
        "bad id,train,grass\n"          # bad id
        "12_25_s,train,grass\n"         # duplicate of line 2
        "nope,train,grass\n"            # missing file
        "big2,train,grass\n"            # header: too many pixels
        "tiny2,train,grass\n"           # header: too small
        "a.b,train,grass,cow\n"         # extra field
        "tiny,train,\n")                # no tags
    check = check_source(src)
    assert [it.image_id for it in check.items] == ["12_25_s"]
    assert check.listed == 9 and len(check.rejected) == 8 == check.listed - len(check.items)
    assert [r["line"] for r in check.rejected] == [3, 4, 5, 6, 7, 8, 9, 10]
    assert all(len(r["problems"]) == 1 for r in check.rejected) and not check.fatal
    check.raise_for(skip_invalid=True)  # the valid row goes on
    # the console names the skipped rows: the first ones, then a count
    assert check.skipped_lines() == [f"  {r['problems'][0]}" for r in check.rejected]
    short = check.skipped_lines(limit=3)
    assert len(short) == 4 and "labels.csv:4: bad image_id 'bad id'" in short[1]
    assert short[-1].startswith("  ... and 5 more")
    with pytest.raises(IngestError) as e:
        check.raise_for(skip_invalid=False)
    assert len(e.value.problems) == 8 and str(e.value).startswith("8 problem(s)")
    msg = str(e.value)
    for part in ("unknown tag(s) ['unicorn'] on line 3", "labels.csv:4: bad image_id 'bad id'",
                 "labels.csv:5: duplicate image_id '12_25_s' (first on line 2)", "nope.*: image file missing",
                 "big2.png: 30000x30000", "tiny2.png: 4x4", "labels.csv:9: 4 fields", "'tiny' has no tags on line 10",
                 "pass --skip-invalid"):
        assert part in msg, part
    # source-level problems still refuse everything, with or without --skip-invalid
    (src / "labels.csv").write_text("id,tags\n12_25_s,grass\n")
    with pytest.raises(IngestError, match="header must contain image_id and labels"):
        check_source(src).raise_for(skip_invalid=True)


def test_labels_csv_with_byte_order_mark_is_read(tmp_path):
    src = copy_sample(tmp_path / "d", IDS)
    text = (src / "labels.csv").read_text()
    (src / "labels.csv").write_bytes(b"\xef\xbb\xbf" + text.replace("\n", "\r\n").encode())
    items, classes = read_source(src)
    assert [it.image_id for it in items] == IDS and classes.n == 21


def test_extra_field_refused_with_line_number(tmp_path):
    src = copy_sample(tmp_path / "d", IDS)
    (src / "labels.csv").write_text("image_id,labels\n12_25_s,grass;sheep\n10_3_s,grass,sheep\n")
    with pytest.raises(IngestError, match=r"labels\.csv:3: 3 fields but the header \(image_id,labels\) has 2; "
                                          r"separate tags with ';'"):
        read_source(src)
    # trailing empty fields (a spreadsheet's padding) are harmless
    (src / "labels.csv").write_text("image_id,labels\n12_25_s,grass;sheep,\n10_3_s,grass,,\n")
    assert [it.tags for it in read_source(src)[0]] == [("grass", "sheep"), ("grass",)]


def test_mask_values_outside_the_classes_are_refused(tmp_path, sample_dir):
    m = np.zeros((10, 12), np.uint8)
    m[0, 0], m[1, 1] = 255, 8
    Image.fromarray(m).save(tmp_path / "ok.png")
    assert load_mask(tmp_path / "ok.png", (10, 12), n_classes=9).max() == 255  # 255 = void is legal
    m[2, 2] = 16
    Image.fromarray(m).save(tmp_path / "bad.png")
    with pytest.raises(ValueError, match=r"bad\.png: mask holds value\(s\) \[16\] outside the class indices 0\.\.8 "
                                         r"\(255 = void\)"):
        load_mask(tmp_path / "bad.png", (10, 12), n_classes=9)
    # in a shard: the image is rejected with its mask, and nothing is written for it
    src = copy_sample(tmp_path / "d", IDS)
    mask = np.array(Image.open(src / "masks" / "10_3_s.png"))
    mask[0, 0] = 40
    Image.fromarray(mask).save(src / "masks" / "10_3_s.png")
    items, classes = read_source(src)
    by_id = {it.image_id: dict(image_path=str(it.image_path), mask_path=str(it.mask_path), tags=list(it.tags),
                               split=it.split, line=it.line) for it in items}
    res = pl.ingest_shard(str(tmp_path / "run"), IDS, by_id, n_classes=classes.n)
    assert [r["image_id"] for r in res["records"]] == ["12_25_s"] and res["written"] == ["12_25_s"]
    assert res["rejected"][0]["image_id"] == "10_3_s" and "[40] outside the class indices 0..20" in res["problems"][0]
    store = Store(tmp_path / "run")
    assert store.mask("12_25_s") is None  # staged: read once the ingest is accepted
    store.commit_staged(res["staged"])
    store = Store(tmp_path / "run")
    with pytest.raises(KeyError):
        store.image("10_3_s")
    assert store.mask("10_3_s") is None and store.mask("12_25_s") is not None


def test_masks_without_classes_txt_are_refused(tmp_path):
    src = copy_sample(tmp_path / "d", IDS)
    (src / "classes.txt").unlink()
    with pytest.raises(IngestError, match=r"classes\.txt: missing, but 2 mask\(s\) come with the source"):
        read_source(src)
    with pytest.raises(IngestError, match=r"classes\.txt: missing"):  # not a per-row problem: always refused
        check_source(src).raise_for(skip_invalid=True)
    for m in (src / "masks").iterdir():  # without masks the sorted tags are the classes, as before
        m.unlink()
    items, classes = read_source(src)
    assert classes.names == tuple(sorted({t for it in items for t in it.tags}))


def test_transparent_pixels_composited_on_a_stated_background(tmp_path):
    rgba = np.zeros((40, 40, 4), np.uint8)
    rgba[:, :20] = (255, 0, 0, 0)      # red hidden under fully transparent pixels
    rgba[:, 20:] = (0, 0, 255, 255)    # opaque blue
    rgba[0, 20] = (0, 0, 255, 128)     # half transparent
    Image.fromarray(rgba, "RGBA").save(tmp_path / "a.png")
    img, note = decode_image(tmp_path / "a.png")
    assert img.shape == (40, 40, 3) and img.dtype == np.uint8
    assert (img[:, :20] == 255).all() and (img[1:, 20:] == (0, 0, 255)).all()
    assert img[0, 20].tolist() == [127, 127, 255]
    assert "a.png: 801 of 1600 pixels are (partly) transparent; composited on the background colour " \
           "(255, 255, 255)" in note
    black, _ = decode_image(tmp_path / "a.png", "black")
    assert (black[:, :20] == 0).all()
    assert (decode_image(tmp_path / "a.png", "10,20,30")[0][5, 5] == (10, 20, 30)).all()
    # an opaque RGBA, a plain PNG and a JPEG decode exactly as OpenCV's IMREAD_COLOR, without a note
    import cv2
    rgba[..., 3] = 255
    Image.fromarray(rgba, "RGBA").save(tmp_path / "opaque.png")
    Image.fromarray(rgba[..., :3]).save(tmp_path / "plain.jpg", quality=90)
    for name in ("opaque.png", "plain.jpg"):
        ref = cv2.cvtColor(cv2.imread(str(tmp_path / name), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        img, note = decode_image(tmp_path / name)
        assert note is None and np.array_equal(img, ref)
    with pytest.raises(ValueError, match="alpha background 'nocolour': not a colour"):
        ing.parse_colour("nocolour")


def test_symlink_leaving_the_source_is_refused(tmp_path):
    src = copy_sample(tmp_path / "d", IDS)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (src / "images" / "10_3_s.jpg").rename(outside / "10_3_s.jpg")
    (src / "images" / "10_3_s.jpg").symlink_to(outside / "10_3_s.jpg")
    (src / "images" / "12_25_s.jpg").rename(src / "real.jpg")  # a link inside the source is fine
    (src / "images" / "12_25_s.jpg").symlink_to(src / "real.jpg")
    with pytest.raises(IngestError, match=r"images/10_3_s\.jpg: a symbolic link to .*elsewhere/10_3_s\.jpg, outside "
                                          r"the source folder .*pass --allow-external-links") as e:
        read_source(src)
    assert len(e.value.problems) == 1
    assert [it.image_id for it in check_source(src, allow_external_links=True).items] == IDS


def test_problem_count_excludes_the_hint():
    e = IngestError(["a.jpg: broken; replace it"], hint=ing.REFUSED_HINT)
    assert str(e).startswith("1 problem(s) in the source data:") and e.problems == ["a.jpg: broken; replace it"]
    import pickle
    again = pickle.loads(pickle.dumps(e))
    assert again.problems == e.problems and str(again) == str(e)


def test_cli_checks_before_any_cluster_and_states_defaults(tmp_path, monkeypatch, capsys):
    from wsseg.flows import cli
    import wsseg.flows.runtime

    src = copy_sample(tmp_path / "d", IDS)
    (src / "labels.csv").write_text("image_id,labels\n12_25_s,grass;unicorn\n10_3_s,grass,sheep\n")

    def no_cluster(*a, **k):
        raise AssertionError("the cluster started before the cheap checks")

    monkeypatch.setattr(wsseg.flows.runtime, "dask_cluster", no_cluster)
    monkeypatch.setattr(wsseg.flows.runtime, "prepare", lambda *a, **k: None)
    assert cli.main(["ingest", str(src), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("wsseg ingest in ") and "checking the input" in err[0]  # what starts, at once
    err = err[1:]
    assert err[0] == "wsseg: error: 2 problem(s) in the source data:"
    assert "unknown tag(s) ['unicorn']" in err[1] and "labels.csv:3: 3 fields" in err[2]
    assert "pass --skip-invalid" in err[3] and len(err) == 4
    # the help texts state the defaults of tasks.corpus.ingest
    import argparse

    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    helptext = " ".join(a.help or "" for a in sub.choices["ingest"]._actions)
    for default in (f"default {ing.MAX_PIXELS}", f"default {ing.MIN_SIDE}", f"default {ing.ALPHA_BACKGROUND}"):
        assert default in helptext


# ---------------------------------------------------------------------------- through the flow
def test_flow_refuses_without_writing_and_skip_invalid_reconciles(tmp_path, prefect_harness, cluster):
    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import ingest

    src = copy_sample(tmp_path / "src", IDS + ["14_13_s"])
    mask = np.array(Image.open(src / "masks" / "10_3_s.png"))
    mask[5, 5] = 30  # found by a worker, after the other images of the shard were decoded
    Image.fromarray(mask).save(src / "masks" / "10_3_s.png")
    run = tmp_path / "run"
    with pytest.raises(IngestError, match=r"10_3_s\.png: mask holds value\(s\) \[30\]") as e:
        on_cluster(ingest, cluster)(str(src), str(run), shard_size=2)
    assert str(e.value).startswith("1 problem(s)")
    assert not (run / "corpus").exists()  # nothing was added: the valid images' arrays were removed again
    # --skip-invalid: a cheap-stage rejection (unknown tag) and the worker's one; the others land
    lines = (src / "labels.csv").read_text().splitlines()
    (src / "labels.csv").write_text("\n".join(lines + ["9_10_s,train,unicorn"]) + "\n")
    (src / "images" / "9_10_s.jpg").write_bytes((src / "images" / "12_25_s.jpg").read_bytes())
    s = on_cluster(ingest, cluster)(str(src), str(run), shard_size=2, skip_invalid=True)
    assert (s["images"], s["skipped"], s["listed"], s["problems"]) == (2, 2, 4, 2)
    report = json.loads(Path(s["report"]).read_text())
    assert report["ingested"] + report["rejected"] == report["listed"] == 4
    assert [r["image_id"] for r in report["rejected_images"]] == ["10_3_s", "9_10_s"]
    store = Store(run)
    assert [r.image_id for r in store.manifest()] == ["12_25_s", "14_13_s"]
    for bad in ("10_3_s", "9_10_s"):  # nothing written for the rejected ones
        with pytest.raises(KeyError):
            store.image(bad)
        assert store.mask(bad) is None
