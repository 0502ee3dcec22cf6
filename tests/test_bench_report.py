"""``wsseg bench report`` (tasks.bench.report) and the provenance every benchmark JSON carries
(tasks.bench.provenance). No benchmark runs here: the results are built as the benchmarks build
them (``tasks.bench.quality.quality_result``, ``tasks.bench.scale.compare`` / ``targets``) or, where
the result is assembled inside a flow, as dicts with the keys that flow writes, holding known
numbers; the tests read those numbers back at their places in the page."""
import json
import os
import re
import subprocess
from datetime import datetime
from pathlib import Path

import pytest

from wsseg.flows.cli import main
from wsseg.tasks.bench import scale as ts
from wsseg.tasks.bench.provenance import finished, provenance, source_commit, stamp
from wsseg.tasks.bench.quality import quality_result
from wsseg.tasks.bench.report import collect, kind_of, read_result
from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.store import ImageRecord, Store

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------- provenance
def test_provenance_gives_the_command_date_machine_load_and_the_checkout():
    p = provenance(["bench", "quality", "--data", "../shared/data/msrc 21", "--split", "train"])
    assert p["command"] == "wsseg bench quality --data '../shared/data/msrc 21' --split train"
    assert p["argv"][3] == "../shared/data/msrc 21"
    assert datetime.fromisoformat(p["date"].replace("Z", "+00:00")).tzinfo is not None
    m = p["machine"]
    assert m["cores"] == os.cpu_count() and f"{os.cpu_count()} cores" in m["words"] and m["cpu"] in m["words"]
    assert m["memory_gb"] > 0 and (m["gpu"] is None) == ("no GPU" in m["words"])
    assert p["load_average"]["start"] == pytest.approx(os.getloadavg()[0], abs=5) and p["load_average"]["end"] is None
    assert p["wsseg"]
    done = finished(p)
    assert done["load_average"]["end"] is not None and done["finished"] >= p["date"]
    assert p["source"] == source_commit()  # the checkout wsseg runs from, or None where it is installed


def test_the_commit_of_a_checkout_is_the_one_git_gives(tmp_path):
    """A checkout made here, with a commit: its short hash as git gives it, and whether its
    tracked files changed since."""
    repo = tmp_path / "checkout"
    repo.mkdir()
    (repo / "pyproject.toml").write_text("[project]\nname = 'wsseg'\n")

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@example.org", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    git("add", "pyproject.toml")
    git("commit", "-qm", "first")
    assert source_commit(repo) == {"commit": git("rev-parse", "--short", "HEAD"), "local_changes": False}
    (repo / "pyproject.toml").write_text("[project]\nname = 'wsseg'\nversion = '2'\n")
    assert source_commit(repo)["local_changes"] is True


def test_no_checkout_no_commit_and_no_command_when_none_was_typed(tmp_path):
    assert source_commit(tmp_path) is None  # an installed wsseg: nothing to name, no failure
    (tmp_path / ".git").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    assert source_commit(tmp_path) is None  # git finds no repository there
    assert provenance(None)["command"] is None


def test_stamp_adds_provenance_and_keeps_every_other_key(tmp_path):
    out = tmp_path / "r.json"
    res = {"b": 1, "a": {"x": [1.5, None]}, "wall_seconds": 3.0}
    out.write_text(json.dumps(res, indent=1))
    p = stamp(out, provenance(["bench", "train", "--network", "lite"]), indent=1)
    saved = json.loads(out.read_text())
    assert {k: v for k, v in saved.items() if k != "provenance"} == res and saved["provenance"] == p
    assert list(saved) == ["b", "a", "wall_seconds", "provenance"] and out.read_text().startswith('{\n "b"')


# ---------------------------------------------------------------------------- results, as the benchmarks build them
def _prov(command: str, date="2026-12-06T10:00:00Z", load=(0.1, 1.9)) -> dict:
    argv = command.split()[1:]
    return {"command": command, "argv": argv, "date": date, "finished": date,
            "machine": {"words": "AMD EPYC, 2 cores, 23.5 GB memory, no GPU", "cpu": "AMD EPYC", "cores": 2,
                        "memory_gb": 23.5, "gpu": None},
            "load_average": {"start": load[0], "end": load[1]}, "wsseg": "0.1.0",
            "source": {"commit": "abc1234", "local_changes": False}}


def _quality(tmp_path: Path, data: str, train_images, cam: float, crf: float, rounds: list[float], final: int,
             model: float, sup: float, ungated=(None, None), grabcut=None, images=64) -> dict:
    """A bench quality result from ``tasks.bench.quality.quality_result``, its measurements given."""
    store = Store(tmp_path / f"run-{data}-{train_images}")
    config = WSSSConfig(train_images=train_images)
    records = [ImageRecord(f"im{i:03d}", 8, 8, ("cow",), "0", "train", "", True) for i in range(images)]
    ev = lambda m: {"miou": m, "pixel_accuracy": 0.9, "per_class_iou": {"cow": m}}  # noqa: E731
    labels = {"0:cam": ev(cam), "0:cam_crf": ev(crf), f"{final}:pseudo": ev(rounds[final])}
    if grabcut is not None:
        labels["0:box_grabcut"] = ev(grabcut)
    summary = {"rounds": [{"round": "cam", "pseudo_label_miou": cam}]
               + [{"round": r, "pseudo_label_miou": m, "changed_share": 0.1, "ignore_share": 0.0, "wall_seconds": 1.0}
                  for r, m in enumerate(rounds)], "converged": True, "final_round": final, "feature_key": "k"}
    gated = ungated[0] is not None
    return quality_result(data=str(tmp_path / "data" / data), store=store, config=config, records=records,
                          eval_split="val", eval_images=32, summary=summary, labels=labels,
                          wsss=({"miou": model}, {"miou": ungated[0]} if gated else {}),
                          supervised=({"miou": sup}, {"miou": ungated[1]} if gated else {}), gated=gated,
                          supervised_epochs=6, crf={}, final_model="m.pt", supervised_model="s.pt", warnings=[])


def _highres() -> dict:
    """flows.highres.bench_highres's result on a two-class (vessel) corpus, cross-validated in 2 folds."""
    res = {"train_ids": ["a", "b", "c"], "eval_ids": ["d"], "scale": 0.5, "patch_size": 256, "steps": 400,
           "batch": 4, "width": 16, "blocks": [1, 1, 1], "overlap": 32, "threads": 2, "seed": 0, "backbone": "lite0",
           "pretrained": {"lite0": "sha"}, "cross_validation": {"folds": 2, "eval_images": 2, "note": "..."}}
    for name, iou, f1, folds in (("global_local", 0.6512, 0.7891, [0.64, 0.66]),
                                 ("patch_only", 0.6123, 0.7594, [0.6, 0.62])):
        res |= {f"{name}_train_seconds": 120.5, f"{name}_final_loss": 0.25, f"{name}_iou": iou, f"{name}_f1": f1,
                f"{name}_confusion": [[9, 1], [1, 9]], f"{name}_eval_seconds": 3.25, f"{name}_fold_iou": folds}
    return res | {"peak_mem_mb_1x": 812.4, "peak_mem_mb_2x": 1650.0, "peak_mem_ratio_2x": 2.031,
                  "mpix_per_s": 0.4211, "overlay_png": "x.png", "checkpoint": "x.pt", "wall_seconds": 900.0}


def _pipeline() -> dict:
    """flows.bench_pipeline.result's keys, with known figures."""
    stages = {"features": {"images": 1000, "images_per_s": 20.0, "core_ms_per_image": 95.0, "wall_seconds": 50.0,
                           "measured": "flow, N=1000, 2 worker(s)"},
              "preliminary": {"images_per_s": 200.0, "core_ms_per_image": 10.0, "measured": "flow, N=1000"},
              "pseudo_labels": {"images_per_s": 50.0, "core_ms_per_image": 30.0, "measured": "flow, N=1000"}}
    return {"data": "/data/msrc21", "run_dir": "/r", "sizes": [1000, 4000], "workers": [1, 2], "stages": stages,
            "overhead_share": 0.04, "overhead_core_share": 0.02, "parallel_efficiency": 0.95,
            "dcrf_core_ms_per_image": 50.0, "ours_over_dcrf": 0.8, "ours_with_features_over_dcrf": 2.7,
            "peak_rss_mb": {}, "trainer_seconds": {}, "rerun_share": 0.01, "rerun_identical": True,
            "targets": {"overhead_share": True, "parallel_efficiency": True, "ours_over_dcrf": True,
                        "rerun_share": True}, "wall_seconds": 100.0}


def _scale() -> dict:
    """flows.bench_scale.bench_scale's result: per_size as measure_size writes it, the ratios and
    targets by tasks.bench.scale's own compare and targets."""
    def size(n, stage_ms, flow_mb):
        steps = {name: {"rc": 0, "peak_rss_mb": {"flow": flow_mb, "worker": 400.0, "scheduler": 100.0},
                        "core_ms_per_image": 10.0, "wall_seconds": 0.5 if name == "status" else 12.0}
                 for name in ts.STEPS}
        steps["train"]["breakdown"] = {"totals": {s: {"core_ms_per_image": stage_ms} for s in ts.SHARD_STAGES}}
        steps["ingest"]["breakdown"] = {"totals": {"ingest": {"core_ms_per_image": stage_ms}}}
        steps["rerun"]["store"] = {"files": 3 * n}
        return {"images": n, "workers": 2, "steps": steps, "failed": [], "rerun_check": {"recomputed": False},
                "load_average": [0.1, 2.0]}

    per_size = {"10": size(10, 100.0, 500.0), "100": size(100, 105.0, 700.0)}
    ratios = ts.compare(per_size["10"], per_size["100"])
    return {"data": "/data/msrc21", "run_dir": "/r", "sizes": [10, 100], "workers": 2, "rounds": 2, "overrides": [],
            "config": None, "per_size": per_size, "compared": [10, 100], "ratios": ratios,
            "targets": ts.targets(per_size, ratios), "wall_seconds": 50.0}


def _train() -> dict:
    """tasks.bench.train.run_bench's keys."""
    return {"model": "fusion", "options": {"width": 0.25}, "parameters": 10, "device": "cpu", "torch_threads": 1,
            "loader_workers": 1, "batch": 8, "size": 256, "images": 64, "steps": 24, "warmup_steps": 3,
            "images_per_second": 12.3456, "compute_images_per_second": 14.0, "data_wait_share": 0.0421,
            "median_step_seconds": 0.6, "peak_rss_mb": {"main": 1234.4, "sum": 2000.0}, "wall_seconds": 30.0}


def _demo() -> dict:
    """flows.wsss.train_wsss's summary, with the provenance `wsseg demo` adds."""
    rounds = [{"round": "cam", "pseudo_label_miou": 0.44, "changed_share": None},
              {"round": 0, "pseudo_label_miou": 0.4901}, {"round": 1, "pseudo_label_miou": 0.5112},
              {"round": 2, "pseudo_label_miou": 0.5049}]
    return {"rounds": rounds, "converged": False, "final_round": 1, "stop_reason": "oscillation | round 2",
            "final_pseudo_label_miou": 0.5112, "feature_key": "k", "images": 64,
            "provenance": _prov("wsseg demo --run-dir runs/demo")}


@pytest.fixture
def results(tmp_path) -> Path:
    """A folder of results as a maintainer collects them: two quality runs on msrc21 that differ
    only in train_images, one on a one-class corpus (older: no provenance), and one of each other kind."""
    d = tmp_path / "results"
    (d / "quality").mkdir(parents=True)
    q_all = _quality(tmp_path, "msrc21", None, 0.4401, 0.4523, [0.5012, 0.5231, 0.5187], 1, 0.5498, 0.5912,
                     ungated=(0.5301, 0.5811))
    q_all["model_seeds"] = {"seeds": [{}, {}], "ratio": {"mean": 0.9251, "min": 0.9102, "max": 0.94}}
    q_half = _quality(tmp_path, "msrc21", 32, 0.3834, 0.4012, [0.4861], 0, 0.4712, 0.5912)
    q_one = _quality(tmp_path, "objects", None, 0.3101, 0.3302, [0.6611, 0.7102], 1, 0.6512, 0.7401, grabcut=0.5999)
    for name, res, cmd in (("msrc21-all.json", q_all, "wsseg bench quality --data ../shared/data/msrc21"),
                           ("msrc21-32.json", q_half, "wsseg bench quality --data ../shared/data/msrc21 --set "
                                                      "train_images=32")):
        (d / "quality" / name).write_text(json.dumps(res | {"provenance": _prov(cmd)}, indent=1))
    (d / "quality" / "objects.json").write_text(json.dumps(q_one, indent=1))
    (d / "highres.json").write_text(json.dumps(_highres() | {"provenance": _prov(
        "wsseg bench highres --data ../shared/data/hrf --out highres.json --folds 2", load=(1.5, 2.5))}))
    (d / "pipeline.json").write_text(json.dumps(_pipeline() | {"provenance": _prov("wsseg bench pipeline")}))
    (d / "scale.json").write_text(json.dumps(_scale() | {"provenance": _prov("wsseg bench scale")}))
    (d / "train.json").write_text(json.dumps(_train() | {"provenance": _prov("wsseg bench train")}, indent=1))
    (d / "demo").mkdir()
    (d / "demo" / "summary.json").write_text(json.dumps(_demo()))
    # what else lies in such folders: a bench's own run summary (no demo's provenance), other records
    (d / "quality" / "run").mkdir()
    (d / "quality" / "run" / "summary.json").write_text(json.dumps({**_demo(), "provenance": None}))
    (d / "quality" / "run" / "bench_source.json").write_text(json.dumps({"data": "/x"}))
    return d


def _rows(page: str, first_cell: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in page.splitlines()
            if line.startswith(f"| {first_cell} |")]


def _section(page: str, heading: str) -> str:
    return page.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]


# ---------------------------------------------------------------------------- the command
@pytest.mark.command("bench report")
def test_bench_report_writes_a_table_per_question_with_each_results_provenance(results, tmp_path, capsys,
                                                                               monkeypatch):
    monkeypatch.chdir(tmp_path)
    page_path = tmp_path / "docs" / "figures.md"
    assert main(["bench", "report", "results", "--out", str(page_path)]) == 0
    page = page_path.read_text()
    assert page.splitlines()[0] == (f"*Generated by `wsseg bench report results --out {page_path}` from the "
                                    "benchmarks' result JSONs: do not edit it by hand; run the benchmarks, then "
                                    "this command again.*")
    err = capsys.readouterr().err
    assert "2 JSON file(s) in the folders are no benchmark result" in err and "bench_source.json" in err

    # labels on a corpus: a row per result, named by its data folder; the rounds, the final round,
    # the model against the supervised reference, the ungated figures and the seeds' ratio
    labels = _section(page, "How good are the labels on a corpus?")
    msrc = _rows(labels, "msrc21")
    assert msrc[0] == ["msrc21", "train: 64", "all", "0.440", "0.452", "-", "0.501, 0.523, 0.519", "0.523 (round 1)",
                       "val: 32", "0.550", "0.591", f"{0.5498 / 0.5912:.3f} (2 seeds: mean 0.925, 0.910-0.940)",
                       f"0.530 / 0.581 / {0.5301 / 0.5811:.3f}"]
    assert msrc[1][:9] == ["msrc21", "train: 64", "32", "0.383", "0.401", "-", "0.486", "0.486 (round 0)", "val: 32"]
    assert msrc[1][-1] == "-"  # not gated: no ungated figures
    assert _rows(labels, "objects")[0][3:8] == ["0.310", "0.330", "0.600", "0.661, 0.710", "0.710 (round 1)"]
    # under the table: each result's command, date, machine, load and wsseg; an older one says so
    assert ("- `results/quality/msrc21-32.json`: `wsseg bench quality --data ../shared/data/msrc21 --set "
            "train_images=32`") in labels
    assert ("  - 2026-12-06T10:00:00Z on AMD EPYC, 2 cores, 23.5 GB memory, no GPU; 1-minute load 0.10 at the "
            "start, 1.90 at the end; wsseg 0.1.0 (commit abc1234)") in labels
    assert "- `results/quality/objects.json`: command, date and machine not recorded" in labels

    # the trainers' sample: the two msrc21 results differing only in train_images, largest share first
    share = _section(page, "What does the trainers' sample cost?")
    assert _rows(share, "msrc21") == [
        ["msrc21", "64 of 64", "1.00", "0.440", "0.523 (round 1)", "0.550", "0.591",
         f"{0.5498 / 0.5912:.3f} (2 seeds: mean 0.925, 0.910-0.940)"],
        ["msrc21", "32 of 64", "0.50", "0.383", "0.486 (round 0)", "0.471", "0.591", f"{0.4712 / 0.5912:.3f}"]]
    assert "objects" not in share.split("\n\n")[0]

    # ultra-high resolution: each network as the JSON gives it, per fold, and segment's memory;
    # a load of 1.5 at the start says the machine was busy
    hr = _section(page, "Ultra-high resolution: global-local against patches and a downsampled image")
    assert "### hrf" in hr
    assert _rows(hr, "global_local") == [["global_local", "0.651", "0.789", "0.640, 0.660", "120.5", "3.2", "0.250"]]
    assert _rows(hr, "patch_only")[0][1:3] == ["0.612", "0.759"]
    assert "peak memory 812 MB at the image's size, 1650 MB at twice its side (ratio 2.03), 0.421 Mpx/s" in hr
    assert "in each of 2 folds (2 evaluation images in all)" in hr
    assert "other work was running beside it" in hr

    # pipeline: core-ms per image of each stage and its ratio to CAM + dense CRF's 50 core-ms
    pipe = _section(page, "What does a round cost, per image and stage?")
    assert _rows(pipe, "features") == [["features", "20.0", "95.0", "1.90", "flow, N=1000, 2 worker(s)"]]
    assert _rows(pipe, "pseudo_labels")[0][2:4] == ["30.0", "0.60"]
    assert _rows(pipe, "CAM + dense CRF")[0][2:4] == ["50.0", "1.00"]
    assert "- ours_over_dcrf: 0.80 (target <= 1.0: met)" in pipe and "### msrc21, N = 1000, 4000" in pipe

    # scale: each size's steps, then the ratios and targets as tasks.bench.scale judged them
    sc = _section(page, "Does the user's whole path scale with the corpus?")
    assert _rows(sc, "100")[1] == ["100", "train", "0", "12.0", "10.0", "700", "400", "100"]
    assert [r[1] for r in _rows(sc, "10")] == list(ts.STEPS)
    assert "- flow peak MB train: 500.00 -> 700.00, ratio 1.40 (target <= 1.3x: MISSED)" in sc
    assert "- core-ms/img features: 100.00 -> 105.00, ratio 1.05 (target <= 1.1x: met)" in sc
    assert "- nothing recomputed on the rerun: met (no shard task run, no result file written)" in sc

    tr = _section(page, "How fast do the networks train?")
    assert _rows(tr, 'fusion {"width": 0.25}') == [['fusion {"width": 0.25}', "cpu", "1", "1", "8 x 256px", "12.35",
                                                   "14.00", "0.042", "1234"]]
    # the demo's summary.json counts (its provenance says `wsseg demo`); the bench's own run summary does not
    demo = _section(page, "The demo: pseudo-labels by round")
    assert _rows(demo, "demo") == [["demo", "64", "0.440", "0.490, 0.511, 0.505", "0.511 (round 1)",
                                    "oscillation \\| round 2"]]
    assert "quality/run" not in page
    assert "## What do a person's corrections buy?" not in page  # no such result given

    # the same files give the same page, byte for byte, whatever order they are named in
    assert main(["bench", "report", "results", "--out", str(page_path)]) == 0
    assert page_path.read_text() == page
    files = sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "results").rglob("*.json")
                   if "run" not in p.parts)
    capsys.readouterr()
    assert main(["bench", "report", *files]) == 0
    printed = capsys.readouterr().out
    assert main(["bench", "report", *reversed(files)]) == 0
    again = capsys.readouterr().out
    body = lambda text: text.split("\n", 1)[1]  # noqa: E731 (the first line names the command as typed)
    assert body(again) == body(printed) and body(printed) == body(page)


def test_a_file_that_is_no_benchmark_result_or_is_damaged_is_one_line_and_exit_2(results, tmp_path, capsys):
    other = tmp_path / "config.json"
    other.write_text(json.dumps({"classifier": {"epochs": 2}}))
    assert main(["bench", "report", str(results / "pipeline.json"), str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"wsseg: error: {other}: not a wsseg benchmark result (") and "--out" in err[-1]
    damaged = tmp_path / "cut.json"
    damaged.write_text(json.dumps(_pipeline())[:100])
    for given in (damaged, tmp_path):  # named on its own, or found in a folder
        assert main(["bench", "report", str(given)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert re.match(rf"wsseg: error: {re.escape(str(damaged))}: damaged JSON \(.*\); run its benchmark again",
                        err[-1]), err
    partial = tmp_path / "p" / "scale.json"
    partial.parent.mkdir()
    partial.write_text(json.dumps({"partial": True, "per_size": {}}))
    assert main(["bench", "report", str(partial)]) == 2
    assert "a benchmark's partial result (it stopped before the end)" in capsys.readouterr().err
    assert main(["bench", "report", str(tmp_path / "nope")]) == 2
    assert "nope: no such file or folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["bench", "report", str(empty)]) == 2
    assert f"no benchmark result in {empty}" in capsys.readouterr().err


def test_each_kind_is_recognised_by_its_keys(results):
    found, skipped = collect([results])
    assert sorted(r.kind for r in found) == ["demo", "highres", "pipeline", "quality", "quality", "quality", "scale",
                                             "train"]
    assert {Path(s).name for s in skipped} == {"summary.json", "bench_source.json"}
    assert kind_of([1, 2]) is None and kind_of({"rounds": []}) is None
    assert kind_of({k: 1 for k in ("variants", "baseline", "review_spearman")}) == "corrections"
    # the same result reached twice (named, and in its folder) is one row
    again, _ = collect([results / "pipeline.json", results])
    assert sum(r.kind == "pipeline" for r in again) == 1
    assert read_result(results / "train.json").provenance["command"] == "wsseg bench train"


def test_corrections_rows_and_a_multiclass_highres_result(tmp_path):
    from wsseg.tasks.bench.corrections import summary_rows
    from wsseg.tasks.bench.report import render

    v = lambda others, before, corpus, model: {"corrected": 6, "images": [], "others_miou": others,  # noqa: E731
                                               "others_miou_before": before, "corpus_miou": corpus,
                                               "model_miou": model}
    corr = {"images": 64, "split": "train", "share": 0.1, "corrected_per_variant": 6, "eval_split": "val",
            "baseline": {"round": 1, "corpus_miou": 0.5, "model_miou": 0.55}, "review_spearman": -0.4,
            "variants": {"queue": v(0.54, 0.5, 0.58, 0.57), "random-0": v(0.51, 0.5, 0.53, 0.56),
                         "random-1": v(0.52, 0.5, 0.54, 0.55)}}
    corr["rows"] = summary_rows(corr)  # as flows.bench_corrections writes them
    multi = _highres()
    for name in ("global_local", "patch_only"):
        for k in ("iou", "f1", "fold_iou"):
            multi.pop(f"{name}_{k}")
    multi |= {"classes": ["sky", "cow"], "variants": ["patch_only", "global_local"], "global_local_miou": 0.4321,
              "global_local_pixel_accuracy": 0.8765, "patch_only_miou": 0.4012, "patch_only_pixel_accuracy": 0.85}
    del multi["cross_validation"]
    for name, res in (("corrections.json", corr), ("x2.json", multi)):
        (tmp_path / name).write_text(json.dumps(res))
    found, _ = collect([tmp_path])
    page = render(found, "wsseg bench report .")
    c = _section(page, "What do a person's corrections buy?")
    shown = f"`{tmp_path}/corrections.json`"
    assert _rows(c, shown) == [
        [shown, "none", "0", "-", "-", "-", "0.500", "0.550"],
        [shown, "queue", "6", "0.540", "0.500", "0.040", "0.580", "0.570"],
        [shown, "random-0", "6", "0.510", "0.500", "0.010", "0.530", "0.560"],
        [shown, "random-1", "6", "0.520", "0.500", "0.020", "0.540", "0.550"],
        [shown, "random (mean of 2)", "6", "0.515", "0.500", "0.015", "0.535", "0.555"]]
    hr = _section(page, "Ultra-high resolution: global-local against patches and a downsampled image")
    # the networks in the order the JSON lists them, scored by mIoU and pixel accuracy; no fold column
    assert "| network | mIoU | pixel accuracy | train s | eval s | final loss |" in hr and "### x2" in hr
    assert [r[:3] for r in _rows(hr, "patch_only") + _rows(hr, "global_local")] == [
        ["patch_only", "0.401", "0.850"], ["global_local", "0.432", "0.876"]]
    assert hr.index("| patch_only |") < hr.index("| global_local |")
