"""Checkpoint files: nothing read from disk runs code, every write is atomic, damage is named."""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from wsseg.tasks.store import CheckpointError, StateFile, Store, load_classifier, load_model, save_classifier, save_model


class _Payload:
    """Pickles into a call of os.system: what an attacker's checkpoint would hold."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _small(num_classes=3):
    from wsseg import models
    torch.manual_seed(0)
    return models.build_model("small", num_classes, in_channels=4, width=8)


def test_model_round_trip_gives_the_same_network(tmp_path):
    net = _small().eval()
    path = save_model(tmp_path / "m.pt", net, builder="small", num_classes=3, in_channels=4, options={"width": 8},
                      meta={"classes": ["a", "b", "c"]})
    loaded, state = load_model(path)
    x = torch.rand(1, 4, 64, 64)
    assert torch.equal(net(x), loaded(x)) and not loaded.training
    assert state["meta"] == {"classes": ["a", "b", "c"]} and state["builder"] == "small"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_pickled_payload_is_refused_and_never_runs(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"builder": "small", "num_classes": 3, "in_channels": 4, "options": {}, "meta": {},
                "model": _Payload(marker)}, evil)
    with pytest.raises(CheckpointError) as e:
        load_model(evil)
    assert str(evil) in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()
    with pytest.raises(CheckpointError):  # the other readers use the same door
        load_classifier(evil)
    from wsseg.tasks.store.checkpoints import backbone_weights, read_local
    for read in (read_local, backbone_weights):  # the weight files' readers too
        with pytest.raises(CheckpointError, match="refused"):
            read(evil)
    assert StateFile(evil).load() is None  # a training state that is not plain data: start over
    assert not marker.exists()


def test_builder_outside_the_registry_is_refused(tmp_path):
    """A plain-data checkpoint naming ``module:function`` (say torch.hub:load) is not built."""
    state = {"builder": "torch.hub:load", "num_classes": 3, "in_channels": 4,
             "options": {"repo_or_dir": str(tmp_path), "model": "x", "source": "local"}, "meta": {},
             "model": {}}
    (tmp_path / "hubconf.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    path = tmp_path / "hub.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match="not a registered model") as e:
        load_model(path)
    assert str(path) in str(e.value)
    assert not (tmp_path / "ran").exists()
    with pytest.raises(ValueError, match="not a registered model"):
        save_model(tmp_path / "x.pt", _small(), builder="models.small:small_segnet", num_classes=3, in_channels=4)


def test_cut_or_foreign_files_are_named(tmp_path):
    path = save_model(tmp_path / "m.pt", _small(), builder="small", num_classes=3, in_channels=4,
                      options={"width": 8})
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="m.pt: not a readable checkpoint"):
        load_model(path)
    (tmp_path / "t.pt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="t.pt"):
        load_model(tmp_path / "t.pt")
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_model(tmp_path / "missing.pt")
    torch.save({"model": {}}, tmp_path / "nobuilder.pt")
    with pytest.raises(CheckpointError, match="nobuilder.pt: not a wsseg model checkpoint"):
        load_model(tmp_path / "nobuilder.pt")


def test_corpus_classifier_round_trip(tmp_path):
    from wsseg.tasks.wsss.proposal_classifier import train_proposal_classifier

    rng = np.random.default_rng(0)
    feats = [rng.normal(size=(20, 5)).astype(np.float32)]
    targets = [np.eye(3, dtype=np.float32)[rng.integers(0, 3, 20)]]
    tags = [np.ones(3, bool)]
    model, losses = train_proposal_classifier(feats, targets, tags, hidden=8, epochs=2)
    path = save_classifier(tmp_path / "pc.pt", model, losses=losses)
    back = load_classifier(path)
    x = torch.from_numpy(feats[0])
    assert torch.equal(model(x), back["model"](x)) and not back["model"].training
    assert back["losses"] == losses
    assert load_classifier(save_classifier(tmp_path / "none.pt", None))["model"] is None


def test_store_checkpoint_kinds_and_state_files(tmp_path):
    store = Store(tmp_path)
    assert store.checkpoint_path("segmenter", 2) == tmp_path.resolve() / "rounds" / "r002" / "model.pt"
    with pytest.raises(ValueError, match="belongs to a round"):
        store.checkpoint_path("mil")
    with pytest.raises(ValueError, match="unknown checkpoint kind"):
        store.checkpoint_path("weights")
    state = store.train_state("classifier")
    assert state.load() is None
    state.save({"epoch": 3, "model": {"w": torch.ones(2)}})
    assert state.load()["epoch"] == 3
    state.clear()
    assert not state.exists()


def test_damaged_files_are_named_moved_aside_and_recomputed(tmp_path, capsys):
    store = Store(tmp_path)
    path = store.write_model("classifier", _small(), builder="small", num_classes=3, in_channels=4,
                             options={"width": 8})
    assert store.usable_checkpoint("classifier")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 3])  # a write cut short
    assert not store.usable_checkpoint("classifier")  # so its maker trains it again
    err = capsys.readouterr().err
    assert str(path) in err and "computed again" in err
    assert not path.exists() and path.with_name("classifier.pt.damaged").exists()

    state = store.train_state("segmenter", 0)
    state.save({"epoch": 1})
    state.path.write_bytes(state.path.read_bytes()[:10])
    assert state.load() is None and not state.exists()
    assert "starts over" in capsys.readouterr().err

    store.write_round(0, {"round": 0})
    (store.round_dir(0) / "round.json").write_text('{"round": ')
    assert store.read_round(0) is None and "round 0 is finished again" in capsys.readouterr().err
    store.mark_shard_done(0, "pseudo", "a", {"images": 1})
    (store.round_dir(0) / "done" / "pseudo-a.json").write_text("{")
    assert store.shard_done(0, "pseudo", "a") is None


def test_wsseg_segment_with_a_payload_checkpoint_runs_nothing(tmp_path):
    """The user-facing path: `wsseg segment img --model evil.pt` refuses in one line naming the file."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    marker = tmp_path / "ran"
    evil = tmp_path / "evil.pt"
    torch.save({"builder": "small", "num_classes": 3, "in_channels": 4, "options": {}, "meta": {},
                "model": _Payload(marker)}, evil)
    image = next((root / "flows" / "sample" / "msrc21" / "images").glob("*.jpg"))
    out = subprocess.run([sys.executable, "-m", "wsseg", "segment", str(image), "--model", str(evil), "--out",
                          str(tmp_path / "seg")], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and str(evil) in errors[0] and "never runs code" in errors[0], out.stderr
    assert "Traceback" not in out.stderr and not marker.exists()


def test_a_copied_run_directory_with_a_payload_classifier_is_recomputed_not_run(tmp_path, capsys):
    store = Store(tmp_path)
    marker = tmp_path / "ran"
    path = store.checkpoint_path("classifier")
    torch.save({"builder": "image_classifier", "model": _Payload(marker)}, path)
    assert not store.usable_checkpoint("classifier")  # resuming trains it again instead
    assert not marker.exists() and str(path) in capsys.readouterr().err
