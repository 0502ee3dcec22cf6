"""The Python API (``import wsseg``): the README's example runs as written, the functions return
what the commands' ``--json`` prints, and ``wsseg.segment`` labels arrays in memory exactly as
``wsseg segment`` labels the files."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import KILL_IDS, copy_sample

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _cli(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PREFECT_API_URL", None)
    return subprocess.run([sys.executable, "-m", "wsseg", *argv], cwd=cwd, capture_output=True, text=True, env=env,
                          timeout=900)


def readme_example() -> str:
    """The Python block under the README's heading "Python API"."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Python API", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.command("ingest", "train", "segment", "export", "review", "status")
def test_the_readme_example_runs_as_a_user_runs_it(tmp_path):
    """The README's example in a fresh Python process, on six of the bundled sample's photos
    (``wsseg.SAMPLE`` swapped for a copy of them, so that the test stays short): it ingests,
    trains one round, labels an image, exports, reviews and reads the status."""
    code = readme_example()
    assert "wsseg.SAMPLE" in code and "12_25_s.jpg" in code
    data = copy_sample(tmp_path / "data", KILL_IDS)
    code = code.replace("wsseg.SAMPLE", f"__import__('pathlib').Path({str(data)!r})")
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("PREFECT_API_URL", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 3, out.stdout
    miou, final_model = lines[0].split()
    assert 0.05 < float(miou) <= 1 and (tmp_path / "runs" / "api").resolve() in Path(final_model).resolve().parents
    assert lines[1].startswith("(213, 320) ") or re.match(r"\(\d+, \d+\) ", lines[1]), lines[1]
    assert lines[2] in KILL_IDS
    voc = tmp_path / "runs" / "api-voc" / "VOCdevkit" / "VOC2012"
    assert len(list((voc / "SegmentationClass").glob("*.png"))) == len(KILL_IDS)


def test_the_functions_return_what_the_commands_json_prints(tiny_run, tmp_path):
    """status, review and export: the API's result is the CLI's ``--json`` object (the CLI calls
    the same function), as plain JSON data."""
    import wsseg

    st = wsseg.status(tiny_run)
    assert json.loads(json.dumps(st, default=str)) == json.loads(_cli("status", str(tiny_run), "--json").stdout)
    assert st["rounds"] and st["corpus"]["images"] == len(KILL_IDS)

    rv = wsseg.review(tiny_run, top=3)
    assert json.loads(json.dumps(rv)) == rv == json.loads(_cli("review", "--run-dir", str(tiny_run), "--top", "3",
                                                               "--json").stdout)
    assert len(rv["rows"]) == 3 and rv["images"] == len(KILL_IDS)
    assert [r["score"] for r in rv["rows"]] == sorted((r["score"] for r in rv["rows"]), reverse=True)

    ex = wsseg.export(tiny_run, tmp_path / "api", fmt="coco")
    cli = json.loads(_cli("export", "--run-dir", str(tiny_run), "--format", "coco", "--out", str(tmp_path / "cli"),
                          "--json").stdout)
    apart = ("out", "date_created")  # where each was written, and when
    assert {k: v for k, v in ex.items() if k not in apart} == {k: v for k, v in cli.items() if k not in apart}
    api, cli = (json.loads((tmp_path / d / "labels.json").read_text()) for d in ("api", "cli"))
    api["info"].pop("date_created"), cli["info"].pop("date_created")  # the one field that tells them apart
    assert api == cli and api["annotations"]


def test_segment_labels_arrays_as_the_command_labels_files(tiny_run, tmp_path):
    """``wsseg.segment`` on arrays (and on paths) gives, bit for bit, the label PNGs that
    ``wsseg segment`` writes for the same images with the same run's final model, and writes
    nothing."""
    import wsseg
    from wsseg.tasks.store import files

    images = [ROOT / "flows" / "sample" / "msrc21" / "images" / f"{i}.jpg" for i in ("1_1_s", "12_25_s")]
    arrays = [files.read_image(p) for p in images]
    before = sorted(p.relative_to(tiny_run) for p in tiny_run.rglob("*"))
    labels = wsseg.segment(arrays, model=tiny_run)
    assert sorted(p.relative_to(tiny_run) for p in tiny_run.rglob("*")) == before
    out = _cli("segment", *map(str, images), "--model", str(tiny_run), "--out", str(tmp_path / "seg"))
    assert out.returncode == 0, out.stderr[-2000:]
    for image, lab, arr in zip(images, labels, arrays):
        png = files.read_mask(tmp_path / "seg" / f"{image.stem}.png")  # the palette PNG's indices
        assert lab.dtype == np.uint8 and lab.shape == arr.shape[:2] == png.shape
        assert np.array_equal(lab, png)
    n_classes = wsseg.status(tiny_run)["corpus"]["classes"]
    assert all(int(x.max()) < n_classes for x in labels)
    assert all(np.array_equal(a, b) for a, b in zip(wsseg.segment(images, model=tiny_run), labels))
    with pytest.raises(ValueError, match=r"\(H, W, 3\) uint8"):
        wsseg.segment([arrays[0].astype(np.float32)], model=tiny_run)
