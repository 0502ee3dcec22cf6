"""wsseg bench quality (flows.bench_quality and its tasks): the pure helpers, and a tiny end-to-end
bench (the CRF-on-tags helper of its cam_crf baseline is tested in test_crf.py)."""
import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import copy_sample
from wsseg.tasks.bench.ablation import ablation_variants, apply_overrides, check_overrides
from wsseg.tasks.bench.quality import budget_epochs, parse_model_spec
from wsseg.tasks.report.figures import pick_overlay_records
from wsseg.tasks.store import Store, load_model, read_file

torch.set_num_threads(1)

TRAIN = ["1_10_s", "5_26_s", "1_29_s", "9_17_s", "2_18_s", "12_6_s"]
VAL = ["1_11_s", "9_19_s"]


def test_pick_overlay_records_is_deterministic_and_prefers_multi_tag():
    from wsseg.tasks.store import ImageRecord

    recs = [ImageRecord(f"im{i:02d}", 4, 4, tuple("abc"[: 1 + i % 3]), "0", "train", "", True) for i in range(20)]
    picks = pick_overlay_records(list(reversed(recs)), n=6)
    assert [r.image_id for r in picks] == [r.image_id for r in pick_overlay_records(recs, n=6)]
    assert len(picks) == 6 and all(len(r.tags) >= 2 for r in picks)


def test_ablation_variants_flag_what_the_config_cannot_express():
    from wsseg.tasks.config import WSSSConfig

    v = ablation_variants(WSSSConfig())
    # IoU filtering is off by default, so its variant switches it on; with it on, the variant switches it off
    assert v["iou_filter"]["overrides"] == {"proposals.t1": 0.3, "proposals.p1": 0.5} and "no_iou_filter" not in v
    on = apply_overrides(WSSSConfig(), v["iou_filter"]["overrides"])
    assert ablation_variants(on)["no_iou_filter"]["overrides"] == {"proposals.t1": 0.0, "proposals.p1": 0.0}
    assert v["no_mil_prior"]["overrides"] == {"mil.prior_weight": 0.0}
    assert "seeding_grabcut" not in v and {"seeding_random_walker", "seeding_none"} <= set(v)
    assert {"no_edges", "superpixel_felzenszwalb", "fusion_topk", "no_mil",
            "no_seed_prior", "no_prelim_normalize", "class_balance"} <= set(v)
    # the rounds' segmenters' class weights are off by default: the variant turns them on, and the other way round
    assert v["class_balance"]["overrides"] == {"segmentation.rounds_class_balance": 0.5} and "no_class_balance" not in v
    weighted = apply_overrides(WSSSConfig(), v["class_balance"]["overrides"])
    assert ablation_variants(weighted)["no_class_balance"]["overrides"] == {"segmentation.rounds_class_balance": 0.0}
    assert "no_round_prior" in ablation_variants(WSSSConfig(prior_weight=0.5))
    assert v["no_mil"]["overrides"] == {"mil.iterations": 0}
    for name, var in v.items():
        if "skip" not in var:  # every runnable variant is a valid config differing from the default
            assert apply_overrides(WSSSConfig(), var["overrides"]) != WSSSConfig(), name


def _parse(argv):
    from wsseg.flows.cli_bench import add_bench_quality_parser

    ap = argparse.ArgumentParser(prog="wsseg")
    sub = ap.add_subparsers(dest="command")
    bench = sub.add_parser("bench").add_subparsers(dest="bench")
    add_bench_quality_parser(bench)
    return ap.parse_args(argv)


@pytest.mark.command("bench quality")
def test_bench_quality_end_to_end(tmp_path, prefect_harness, capsys):
    data = copy_sample(tmp_path / "data", TRAIN + VAL)
    rows = (data / "labels.csv").read_text().splitlines()
    (data / "labels.csv").write_text("\n".join(
        [rows[0]] + [",".join([r.split(",")[0], "val" if r.split(",")[0] in VAL else "train", r.split(",")[2]])
                     for r in rows[1:]]) + "\n")
    run, out = tmp_path / "run", tmp_path / "res" / "q.json"
    argv = ["bench", "quality", "--data", str(data), "--split", "train", "--out", str(out),
                   "--run-dir", str(run), "--workers", "2", "--ablate", "fusion_topk", "no_edges",
                   "--set", "classifier.epochs=3", "--set", "classifier.size=96", "--set", "segmentation.epochs=1", "--set", "segmentation.crop=96",
                   "--set", "segmentation.num_workers=0", "--set", "proposals.epochs=3",
                   "--set", "classifier.cam_scales=[1.0]", "--set", "shard_size=4", "--rounds", "1",
                   "--compare-models", 'small={"width": 4}', "--compare-seconds", "2", "--model-seeds", "2"]
    args = _parse(argv)
    from wsseg.flows.cli_bench import cmd_bench_quality

    assert args.run_dir == str(run) and args.func is cmd_bench_quality
    assert args.func(args) == 0

    res = json.loads(out.read_text())
    # where the figures come from (tasks.bench.provenance): called without the typed command, none is named
    assert res["provenance"]["command"] is None and res["provenance"]["load_average"]["end"] is not None
    assert res["split"] == "train" and res["eval_split"] == "val" and not res["warnings"]
    assert res["images"] == len(TRAIN) and res["eval_images"] == len(VAL)
    values = [res["pseudo_label_miou"], res["baselines"]["cam"]["miou"], res["baselines"]["cam_crf"]["miou"],
              res["wsss_model_miou"], res["supervised_model_miou"]]
    values += [x for r in res["rounds"] for x in (r["pseudo_label_miou"], r["changed_share"], r["ignore_share"])]
    assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in values), values
    sup = res["supervised_model_miou"]
    assert res["wsss_over_supervised"] == (pytest.approx(res["wsss_model_miou"] / sup) if sup > 0 else None)
    # the models are gated by the image classifier (config.inference), the ungated figures kept beside
    u = res["ungated"]
    assert res["model_gate"] == "image classifier" and res["config"]["inference"]["gate"] is True
    assert all(0.0 <= u[k] <= 1.0 for k in ("wsss_model_miou", "supervised_model_miou"))
    assert "| mIoU (gated by the image classifier) | ungated |" in out.with_suffix(".md").read_text()
    assert [r["round"] for r in res["rounds"]] == [0] and res["final_round"] == 0
    for k in ("ours", "cam", "cam_crf"):
        assert set(res["per_class_iou"][k]) == set(Store(run).classes().names)
    assert res["wall_seconds"] > 0 and res["config"]["max_rounds"] == 1 and res["supervised_epochs"] == 1
    # the supervised reference is trained like the final model (same start, epochs and seed): only the labels differ
    fin, ref = (load_model(p)[1]["meta"] for p in (res["final_model"], res["supervised_model"]))
    assert fin["start"] == ref["start"] == "ImageNet's lite0 weights"
    assert fin["epochs_run"] == ref["epochs_run"] and fin["round"] == ref["round"] == res["final_round"]
    # --model-seeds 2: a second pair under seed 1, same recipe; seed 0's pair is the one above
    ms = res["model_seeds"]
    assert [r["seed"] for r in ms["seeds"]] == [0, 1]
    assert ms["seeds"][0]["wsss"] == res["wsss_model_miou"] and ms["seeds"][0]["supervised"] == sup
    again = {w: Store(run).read_model("extra", name=f"seed001-{w}") for w in ("wsss", "supervised")}
    for w, (net, ck) in again.items():
        assert ck["meta"]["start"] == fin["start"] and ck["meta"]["epochs_run"] == fin["epochs_run"]
    # another seed is another model, for both of the pair, trained as the same round
    for w, path in (("wsss", res["final_model"]), ("supervised", res["supervised_model"])):
        first = load_model(path)[0]
        assert again[w][1]["meta"]["round"] == fin["round"]
        assert any(not torch.equal(a, b) for a, b in zip(first.state_dict().values(),
                                                         again[w][0].state_dict().values())), w
    ratios = [r["ratio"] for r in ms["seeds"] if r["ratio"] is not None]
    if ratios:
        assert ms["ratio"]["mean"] == pytest.approx(sum(ratios) / len(ratios))
        assert ms["ratio"]["min"] <= ms["ratio"]["mean"] <= ms["ratio"]["max"]
    assert ms["wsss"]["mean"] == pytest.approx((ms["seeds"][0]["wsss"] + ms["seeds"][1]["wsss"]) / 2)
    assert "| WSSS / supervised, mean (min-max) |" in out.with_suffix(".md").read_text()
    assert "model_seeds" in res["stage_seconds"]
    assert out.with_suffix(".md").read_text().count("| CAM + dense CRF |") == 1
    assert out.with_suffix(".png").stat().st_size > 1000
    assert all(i in TRAIN for i in res["figure_images"]) and len(res["figure_images"]) == 6
    assert "CAM + dense CRF" in capsys.readouterr().out

    # CAM + CRF exists for every image, at the image's size, on tagged classes only (what the CRF
    # changes is tested on a synthetic image with known regions above; here the 1-round CAM of a
    # 3-epoch classifier can be too flat for the CRF to move any boundary)
    store = Store(run)
    classes = store.classes()
    for iid in TRAIN:
        cam, crf = store.pseudo(0, iid, name="cam"), store.pseudo(0, iid, name="cam_crf")
        rec = next(r for r in store.manifest() if r.image_id == iid)
        assert crf is not None and crf.shape == cam.shape == (rec.height, rec.width)
        assert set(np.unique(crf)) <= set(np.flatnonzero(classes.tag_vector(rec.tags)))

    # the ablation variant reused the corpus, cache and classifier instead of recomputing them
    a = res["ablations"]["fusion_topk"]
    assert "error" not in a and 0.0 <= a["pseudo_label_miou"] <= 1.0
    vdir = run / "ablate-fusion_topk"
    for path in ("corpus", "cache", Store(vdir).checkpoint_path("classifier").name):
        assert (vdir / path).is_symlink() and (vdir / path).resolve() == (run / path).resolve()
    for group in ("prelim", "cam"):  # round 0's packs: the main run's, linked
        assert (vdir / "rounds" / "r000" / group).is_symlink()
    assert Store(vdir).read_config()["proposals"]["fusion"] == "topk"
    assert "| fusion_topk |" in out.with_suffix(".md").read_text()
    # label-only: compared with the main run's round 0, and no model is trained after its labels
    assert res["ablation_round"] == 0 and res["ablation_reference_miou"] == res["rounds"][0]["pseudo_label_miou"]
    assert a["delta"] == pytest.approx(a["pseudo_label_miou"] - res["ablation_reference_miou"])
    assert set(a["per_class_iou"]) == set(classes.names)
    assert (vdir / "rounds" / "r000" / "pseudo").is_dir() and not Store(vdir).has_checkpoint("segmenter", 0)
    # the edge channel only feeds the segmenter, so a 1-round ablation cannot measure it
    assert "--ablate-rounds 2" in res["ablations"]["no_edges"]["skipped"] and not (run / "ablate-no_edges").exists()

    # networks side by side: the configured one and the named one, each trained on the final
    # pseudo-labels and on the masks for an epoch count derived from its measured speed
    comp = res["model_comparison"]
    assert list(comp) == ["lite", 'small{"width": 4}']
    for c in comp.values():
        assert c["epochs"] == budget_epochs(2, c["measured_images_per_second"], len(TRAIN))
        for what in ("wsss", "supervised"):
            assert 0.0 <= c[what]["miou"] <= 1.0 and Path(c[what]["checkpoint"]).exists()
            assert c[what]["epochs_run"] <= c["epochs"]
    wsss_ckpt = read_file(comp['small{"width": 4}']["wsss"]["checkpoint"])
    assert wsss_ckpt["options"] == {"width": 4}
    assert out.with_suffix(".md").read_text().count("| small |") == 1
    assert out.with_suffix(".md").read_text().count("| lite |") == 1

    # the same command again: each model's evaluation is reused (same checkpoint, images, masks and
    # gate), with the same figures; a changed checkpoint is evaluated again
    capsys.readouterr()
    assert args.func(args) == 0
    err = capsys.readouterr().err
    again_res = json.loads(out.read_text())
    assert "[evaluate WSSS model] reused" in err and "[evaluate supervised model] reused" in err
    assert "[evaluate seed 1 wsss] reused" in err
    assert again_res["wsss_model_miou"] == res["wsss_model_miou"] and again_res["ungated"] == res["ungated"]
    assert again_res["model_seeds"] == res["model_seeds"]

    # other pseudo-labels (another proposal classifier): the models trained on them are trained
    # again, seed 1's too; the supervised reference (masks, same recipe) is kept
    sup_path, store_extra = Path(res["supervised_model"]), Store(run).checkpoint_path("extra", name="seed001-wsss")
    sup_mtime, seed_mtime = sup_path.stat().st_mtime_ns, store_extra.stat().st_mtime_ns
    old_seed = load_model(store_extra)[0].state_dict()
    changed = _parse([*argv, "--set", "proposals.epochs=2"])
    assert changed.func(changed) == 0
    err = capsys.readouterr().err
    assert "seed001-wsss.pt was trained with other settings than today's (labels): trained again" in err, err
    assert "supervised/model.pt was trained" not in err and sup_path.stat().st_mtime_ns == sup_mtime
    assert store_extra.stat().st_mtime_ns != seed_mtime
    # trained on the new labels, not resumed from the finished training state of the old ones
    assert any(not torch.equal(a, b) for a, b in zip(old_seed.values(), load_model(store_extra)[0].state_dict().values()))
    meta = Store(run).read_model("extra", name="seed001-wsss")[1]["meta"]
    assert meta["trained_on"]["labels"].startswith("round 0 ") and meta["trained_on"]["seed"] == 1
    assert meta["trained_on"]["labels"] != load_model(sup_path)[1]["meta"]["trained_on"]["labels"] == "masks"
    from wsseg.flows.bench_quality import evaluation_key

    eval_records = [r for r in store.manifest("val")]
    before = evaluation_key(store, eval_records, "k", {}, "supervised")
    Path(res["supervised_model"]).write_bytes(Path(res["supervised_model"]).read_bytes() + b"\0")
    assert evaluation_key(store, eval_records, "k", {}, "supervised")["checkpoint"] != before["checkpoint"]


def test_model_specs_and_budget_epochs():
    assert parse_model_spec("fusion") == ("fusion", {})
    assert parse_model_spec('fusion={"width": 0.25}') == ("fusion", {"width": 0.25})
    with pytest.raises(ValueError, match="unknown network 'fuson'"):
        parse_model_spec("fuson")
    with pytest.raises(ValueError, match="JSON object"):
        parse_model_spec("fusion=[1]")
    with pytest.raises(ValueError, match="JSON object"):
        parse_model_spec("fusion={width: 1}")
    assert budget_epochs(300, 10.0, 276) == 10  # 3000 images / 276 = 10.9 -> 10 whole epochs
    assert budget_epochs(300, 0.5, 276) == 1  # slower than one epoch: still one
    assert budget_epochs(60, 9.2, 100, minimum=2) == 5
    with pytest.raises(ValueError):
        budget_epochs(300, 0.0, 276)


def test_unknown_set_keys_are_refused():
    check_overrides(["proposals.t1=0.4", "segmentation.options.width=8", "segmentation.options={}"])
    with pytest.raises(ValueError, match="segmentation.widht"):
        check_overrides(["proposals.t1=0.4", "segmentation.widht=8"])


def test_seed_summary_and_compared_networks():
    from wsseg.tasks.bench.quality import compared_networks, ratio, seed_summary
    from wsseg.tasks.config import WSSSConfig

    s = seed_summary([{"seed": 0, "wsss": 0.4, "supervised": 0.5}, {"seed": 1, "wsss": 0.3, "supervised": 0.0}])
    assert s["seeds"][0]["ratio"] == pytest.approx(0.8) and s["seeds"][1]["ratio"] is None
    assert s["wsss"] == {"mean": pytest.approx(0.35), "min": 0.3, "max": 0.4} and "wsss_ungated" not in s
    assert ratio(None, 0.5) is None
    # the configured network first, then each named one once (tagged by name and sorted options)
    cfg = WSSSConfig.model_validate({"segmentation": {"model": "small", "options": {}}})
    nets = compared_networks(cfg, ["small", 'small={"width": 4}', 'small={"width": 4}', 'fusion={"width": 0.25}'])
    assert nets == [("small", "small", {}), ('small{"width": 4}', "small", {"width": 4}),
                    ('fusion{"width": 0.25}', "fusion", {"width": 0.25})]


def test_markdown_report_shows_box_grabcut_class_accuracy_and_the_final_round():
    from wsseg.tasks.report.figures import markdown_report

    base = {"miou": 0.5, "pixel_accuracy": 0.8, "class_accuracy": 0.6, "chance_miou": 0.3}
    res = {"dataset": "objects", "split": "train", "images": 3, "eval_split": "val", "eval_images": 1,
           "baselines": {"cam": base, "cam_crf": base, "box_grabcut": {**base, "class_accuracy": 0.7}},
           "rounds": [{"round": 0, "pseudo_label_miou": 0.71, "pseudo_label_class_accuracy": 0.83,
                       "changed_share": 0.6, "ignore_share": 0.0, "tag_coverage": math.log(0.5)},
                      {"round": 1, "pseudo_label_miou": 0.64, "pseudo_label_class_accuracy": 0.78,
                       "changed_share": 0.08, "ignore_share": 0.0, "tag_coverage": math.log(0.4)}],
           "final_round": 0, "stop_reason": "oscillation: round 1 sent 0.50 ...; round 0 is final",
           "foreground": True, "ungated": None, "wsss_model_miou": 0.4, "supervised_model_miou": 0.5,
           "wsss_over_supervised": 0.8, "supervised_epochs": 6, "wsss_model_class_accuracy": 0.55,
           "supervised_model_class_accuracy": 0.65,
           "per_class_iou": {"ours": {"background": 0.78, "object": 0.64}, "cam": {"background": 0.1, "object": 0.3},
                             "cam_crf": {"background": 0.1, "object": 0.3},
                             "box_grabcut": {"background": 0.8, "object": 0.62}},
           "per_class_accuracy": {"background": 0.9, "object": 0.77}, "pseudo_label_chance_miou": 0.45,
           "per_class_chance_iou": {"ours": {"background": 0.6, "object": 0.3}},
           "warnings": ["no tag contrast: ..."], "wall_seconds": 1.0, "stage_seconds": {"ingest": 1.0}}
    md = markdown_report(res)
    assert ("| labels on train | mIoU | mean class acc. | pixel acc. | changed | ignore | mIoU at chance | "
            "tag share |") in md
    # the stopping rule's signal per round, as the share it stands for; a baseline has none
    assert "| ours, round 1 | 0.6400 | 0.7800 | | 0.0800 | 0.0000 | - | 0.4000 |" in md
    assert "| CAM (round 0) | 0.5000 | 0.6000 | 0.8000 | | 0.0000 | 0.3000 | |" in md
    # the chance level of the final round (from the result when its round summary predates it)
    # and of a baseline, and the per-class chance column of ours
    assert "| ours, round 0 (final) | 0.7100 | 0.8300 | | 0.6000 | 0.0000 | 0.4500 |" in md
    assert "| ours, round 1 | 0.6400 | 0.7800 | | 0.0800 | 0.0000 | - |" in md
    assert "| CAM (round 0) | 0.5000 | 0.6000 | 0.8000 | | 0.0000 | 0.3000 |" in md
    assert "| box GrabCut (10% inset, 3 iterations, per image) | 0.5000 | 0.7000 | 0.8000 |" in md
    assert "| ours, round 0 (final) | 0.7100 | 0.8300 |" in md and "| ours, round 1 | 0.6400 | 0.7800 |" in md
    assert "Stopped: oscillation" in md and "foreground path: on" in md and "- no tag contrast" in md
    assert "| object | 0.300 | 0.300 | 0.620 | 0.640 | 0.770 | 0.300 |" in md
    # quality_result always writes the round's key; None (an older round summary) falls back too
    res["rounds"][0]["pseudo_label_chance_miou"] = None
    assert "| ours, round 0 (final) | 0.7100 | 0.8300 | | 0.6000 | 0.0000 | 0.4500 |" in markdown_report(res)
    assert "| WSSS model, mean class accuracy | 0.5500 |" in md
