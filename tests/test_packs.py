"""tasks.store.packs: per-image arrays packed by shard (files grow with shards, not images), read
back exactly, never half-written, and older run directories' per-image arrays still read."""
import json
import multiprocessing as mp

import numpy as np
import pytest

from wsseg.tasks.store import Store, packs


def _label(i, shape=(6, 7)):
    return np.full(shape, i % 250, np.uint8)


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_a_shard_is_one_pack_and_reads_back(tmp_path):
    store = Store(tmp_path)
    ids = [f"img{i:03d}" for i in range(50)]
    prob = np.linspace(0, 1, 2 * 6 * 7, dtype=np.float32).reshape(2, 6, 7)
    with store.packing(Store.shard_name(ids)):
        for i, iid in enumerate(ids):
            store.write_pseudo(0, iid, _label(i))
            store.write_prelim(0, iid, prob, np.array([0, 3]))
            store.put_cached("features", "k", f"{i:02x}" + "0" * 62, {"edges": np.full((6, 7), i, np.float32),
                                                            "ids": np.arange(i + 1, dtype=np.int32)})
            assert store.has_pseudo(0, iid) and store.pseudo(0, iid)[0, 0] == i  # the block reads what it wrote
    # three files a group whatever the number of images: the generation, the pack and its index
    for group in (store.round_dir(0) / "pseudo", store.round_dir(0) / "prelim", store.cache_dir("features", "k")):
        names = _files(group)
        assert len(names) == 4 and names[0] == "packs.json", names
    packs.forget()  # a new process
    fresh = Store(tmp_path)
    for i, iid in enumerate(ids):
        assert np.array_equal(fresh.pseudo(0, iid), _label(i))
        p = fresh.prelim(0, iid, 4)
        assert np.allclose(p[3], prob[1], atol=1 / 255) and p[[1, 2]].sum() == 0
        got = fresh.cached("features", "k", f"{i:02x}" + "0" * 62)
        assert np.array_equal(got["ids"], np.arange(i + 1)) and got["edges"].dtype == np.float32
    assert fresh.pseudo(0, "other") is None and not fresh.has_pseudo(1, ids[0])
    # what a process holds of a group: 12 bytes a name (its hash and its pack), whatever the packs
    assert packs.index_of(store.round_dir(0) / "pseudo").memory_bytes() == 12 * len(ids)


def test_a_block_that_fails_writes_nothing(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(RuntimeError):
        with store.packing("s"):
            store.write_pseudo(0, "a", _label(1))
            raise RuntimeError("the shard failed")
    assert not (store.round_dir(0) / "pseudo" / "packs").exists() and store.pseudo(0, "a") is None


def test_the_pack_written_last_wins_and_drops_reach_other_processes(tmp_path):
    """A label written again (a shard computed again, a refresh) replaces the old one; an image
    dropped by another process (an ingest that changed it) is gone for a long-lived process too
    (a Dask worker keeps its index between tasks: the group's generation tells it)."""
    store = Store(tmp_path)
    with store.packing("first"):
        for i in range(4):
            store.write_pseudo(0, f"i{i}", _label(i))
    assert store.pseudo(0, "i1")[0, 0] == 1
    with store.packing("second"):
        store.write_pseudo(0, "i1", _label(9))
    assert Store(tmp_path).pseudo(0, "i1")[0, 0] == 9

    ctx = mp.get_context("fork")
    p = ctx.Process(target=_drop_in_child, args=(str(tmp_path),))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    late = Store(tmp_path)  # the next task in this (long-lived) process
    assert late.pseudo(0, "i2") is None and not late.has_pseudo(0, "i2")
    assert late.pseudo(0, "i3")[0, 0] == 3 and late.pseudo(0, "i9")[0, 0] == 9  # written by the child
    assert late.pseudo(0, "i1")[0, 0] == 9


def _drop_in_child(root):
    s = Store(root)
    s.drop_labels(["i2"])
    with s.packing("child"):
        s.write_pseudo(0, "i9", _label(9))


def _write_shard(args):
    root, k = args
    s = Store(root)
    ids = [f"w{k}-{i}" for i in range(5)]
    with s.packing(Store.shard_name(ids)):
        for i, iid in enumerate(ids):
            s.write_pseudo(0, iid, _label(10 * k + i))
    return k


def test_concurrent_shards_into_a_new_group(tmp_path):
    with mp.get_context("fork").Pool(6) as pool:
        pool.map(_write_shard, [(str(tmp_path), k) for k in range(12)])
    store = Store(tmp_path)
    assert all(store.pseudo(0, f"w{k}-{i}")[0, 0] == 10 * k + i for k in range(12) for i in range(5))
    assert len(_files(store.round_dir(0) / "pseudo")) == 3 * 12 + 1


def test_an_older_run_directory_still_reads_and_takes_new_packs(tmp_path):
    """Per-image arrays (the layout before packs: one Zarr array per image) read as before; new
    shards write packs beside them; drop_labels removes an image from both."""
    from wsseg.tasks.store import chunked

    store = Store(tmp_path)
    for group in ("pseudo.zarr", "prelim.zarr"):
        (store.round_dir(0) / group).mkdir(parents=True)
        (store.round_dir(0) / group / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))
    chunked.write(store.round_dir(0) / "pseudo.zarr" / "old", _label(5), {"complete": True})
    chunked.write(store.round_dir(0) / "prelim.zarr" / "old", np.full((1, 6, 7), 255, np.uint8),
                  {"classes": [2], "complete": True})
    base = store.cache_dir("features", "k")
    chunked.write(base / f"{'ab' * 12}.edges", np.ones((6, 7), np.float32))
    chunked.write(base / ("ab" * 12), np.zeros(1, np.uint8), {"parts": ["edges"], "complete": True})
    (base / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group"}))

    store = Store(tmp_path)
    assert np.array_equal(store.pseudo(0, "old"), _label(5)) and store.has_pseudo(0, "old")
    assert store.prelim(0, "old", 3)[2].min() == 1.0
    assert store.has_cached("features", "k", "ab" * 32)
    assert store.cached("features", "k", "ab" * 32)["edges"].sum() == 42
    with store.packing("new"):
        store.write_pseudo(0, "new", _label(6))
    store.drop_labels(["old"])
    fresh = Store(tmp_path)
    assert fresh.pseudo(0, "old") is None and fresh.pseudo(0, "new")[0, 0] == 6


def test_packs_on_object_storage(tmp_path, monkeypatch):
    """The same through fsspec (its in-memory filesystem): ranged reads of one pack."""
    import uuid

    monkeypatch.setenv("WSSEG_STATE_HOME", str(tmp_path / "home"))
    store = Store(f"memory://wsseg-packs-{uuid.uuid4().hex[:8]}/run")
    with store.packing("s"):
        for i in range(5):
            store.write_pseudo(0, f"i{i}", _label(i))
            store.put_cached("f", "k", f"{i:02x}" + "0" * 62, {"a": np.arange(i + 2), "b": np.ones(3, np.float32)})
    packs.forget()
    fresh = Store(str(store.root))
    assert all(fresh.pseudo(0, f"i{i}")[0, 0] == i for i in range(5))
    assert np.array_equal(fresh.cached("f", "k", "03" + "0" * 62)["a"], np.arange(5))
    assert packs.usage(fresh.round_dir(0) / "pseudo")[0] == 4
    fresh.drop_labels(["i1"])
    assert Store(str(store.root)).pseudo(0, "i1") is None


def test_a_block_reads_older_packs_beside_its_own(tmp_path):
    """Inside a shard's block, an image cached by an earlier shard reads from its pack while the
    block holds other images' entries of the same group (a refresh of new and old images)."""
    store = Store(tmp_path)
    old, new = "0a" + "0" * 62, "0b" + "0" * 62
    store.put_cached("f", "k", old, {"edges": np.ones((2, 2), np.float32), "x": np.arange(3)})
    with store.packing("refresh"):
        store.put_cached("f", "k", new, {"edges": np.zeros((2, 2), np.float32), "x": np.arange(4)})
        assert store.cached("f", "k", old)["edges"].sum() == 4 and len(store.cached("f", "k", new)["x"]) == 4
        assert list(store.cached("f", "k", old, ("x",))) == ["x"]


def test_a_long_lived_instance_reads_what_workers_wrote_since(tmp_path):
    """The flow's Store asks which images need features (none cached yet), workers then write
    their packs, and the flow's trainers read every entry with the same Store."""
    flow = Store(tmp_path)
    sha = "0c" + "0" * 62
    assert not flow.has_cached("f", "k", sha) and flow.pseudo(0, "a") is None
    ctx = mp.get_context("fork")
    p = ctx.Process(target=_worker_writes, args=(str(tmp_path), sha))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert flow.cached("f", "k", sha)["x"].sum() == 6 and flow.pseudo(0, "a")[0, 0] == 4


def _worker_writes(root, sha):
    s = Store(root)
    with s.packing("w"):
        s.put_cached("f", "k", sha, {"x": np.arange(4)})
        s.write_pseudo(0, "a", _label(4))
