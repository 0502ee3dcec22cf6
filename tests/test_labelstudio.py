"""wsseg export --format labelstudio: the brush RLE read by Label Studio's own decoder (and its
encoder's read by ours); and a real Label Studio (1.23.2, in its own virtual environment,
``make labelstudio``) that takes the exported project, tasks and predictions through its API, a
person's corrected brush submitted to it, and its JSON export read back by ``read_export`` and
``wsseg ingest --corrections``, equal to what was submitted pixel for pixel."""
from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from wsseg.tasks.labels.labelstudio import brush_rle_decode, brush_rle_encode, label_colours, read_export

ROOT = Path(__file__).resolve().parents[1]
LS_VENV = ROOT / ".venv-labelstudio"
#: Label Studio's first start (database migrations) took 48 s on the 2-core machine
LS_START_TIMEOUT = 180


def _ls_python() -> Path:
    exe = LS_VENV / "bin" / "python"
    if not exe.is_file() or not (LS_VENV / "bin" / "label-studio").is_file():
        pytest.fail(f"{LS_VENV}: no Label Studio virtual environment; build it with `make labelstudio` "
                    f"(a prerequisite of `make test`)", pytrace=False)
    return exe


def _stored(run: Path) -> tuple[dict[str, np.ndarray], list[str], int]:
    from wsseg.tasks.store import Store

    store = Store(run)
    final = store.read_summary()["final_round"]
    return ({rec.image_id: store.pseudo(final, rec.image_id) for rec in store.manifest()},
            list(store.classes().names), final)


def _pack(mask: np.ndarray) -> str:
    return base64.b64encode(np.packbits(mask.ravel())).decode("ascii")


def _unpack(text: str, shape: tuple[int, int]) -> np.ndarray:
    return np.unpackbits(np.frombuffer(base64.b64decode(text), np.uint8))[: shape[0] * shape[1]].reshape(shape) > 0


#: run in Label Studio's environment: its converter's decode_rle of our RLEs (all four channels
#: returned), and its mask2rle of the masks
LS_CONVERTER = r"""
import base64, json, sys
import numpy as np
from label_studio_sdk.converter.brush import decode_rle, mask2rle
out = []
for c in json.load(sys.stdin):
    h, w = c["shape"]
    rgba = decode_rle(c["rle"]).reshape(h, w, 4)
    mask = np.unpackbits(np.frombuffer(base64.b64decode(c["mask"]), np.uint8))[: h * w].reshape(h, w)
    out.append({"channels": [base64.b64encode(np.packbits(rgba[:, :, k] == 255)).decode() for k in range(4)],
                "zero": bool(np.isin(rgba, (0, 255)).all()), "rle": mask2rle(mask.astype(np.uint8) * 255)})
json.dump(out, sys.stdout)
"""


def test_brush_rle_round_trips_and_is_label_studios(tiny_run):
    labels, names, _ = _stored(tiny_run)
    rng = np.random.default_rng(0)
    long_run = np.ones((300, 300), bool)
    long_run[150, 150] = False  # runs of more than 2**16 RGBA values on both sides
    masks = [labels[i] == c for i in sorted(labels) for c in np.unique(labels[i]).tolist() if c != 255]
    masks += [np.zeros((5, 7), bool), np.ones((5, 7), bool), rng.random((13, 11)) > 0.5, long_run]
    assert len(masks) > 10
    for m in masks:
        assert np.array_equal(brush_rle_decode(brush_rle_encode(m), *m.shape), m)

    noisy = rng.random((480, 640)) > 0.5  # the worst case: a run every pixel or two
    t = time.perf_counter()
    rle = brush_rle_encode(noisy)
    assert time.perf_counter() - t < 1.0
    assert np.array_equal(brush_rle_decode(rle, 480, 640), noisy)

    cases = [{"shape": list(m.shape), "rle": brush_rle_encode(m), "mask": _pack(m)} for m in masks]
    res = subprocess.run([str(_ls_python()), "-c", LS_CONVERTER], input=json.dumps(cases), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    for m, theirs in zip(masks, json.loads(res.stdout), strict=True):
        assert theirs["zero"]  # every byte 0 or 255
        for channel in theirs["channels"]:  # a set pixel 255 in R, G, B and alpha, as label-studio-converter writes
            assert np.array_equal(_unpack(channel, m.shape), m)
        assert np.array_equal(brush_rle_decode(theirs["rle"], *m.shape), m)  # their encoder, our decoder


def _write_json(path: Path, tasks: list) -> Path:
    path.write_text(json.dumps(tasks))
    return path


def _brush(name: str, mask: np.ndarray, **extra) -> dict:
    return {"id": f"b-{name}", "from_name": "label", "to_name": "image", "type": "brushlabels",
            "original_width": mask.shape[1], "original_height": mask.shape[0], "image_rotation": 0,
            "value": {"format": "rle", "rle": brush_rle_encode(mask), "brushlabels": [name]}} | extra


def test_read_export_takes_the_latest_submitted_annotation_and_names_each_problem(tmp_path):
    names = ["grass", "cow", "sky"]
    want = np.full((6, 9), 255, np.uint8)
    want[:3] = 2
    want[3:, :4] = 0
    older = np.zeros((6, 9), np.uint8)

    def ann(i, label, when, cancelled=False):
        return {"id": i, "was_cancelled": cancelled, "updated_at": when,
                "result": [_brush(names[c], label == c) for c in np.unique(label).tolist() if c != 255]}

    tasks = [
        {"id": 1, "data": {"wsseg_image_id": "a"},  # the newest submitted one, not the cancelled newer one
         "annotations": [ann(10, older, "2026-12-01T10:00:00Z"), ann(11, want, "2026-12-02T10:00:00.5Z"),
                          ann(12, older, "2026-12-03T10:00:00Z", cancelled=True)]},
        {"id": 2, "data": {"wsseg_image_id": "b"}, "annotations": []},  # nobody labelled it: passed over
        {"id": 3, "data": {"wsseg_image_id": "c"}, "annotations": [ann(13, older, "2026-12-01T10:00:00Z", True)]},
        {"id": 4, "data": {"wsseg_image_id": "d", "wsseg_height": 6, "wsseg_width": 9},  # every brush removed
         "annotations": [{"id": 14, "was_cancelled": False, "result": []}]},
        {"id": 5, "data": {"image": "x.jpg"}, "annotations": [ann(15, want, None)]},
        {"id": 6, "data": {"wsseg_image_id": "f"},
         "annotations": [{"id": 16, "result": [_brush("horse", want == 2)]}]},
        {"id": 7, "data": {"wsseg_image_id": "g"},
         "annotations": [{"id": 17, "result": [_brush("sky", want == 2) | {"value": {
             "format": "rle", "rle": brush_rle_encode(want == 2)[:-6], "brushlabels": ["sky"]}}]}]},
        {"id": 8, "data": {"wsseg_image_id": "h"},
         "annotations": [{"id": 18, "result": [_brush("sky", want == 2), _brush("cow", np.ones((7, 9), bool))]}]},
        {"id": 9, "data": {"wsseg_image_id": "i"},
         "annotations": [{"id": 19, "result": [_brush("sky", want == 2, original_height=5)]}]},
        {"id": 10, "data": {"wsseg_image_id": "j"},
         "annotations": [{"id": 20, "result": [{"type": "polygonlabels", "from_name": "poly", "value": {}}]}]},
    ]
    path = _write_json(tmp_path / "project.json", tasks)
    got = list(read_export(path, names))
    assert [g[0] for g in got] == ["a", "d", None, "f", "g", "h", "i", "j"]
    assert np.array_equal(got[0][1], want) and got[0][2] is None
    assert got[1][1].shape == (6, 9) and (got[1][1] == 255).all() and got[1][2] is None
    problems = [g[2] for g in got[2:]]
    assert all(g[1] is None for g in got[2:])
    assert all(p.startswith(f"{path}: task ") and "\n" not in p for p in problems)
    assert "task 5: no data.wsseg_image_id" in problems[0]
    assert "task 6 (f), annotation 16: unknown class 'horse' (the run's classes: grass, cow, sky)" in problems[1]
    assert "task 7 (g)" in problems[2] and "the 'sky' brush's RLE" in problems[2]
    assert "task 8 (h)" in problems[3] and "7x9 image, not 6x9" in problems[3]
    assert "task 9 (i)" in problems[4] and "holds 216 values, not 5x9x4" in problems[4]
    assert "task 10 (j)" in problems[5] and "'polygonlabels' result" in problems[5]
    for text, says in (("{", "not a Label Studio JSON export"), ('{"tasks": []}', "a list of tasks")):
        (tmp_path / "bad.json").write_text(text)
        with pytest.raises(ValueError, match=says):
            list(read_export(tmp_path / "bad.json", names))


# ---------------------------------------------------------------------------- the brushes' colours
SAMPLE = ROOT / "flows" / "sample" / "msrc21"


def _hex(rgb) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _exported_colours(tmp_path: Path, names: list[str]) -> list[str]:
    """The brush colours of the labelling configuration `wsseg export --format labelstudio` writes for a
    finished round of a run with classes ``names`` (one image, its labels every class in turn)."""
    from wsseg.tasks.labels.export import export_labels
    from wsseg.tasks.store import ClassSpec, ImageRecord, Store

    store = Store(tmp_path / f"run{len(names)}")
    n = len(names)
    store.write_corpus([ImageRecord("im0", 4, n, (names[0],), f"{0:064x}", "train", "x.jpg", False)],
                       ClassSpec(tuple(names)))
    store.write_pseudo(0, "im0", np.tile(np.arange(n, dtype=np.uint8), (4, 1)))
    store.write_round(0, {"round": 0})
    export_labels(store, tmp_path / f"ls{n}", which=0, fmt="labelstudio", images=False)
    config = ET.fromstring((tmp_path / f"ls{n}" / "labeling_config.xml").read_text())
    assert [x.get("value") for x in config.iter("Label")] == names
    return [x.get("background") for x in config.iter("Label")]


def _lab(colours: list[str]) -> np.ndarray:
    from skimage.color import rgb2lab

    rgb = np.array([[int(c[k: k + 2], 16) for k in (1, 3, 5)] for c in colours], float) / 255
    return rgb2lab(rgb[None])[0]


def _closest(lab: np.ndarray) -> float:
    """The smallest CIEDE2000 between two of the colours."""
    from skimage.color import deltaE_ciede2000

    n = len(lab)
    d = deltaE_ciede2000(np.repeat(lab, n, 0), np.tile(lab, (n, 1))).reshape(n, n)
    return float(d[~np.eye(n, dtype=bool)].min())


def test_the_brushes_are_told_apart_on_photos(tmp_path):
    """No brush is dark (it would only darken the photo: VOC's black), pale (it vanishes on a bright
    sky and as the region list's text on white) or grey (read as shading), and no two are near twins:
    CIEDE2000 >= 17 between any two of msrc21's 21 classes, >= 9 between any two of 81 (COCO's 80
    and the implicit background), where about 1 is the least difference a person sees side by side
    and 2 to 10 one seen at a glance. The same list twice gives the same colours, and a class keeps
    its colour in a longer list."""
    msrc21 = (SAMPLE / "classes.txt").read_text().split()
    coco = ["background"] + [f"coco class {i}" for i in range(1, 81)]
    written = {}
    for names, least in ((msrc21, 17.0), (coco, 9.0)):
        colours = written[len(names)] = _exported_colours(tmp_path, names)
        lab = _lab(colours)
        chroma = np.hypot(lab[:, 1], lab[:, 2])
        assert lab[:, 0].min() >= 35 and lab[:, 0].max() <= 70 and chroma.min() >= 30, (names, colours)
        assert len(set(colours)) == len(names) and _closest(lab) >= least, (len(names), _closest(lab))
    assert _exported_colours(tmp_path / "again", msrc21) == written[21] == written[81][:21]

    # what the png export keeps (VOC's colour map) fails both: building black, tree and road two greens
    from wsseg.tasks.store.files import palette

    voc = palette(len(msrc21))
    lab = _lab([_hex(voc[3 * i: 3 * i + 3]) for i in range(len(msrc21))])
    assert lab[msrc21.index("building"), 0] == 0 and _closest(lab) < 17


def test_the_docs_start_label_studio_as_the_test_does():
    """docs/labels.md's start command and API steps are the ones this file's test takes with a real
    Label Studio: every flag and local-files setting, and every API path."""
    docs = (ROOT / "docs" / "labels.md").read_text()
    start = next(line for line in docs.splitlines() if "label-studio start" in line)
    command = docs[docs.index(start) - 200: docs.index(start) + 400]
    for flag, value in START_FLAGS.items():
        assert f" {flag}" in command, flag
    assert "--internal-host 127.0.0.1" in command
    for name in FILES_ENV:
        assert f"{name}=" in command, name
    for path in API_PATHS:
        assert path.replace("{pid}", "{project['id']}") in docs, path


# ---------------------------------------------------------------------------- a real Label Studio
TOKEN = "wsseg-test-token-0123456789"
#: how it is started, as docs/labels.md tells a person to (test_the_docs_start_label_studio_as_the_test_does):
#: bound to this machine, the first user with a token, legacy token auth (1.23 has it off otherwise)
START_FLAGS = {"--no-browser": None, "--internal-host": "127.0.0.1", "--username": "annotator@example.com",
               "--password": "wsseg-test-password", "--user-token": TOKEN, "--enable-legacy-api-token": None}
#: the local-files settings, with their LABEL_STUDIO_ prefix, and the API paths the test takes
FILES_ENV = ("LABEL_STUDIO_LOCAL_FILES_SERVING_ENABLED", "LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT")
API_PATHS = ("/api/projects/", "/api/storages/localfiles/", "/api/projects/{pid}/import",
             "/api/projects/{pid}/export?exportType=JSON")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def label_studio(document_root: Path, data_dir: Path):
    """A Label Studio server on a free 127.0.0.1 port, serving local files under
    ``document_root``, its user's legacy API token :data:`TOKEN`; yields its URL. Stopped (its
    process group) at the end."""
    exe = LS_VENV / "bin" / "label-studio"
    _ls_python()
    port = _free_port()
    env = os.environ | dict(zip(FILES_ENV, ("true", str(document_root)))) | {
        "LABEL_STUDIO_BASE_DATA_DIR": str(data_dir),
        "LABEL_STUDIO_LATEST_VERSION_CHECK": "false", "LABEL_STUDIO_COLLECT_ANALYTICS": "false",
    }
    args = [a for flag, value in START_FLAGS.items() for a in ([flag] if value is None else [flag, value])]
    log = open(data_dir.parent / "label-studio.log", "w")
    proc = subprocess.Popen([str(exe), "start", *args, "--port", str(port)],
                            cwd=data_dir.parent, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + LS_START_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"label-studio exited with {proc.returncode} before it answered: "
                            f"{(data_dir.parent / 'label-studio.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(url + "/health/", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"label-studio did not answer {url}/health/ within {LS_START_TIMEOUT} s: "
                            f"{(data_dir.parent / 'label-studio.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        log.close()


def _api(url: str, method: str, path: str, body=None, raw: bool = False):
    req = urllib.request.Request(url + path, method=method, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Authorization": f"Token {TOKEN}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            data = r.read()
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{method} {path}: HTTP {e.code}: {e.read()[:2000]!r}") from None
    return data if raw else json.loads(data)


@pytest.mark.command("export", "ingest")
def test_a_real_label_studio_takes_the_export_and_gives_back_a_persons_correction(tmp_path, tiny_run):
    from wsseg.tasks.store import Store, params_key

    labels, names, final = _stored(tiny_run)
    digest = params_key(Store(tiny_run).read_config())
    out = tmp_path / "ls"
    res = subprocess.run([sys.executable, "-m", "wsseg", "export", "--run-dir", str(tiny_run), "--format",
                          "labelstudio", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert f"exported round {final}'s labels of {len(labels)} images" in res.stdout
    meta = json.loads((out / "export.json").read_text())
    assert meta["format"] == "labelstudio" and meta["images"] == len(labels) and meta["config_digest"] == digest
    assert f"LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT={out.resolve()}" in meta["open_with"]
    config = ET.fromstring((out / "labeling_config.xml").read_text())
    assert [x.get("value") for x in config.iter("Label")] == names
    assert [x.get("background") for x in config.iter("Label")] == [_hex(c) for c in label_colours(len(names))]
    assert sorted(p.stem for p in (out / "images").iterdir()) == sorted(labels)
    lines = (out / "tasks.json").read_text().splitlines()
    assert lines[0] == "[" and lines[-1] == "]" and len(lines) == len(labels) + 2  # a task a line

    with label_studio(out, tmp_path / "ls-data") as url:
        project = _api(url, "POST", API_PATHS[0], {"title": "wsseg round trip",
                                                   "label_config": (out / "labeling_config.xml").read_text()})
        pid = project["id"]
        # what serves the images: a local storage of OUT/images (not synced: the tasks are imported)
        _api(url, "POST", API_PATHS[1], {"project": pid, "path": str(out.resolve() / "images"),
                                         "title": "wsseg images", "use_blob_urls": False})
        imported = _api(url, "POST", API_PATHS[2].format(pid=pid), json.loads((out / "tasks.json").read_text()))
        assert imported["task_count"] == len(labels) and imported["prediction_count"] == len(labels)

        held = _api(url, "GET", f"/api/tasks/?project={pid}&fields=all&page_size=1000")["tasks"]
        assert len(held) == len(labels)
        by_id = {t["data"]["wsseg_image_id"]: t for t in held}
        for iid, label in labels.items():
            [pred] = by_id[iid]["predictions"]
            present = [c for c in np.unique(label).tolist() if c != 255]
            assert pred["model_version"] == f"wsseg round {final} {digest}"
            assert len(pred["result"]) == len(present)
            for r in pred["result"]:
                c = names.index(r["value"]["brushlabels"][0])
                assert np.array_equal(brush_rle_decode(r["value"]["rle"], *label.shape), label == c)
        image = _api(url, "GET", by_id[sorted(labels)[0]]["data"]["image"], raw=True)
        assert image == (out / "images" / f"{sorted(labels)[0]}.jpg").read_bytes()

        # a person corrects one image: a rectangle repainted to another of its tags, one erased
        store = Store(tiny_run)
        iid = sorted(labels)[1]
        task = by_id[iid]
        rec = next(r for r in store.manifest() if r.image_id == iid)
        label = labels[iid]
        h, w = label.shape
        box = (slice(h // 4, h // 2), slice(w // 4, w // 2))
        main = np.bincount(label[box][label[box] != 255], minlength=len(names)).argmax()
        other = next(names.index(t) for t in rec.tags if names.index(t) != main)
        corrected = label.copy()
        corrected[box] = other
        corrected[h - 10:, :10] = 255
        assert (corrected != label).sum() > 100
        [pred] = task["predictions"]
        result = [{"id": f"region-{c}", "from_name": "label", "to_name": "image", "type": "brushlabels",
                   "origin": "prediction-changed", "original_width": w, "original_height": h, "image_rotation": 0,
                   "value": {"format": "rle", "rle": brush_rle_encode(corrected == c), "brushlabels": [names[c]]}}
                  for c in np.unique(corrected).tolist() if c != 255]
        _api(url, "POST", f"/api/tasks/{task['id']}/annotations/?project={pid}",
             {"result": result, "lead_time": 42.0, "parent_prediction": pred["id"], "project": str(pid),
              "was_cancelled": False})
        exported = _api(url, "GET", API_PATHS[3].format(pid=pid), raw=True)
    export = tmp_path / "project-export.json"
    export.write_bytes(exported)

    [(got_id, got, problem)] = list(read_export(export, names))
    assert problem is None and got_id == iid
    assert np.array_equal(got, corrected)

    run = tmp_path / "run"
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns(".prefect", "mlflow.db", "dask-scratch"))
    res = subprocess.run([sys.executable, "-m", "wsseg", "ingest", "--run-dir", str(run), "--corrections",
                          str(export)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert np.array_equal(Store(run).correction(iid), corrected)
    assert all(Store(run).correction(i) is None for i in labels if i != iid)
