"""tasks.store: what is written is read back; incomplete writes are never read."""
import json

import numpy as np
import pytest
import scipy.sparse as sp

from wsseg.tasks.store import ClassSpec, ImageRecord, Store, arrays_to_sparse, packs, params_key, sparse_to_arrays


def _rec(iid, tags=("grass",), split="train"):
    return ImageRecord(iid, 4, 5, tuple(tags), "ab" * 32, split, f"/src/{iid}.jpg", True)


def test_corpus_round_trip(tmp_path):
    store = Store(tmp_path)
    classes = ClassSpec(("background", "cow", "grass"), background=0)
    store.write_corpus([_rec("a", ("cow",)), _rec("b", ("grass",), "val")], classes)
    assert store.classes() == classes
    assert [r.image_id for r in store.manifest()] == ["a", "b"]
    assert [r.image_id for r in store.manifest("val")] == ["b"]
    assert store.manifest()[0].tags == ("cow",)
    # the implicit background is allowed for every image
    assert store.classes().tag_vector(["cow"]).tolist() == [True, True, False]


def test_image_and_mask_round_trip(tmp_path):
    store = Store(tmp_path)
    img = np.arange(4 * 5 * 3, dtype=np.uint8).reshape(4, 5, 3)
    store.put_image("a", img, "sha-a")
    assert np.array_equal(store.image("a"), img)
    assert store.has_image("a", "sha-a") and not store.has_image("a", "other")
    assert store.mask("a") is None
    with pytest.raises(KeyError, match="not in the corpus"):
        store.image("missing")


def _legacy_write(store, group, name, arr, complete=True):
    """A per-image array as a wsseg before the packs wrote it (an older run directory)."""
    from wsseg.tasks.store import chunked

    (group / "zarr.json").parent.mkdir(parents=True, exist_ok=True)
    (group / "zarr.json").write_text(json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}))
    chunked.write(group / name, arr, {"complete": True} if complete else {})


def test_incomplete_array_is_not_read(tmp_path):
    """A pack whose index was never written (a crash between the two) reads as absent, and so
    does an older run directory's per-image array without its completion marker."""
    store = Store(tmp_path)
    with store.packing("s1"):
        store.write_pseudo(0, "a", np.ones((3, 3), np.uint8))
    idx = [p for p in (store.round_dir(0) / "pseudo" / "packs").iterdir() if p.suffix == ".json"]
    assert len(idx) == 1 and store.pseudo(0, "a") is not None
    idx[0].unlink()
    packs.forget()  # as a new process sees it
    assert Store(tmp_path).pseudo(0, "a") is None and not Store(tmp_path).has_pseudo(0, "a")
    _legacy_write(store, store.round_dir(0) / "pseudo.zarr", "b", np.ones((3, 3), np.uint8), complete=False)
    assert Store(tmp_path).pseudo(0, "b") is None


def test_prelim_is_quantised_and_expanded(tmp_path):
    store = Store(tmp_path)
    p = np.zeros((2, 3, 3), np.float32)
    p[0] = 0.25
    p[1] = 0.75
    store.write_prelim(1, "a", p, np.array([2, 4]))
    out = store.prelim(1, "a", 5)
    assert out.shape == (5, 3, 3)
    assert np.allclose(out[2], 0.25, atol=1 / 255) and np.allclose(out[4], 0.75, atol=1 / 255)
    assert out[[0, 1, 3]].sum() == 0


def test_cache_is_content_addressed(tmp_path):
    store = Store(tmp_path)
    key = params_key({"a": 1})
    assert key != params_key({"a": 2}) and key == params_key({"a": 1})
    m = sp.csr_matrix(np.array([[1, 0, 1], [0, 1, 0]], bool))
    store.put_cached("features", key, "f" * 64, {"x": np.arange(3), **sparse_to_arrays(m)})
    assert store.has_cached("features", key, "f" * 64)
    assert not store.has_cached("features", key, "e" * 64)
    got = store.cached("features", key, "f" * 64)
    assert np.array_equal(got["x"], np.arange(3))
    assert (arrays_to_sparse(got) != m).nnz == 0
    only = store.cached("features", key, "f" * 64, ("x",))
    assert list(only) == ["x"] and np.array_equal(only["x"], np.arange(3))
    with pytest.raises(KeyError, match="no part edges"):
        store.cached("features", key, "f" * 64, ("edges",))


def test_shard_markers(tmp_path):
    store = Store(tmp_path)
    assert store.shard_done(0, "pseudo", "a") is None
    store.mark_shard_done(0, "pseudo", "a", {"images": 3})
    assert store.shard_done(0, "pseudo", "a") == {"images": 3}


def test_a_shard_marker_counts_for_exactly_its_images(tmp_path):
    """A round resumed with another shard size does not take the marker of a shard that began
    with the same image for its own: the name covers every id of the shard."""
    store = Store(tmp_path)
    store.mark_shard_done(0, "prelim", Store.shard_name(["a", "b"]), {"images": 2})
    assert store.shard_done(0, "prelim", Store.shard_name(["a", "b"])) == {"images": 2}
    for other in (["a", "b", "c"], ["a"], ["a", "c"], ["b", "a"]):
        assert store.shard_done(0, "prelim", Store.shard_name(other)) is None, other


def _put(args):
    root, i = args
    Store(root).put_image(f"img{i}", np.full((4, 4, 3), i, np.uint8), f"sha{i}")
    return i


def test_concurrent_writers_into_a_new_group(tmp_path):
    """Worker processes that create the first arrays of a group at the same moment all succeed
    (one of them used to fail with 'A group exists in store')."""
    import multiprocessing as mp

    for trial in range(3):
        root = tmp_path / f"t{trial}"
        with mp.get_context("fork").Pool(6) as pool:
            pool.map(_put, [(str(root), i) for i in range(12)])
        store = Store(root)
        assert all(store.image(f"img{i}")[0, 0, 0] == i for i in range(12))


# ---------------------------------------------------------------------------- a run directory behind fsspec
def test_store_over_fsspec_reads_back_what_it_wrote(tmp_path, monkeypatch):
    """The same Store calls on an fsspec URL (fsspec's in-memory filesystem: no server needed;
    tests/test_store_remote.py runs a whole round on a real S3 server)."""
    import pickle
    import uuid

    import torch

    from wsseg.models import build_model

    monkeypatch.setenv("WSSEG_STATE_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("WSSEG_STATE_DIR", raising=False)
    url = f"memory://wsseg-test-{uuid.uuid4().hex[:8]}/run"
    store = Store(url + "/")
    assert store.remote and str(store.root) == url and repr(store) == f"Store({url!r})"
    # the local state folder mirrors the URL under WSSEG_STATE_HOME; nothing made there yet
    assert store.state_dir == (tmp_path / "home" / "memory" / url.split("://")[1]).resolve()
    assert not store.state_dir.exists() and not store.exists()
    classes = ClassSpec(("background", "cow", "grass"), background=0)
    store.write_corpus([_rec("a", ("cow",)), _rec("b", ("grass",), "val")], classes)
    assert store.exists() and store.classes() == classes and [r.image_id for r in store.manifest("val")] == ["b"]
    img = np.arange(60, dtype=np.uint8).reshape(4, 5, 3)
    store.put_image("a", img, "ab" * 32)
    assert store.has_image("a", "ab" * 32) and not store.has_image("a", "cd" * 32)
    assert np.array_equal(store.image("a"), img) and store.image_shape("a") == (4, 5, 3)
    store.put_cached("feat", "k", "cd" * 32, {"edges": np.ones((4, 5), np.float32)})
    assert store.has_cached("feat", "k", "cd" * 32) and store.cached("feat", "k", "cd" * 32)["edges"].sum() == 20
    label = np.array([[0, 1, 255, 2, 1]] * 4, np.uint8)
    store.write_pseudo(0, "a", label)
    assert np.array_equal(store.pseudo(0, "a"), label) and store.pseudo(0, "b") is None
    store.mark_shard_done(0, "pseudo", "a", {"images": 1})
    assert store.rounds() == [0] and store.shard_done(0, "pseudo", "a") == {"images": 1}
    assert store.shard_markers(0, "pseudo") == ["pseudo-a.json"] and store.finished_rounds() == []
    store.write_round(0, {"round": 0})
    assert store.finished_rounds() == [0] and store.read_round(0) == {"round": 0}
    torch.manual_seed(0)
    net = build_model("small", 3, in_channels=3, width=8)
    path = store.write_model("segmenter", net, 0, builder="small", num_classes=3, in_channels=3, options={"width": 8})
    assert str(path) == f"{url}/rounds/r000/model.pt" and store.has_checkpoint("segmenter", 0)
    back, _ = store.read_model("segmenter", 0)
    assert all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), back.state_dict().values()))
    # a damaged checkpoint is moved aside, as locally
    path.write_bytes(b"cut short")
    assert store.usable_checkpoint("segmenter", 0) is None and not store.has_checkpoint("segmenter", 0)
    assert (path.parent / "model.pt.damaged").exists()
    store.write_config({"seed": 1})
    assert store.read_config() == {"seed": 1} and store.size_bytes() > img.size
    assert pickle.loads(pickle.dumps(store)).image("a").sum() == img.sum()  # what a Dask task receives
    store.drop_images(["a"])
    assert not store.has_image("a", "ab" * 32)


def test_local_run_dirs_keep_their_layout(tmp_path):
    """A local path and a file:// URL are the same local run directory, its own state folder."""
    from wsseg.tasks.store.remote import is_remote_url, parse_storage_options

    a, b = Store(tmp_path / "run"), Store(f"file://{tmp_path}/run")
    assert not a.remote and a.root == b.root == tmp_path / "run" and a.state_dir == a.root
    assert not is_remote_url(tmp_path) and not is_remote_url("runs/x") and is_remote_url("s3://b/x")
    assert parse_storage_options(["endpoint_url=http://h:9000", "anon=false", "client_kwargs.region_name=eu"]) == \
        {"endpoint_url": "http://h:9000", "anon": False, "client_kwargs": {"region_name": "eu"}}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_storage_options(["endpoint_url"])


DTYPES = ("bool", "uint8", "int32", "int64", "float16", "float32", "float64")


@pytest.mark.parametrize("dtype", DTYPES)
def test_direct_chunks_are_zarr_arrays_both_ways(tmp_path, dtype):
    """The store writes its single-chunk arrays without zarr (tasks.store.chunked): zarr reads
    them back value for value with their attributes, and the store reads what zarr wrote,
    including an all-fill array whose chunk zarr never writes."""
    import zarr

    from wsseg.tasks.store import chunked

    rng = np.random.default_rng(3)
    for shape in ((7,), (5, 6), (4, 5, 3)):
        a = (rng.random(shape) * 50 - (0 if dtype.startswith("u") or dtype == "bool" else 25)).astype(dtype)
        ours = tmp_path / f"ours-{dtype}-{len(shape)}"
        chunked.write(ours, a, {"complete": True, "sha256": "x"})
        z = zarr.open_array(str(ours), mode="r")
        assert z.dtype == a.dtype and z.shape == a.shape and np.array_equal(z[...], a)
        assert dict(z.attrs) == {"complete": True, "sha256": "x"}
        theirs = tmp_path / f"zarr-{dtype}-{len(shape)}"
        zz = zarr.create_array(str(theirs), shape=a.shape, dtype=a.dtype, chunks=a.shape, fill_value=0)
        zz[...] = a
        back = chunked.read(theirs, chunked.metadata(theirs))
        assert back.dtype == a.dtype and np.array_equal(back, a) and back.flags.writeable
    empty = tmp_path / f"zeros-{dtype}"
    zz = zarr.create_array(str(empty), shape=(3, 4), dtype=dtype, chunks=(3, 4), fill_value=0)
    zz[...] = np.zeros((3, 4), dtype)
    assert not (empty / "c").exists()  # zarr skips a chunk equal to the fill value
    assert np.array_equal(chunked.read(empty, chunked.metadata(empty)), np.zeros((3, 4), dtype))


def test_replaced_array_reads_missing_until_whole(tmp_path):
    """Replacing a per-image array removes its metadata before its chunk is rewritten: a writer
    stopped between the two leaves an array that reads as absent, never old metadata over a new
    chunk (the corpus's arrays, and an older run directory's labels)."""
    from wsseg.tasks.store import chunked

    store = Store(tmp_path)
    _legacy_write(store, store.round_dir(0) / "pseudo.zarr", "a", np.ones((3, 3), np.uint8))
    assert np.array_equal(Store(tmp_path).pseudo(0, "a"), np.ones((3, 3), np.uint8))
    path = store.round_dir(0) / "pseudo.zarr" / "a"
    (path / "zarr.json").unlink()  # what a writer stopped after its first step leaves
    (path / "c" / "0" / "0").write_bytes(chunked._ZSTD.encode(np.full((4, 4), 2, np.uint8).tobytes()))
    assert Store(tmp_path).pseudo(0, "a") is None
    store.write_pseudo(0, "a", np.full((4, 4), 2, np.uint8))  # written again: as a pack, which wins
    assert np.array_equal(Store(tmp_path).pseudo(0, "a"), np.full((4, 4), 2, np.uint8))


def test_cached_parts_written_by_zarr_still_read(tmp_path):
    """A feature cache written by zarr itself (older runs) reads back the same."""
    import zarr

    store = Store(tmp_path)
    parts = {"edges": np.arange(12, dtype=np.uint8).reshape(3, 4), "feats": np.ones((2, 5), np.float32)}
    base = store.cache_dir("features", "k")
    g = zarr.open_group(str(base), mode="a")
    for name, arr in parts.items():
        a = g.create_array(f"{'ab' * 12}.{name}", shape=arr.shape, dtype=arr.dtype, chunks=arr.shape, fill_value=0)
        a[...] = arr
        a.attrs.update({"complete": True})
    m = g.create_array("ab" * 12, shape=(1,), dtype="uint8", chunks=(1,), fill_value=0)
    m[...] = np.zeros(1, np.uint8)
    m.attrs.update({"parts": sorted(parts), "complete": True})
    got = store.cached("features", "k", "ab" * 32)
    assert sorted(got) == sorted(parts) and all(np.array_equal(got[k], parts[k]) for k in parts)
    store.put_cached("features", "k", "cd" * 32, parts)
    got = store.cached("features", "k", "cd" * 32, parts=["edges"])
    assert list(got) == ["edges"] and np.array_equal(got["edges"], parts["edges"])
