"""The one module that knows paths and formats (Zarr arrays, Parquet tables, JSON).

Everything else asks the store for ``image(id)`` or ``write_pseudo(round, id, label)``.

Layout of a run directory::

    RUN/
      corpus/manifest.parquet      id, height, width, tags, sha256, split, source, mask; its footer
                                   the counts and content hash of each split (`wsseg status`)
      corpus/usage.json            the corpus folder's files and bytes, counted when written
      corpus/classes.json          class names and the implicit background class (or null)
      corpus/images/packs/         (H, W, 3) uint8 images, packed by ingest shard (sha256 of the file)
      corpus/masks/packs/          (H, W) uint8 ground truth, for evaluation only, packed likewise
      corpus/staging/              the indexes of an ingest's packs, until the ingest is accepted
      corpus/corrections.zarr/<id> a person's corrected labels, one array per image
      cache/<stage>-<key>/packs/   per-image stage outputs, content-addressed: the key hashes
                                   the stage's parameters, each entry is named by the image
                                   bytes' sha, so a changed image or parameter recomputes and
                                   nothing else does
      rounds/r000/prelim/packs/    preliminary results (tagged classes, quantised to uint8)
      rounds/r000/pseudo/packs/    pseudo-labels (H, W) uint8, 255 = ignore (cam/: CAM labels)
      rounds/r000/done/<stage>-<shard>.json   a shard counts as done only once this exists
      rounds/r000/round.json       the round's metrics, written last
      rounds/r000/foreground_clusters.json   the foreground path's corpus clusters (round 0 only)
      rounds/r000/inputs.json      what the round is computed from (classes, corpus hash, config)
      rounds/r000/model.pt         the round's segmenter (mil.pt, proposal_classifier.pt: its corpus
                                   classifiers; *.train_state.pt: an unfinished training's state)
      classifier.pt                the image classifier on the tags
      config.json                  the configuration the run directory belongs to
      summary.json                 the table of rounds, written at the end of `wsseg train`
      refresh.json                 the last `wsseg refresh`: new images labelled with a round's models

The per-image arrays of the stages (feature cache, preliminary results, labels) and the corpus's
images and masks are packed by shard (:mod:`tasks.store.packs`): a shard task writes one pack and
its index per group at its end (:meth:`Store.packing`), so files grow with shards, not images; an
ingest's indexes wait in ``corpus/staging/`` until the ingest is accepted. Corrections are one
single-chunk Zarr array per image, written and read locally by :mod:`tasks.store.chunked` (the
same files, without zarr's per-call machinery). Every pack and array is written by exactly one
process, and a marker is written (by an atomic rename) only after the data, so an interrupted run
is resumed by re-running it. A run directory of an older wsseg (one array per image in
``prelim.zarr``, ``pseudo.zarr``, the cache, ``corpus/images.zarr`` and ``corpus/masks.zarr``)
still reads; new shards and ingests write packs beside its arrays.

The run directory may also be an fsspec URL (``s3://bucket/run``, ``gs://...``; ``file://`` is a
local path): the same layout then lies on object storage, reached through fsspec (Zarr's
``FsspecStore`` for the arrays). An object is put whole or not at all, so files are written
directly there (no temporary name and rename) and markers still follow their data. What cannot
live on object storage (MLflow's sqlite database, PREFECT_HOME, Dask's scratch space, the
writer lock's ``flock``) lies in a local *state folder* (:func:`state_dir_for`). A local run
directory is its own state folder, exactly as before.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

if TYPE_CHECKING:  # torch, zarr and scipy load only where they are used: `wsseg status` reads none of them
    import scipy.sparse as sp
    import torch
    import zarr
    from wsseg.tasks.store.checkpoints import StateFile

from wsseg.tasks.store import chunked, packs
from wsseg.tasks.store.damage import DamagedFileError
from wsseg.tasks.store.remote import entries, is_local, is_remote_url, local_copy, remote_root, state_dir_for
from wsseg.tasks.store.stream import corpus_line

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

#: Zarr groups of a remote run directory this process has opened (created if missing) already
_GROUPS_SEEN: set[str] = set()

MANIFEST_SCHEMA = pa.schema(
    [
        ("image_id", pa.string()),
        ("height", pa.int32()),
        ("width", pa.int32()),
        ("tags", pa.list_(pa.string())),
        ("sha256", pa.string()),
        ("split", pa.string()),
        ("source", pa.string()),
        ("has_mask", pa.bool_()),
    ]
)


@dataclass(frozen=True)
class ClassSpec:
    """Class names of a corpus; ``background`` is the index of an implicit background class."""

    names: tuple[str, ...]
    background: int | None = None

    @property
    def n(self) -> int:
        return len(self.names)

    def index(self, name: str) -> int:
        return self.names.index(name)

    def tag_vector(self, tags: Iterable[str]) -> np.ndarray:
        """(K,) bool: the image's tags, plus the implicit background class if there is one."""
        v = np.zeros(self.n, bool)
        for t in tags:
            v[self.names.index(t)] = True
        if self.background is not None:
            v[self.background] = True
        return v


@dataclass(frozen=True)
class ImageRecord:
    image_id: str
    height: int
    width: int
    tags: tuple[str, ...]
    sha256: str
    split: str
    source: str
    has_mask: bool


def valid_id(image_id: str) -> bool:
    return bool(_ID_RE.match(image_id)) and not image_id.startswith("__")


def params_key(params: dict[str, Any]) -> str:
    """A short stable hash of a parameter dict (sorted JSON)."""
    blob = json.dumps(params, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def _atomic_write_text(path: Path, text: str) -> None:
    if not is_local(path):  # an object is put whole or not at all
        path.write_text(text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


#: round 0's corpus clusters of the foreground path (:meth:`Store.write_foreground_clusters`)
CLUSTERS = "foreground_clusters.json"


def _write_json(path: Path, data: dict, indent: int | None = 1) -> Path:
    """A JSON state file, written atomically (numpy scalars as floats)."""
    _atomic_write_text(path, json.dumps(data, indent=indent, default=float))
    return path


def _read_json(path: Path) -> dict | None:
    """A JSON state file, or None when there is none; a damaged one is a :class:`DamagedFileError`."""
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DamagedFileError(path, f"not readable JSON ({e})") from None


class Store:
    """Read and write everything of one run directory. Cheap to construct; picklable.

    ``root``: a local path, or an fsspec URL (``s3://bucket/run``; ``file://`` is local). A URL
    whose scheme has no installed filesystem package is refused here (:class:`RemoteStoreError`,
    naming the package)."""

    def __init__(self, root: str | os.PathLike):
        if is_remote_url(root):
            self.root = root if hasattr(root, "fs") else remote_root(str(root))
            self.remote = True
        else:
            from wsseg.tasks.store.remote import local_path

            self.root = local_path(root).resolve()
            self.remote = False
        self._batch: dict | None = None  # pack group -> PackWriter, inside :meth:`packing`
        self._batch_shard = ""
        self._checked: set[str] = set()  # pack groups whose generation this instance compared
        self._legacy: dict[str, bool] = {}  # per-image (older layout) groups: whether they exist

    def __getstate__(self) -> dict:
        return {"root": self.root, "remote": self.remote}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._batch, self._batch_shard, self._checked, self._legacy = None, "", set(), {}

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    @property
    def state_dir(self) -> Path:
        """The local folder of what cannot live on object storage (PREFECT_HOME, MLflow's
        database, Dask's scratch space, the writer lock): the run directory itself when it is
        local, see :func:`tasks.store.remote.state_dir_for` for a URL."""
        return self.root if not self.remote else state_dir_for(str(self.root))

    def check_reachable(self) -> None:
        """Nothing for a local run directory; for a URL one request that its store answers
        (:class:`RemoteStoreError` naming the URL and the problem when it does not)."""
        if self.remote:
            from wsseg.tasks.store.remote import probe

            probe(self.root)

    def exists(self) -> bool:
        """Whether the run directory holds anything yet."""
        if not self.remote:
            return self.root.exists()
        from wsseg.tasks.store.remote import listdir

        return bool(listdir(self.root))

    def local_file(self, path):
        """A context manager giving a local file with ``path``'s content (``path`` itself when
        local): for MLflow's artifacts."""
        return local_copy(path)

    # ------------------------------------------------------------------ arrays
    def _zarr(self, path: Path) -> Any:
        """What ``zarr.open_*`` takes for ``path``: its name locally, an fsspec store remotely."""
        if not self.remote:
            return str(path)
        from zarr.storage import FsspecStore

        return FsspecStore.from_url(str(path), storage_options=dict(path.storage_options))

    def _group(self, path: Path, mode: str = "a") -> "zarr.Group":
        import zarr

        if not self.remote:
            path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return zarr.open_group(self._zarr(path), mode=mode)
        except zarr.errors.ContainsGroupError:
            # another worker created the group between our check and our create: open theirs
            return zarr.open_group(self._zarr(path), mode="r+")

    def _ensure_group(self, path: Path) -> None:
        """Create the Zarr group ``path`` unless it is there. Opening a group costs about 3 ms of
        CPU in zarr 3 (half of writing a small array), so locally a file check decides, and for
        a URL each group is opened once per process (:data:`_GROUPS_SEEN`)."""
        if not self.remote:
            if not (path / "zarr.json").is_file():
                self._group(path)
            return
        if str(path) not in _GROUPS_SEEN:
            self._group(path)
            _GROUPS_SEEN.add(str(path))

    def _write_array(self, group: Path, name: str, arr: np.ndarray, attrs: dict | None = None,
                     marked: bool = True) -> None:
        """Write ``arr`` as the array ``group/name`` (one chunk). ``marked``: the attribute
        ``complete`` is written after the data, so that an array cut short reads as missing;
        ``marked=False`` for the parts of a bundle whose own marker is written after them
        (:meth:`put_cached`), which saves a second metadata write per part."""
        self._ensure_group(group)
        if not self.remote and chunked.writable(arr):  # the same files as zarr's, without its machinery
            chunked.write(group / name, arr, {**(attrs or {}), "complete": True} if marked else attrs)
            return
        import zarr

        a = zarr.create_array(self._zarr(group / name), shape=arr.shape, dtype=arr.dtype, chunks=arr.shape,
                              overwrite=True, fill_value=0, attributes=None if marked else attrs)
        a[...] = arr
        if marked:  # the attribute is written after the data: an array without it is incomplete
            a.attrs.update({**(attrs or {}), "complete": True})

    def _read_array(self, group: Path, name: str) -> np.ndarray | None:
        """The array's data, or None when it is missing or was not completely written."""
        if not self.remote:  # one metadata read, then the chunk (tasks.store.chunked)
            meta = chunked.metadata(group / name)
            if meta is None or not meta.get("attributes", {}).get("complete", False):
                return None
            arr = chunked.read(group / name, meta)
            return arr if arr is not None else self._zarr_read(group / name)
        if not self._has_array(group, name):
            return None
        return self._zarr_read(group / name)

    def _zarr_read(self, path: Path) -> np.ndarray:
        """The data of the Zarr array at ``path`` read by zarr (on object storage, or a codec
        :mod:`tasks.store.chunked` leaves to it); :class:`DamagedFileError` when it does not decode."""
        import zarr

        try:
            return zarr.open_array(self._zarr(path), mode="r")[...]
        except (RuntimeError, ValueError) as e:
            raise DamagedFileError(path, f"damaged: does not decode ({str(e).strip() or type(e).__name__})") \
                from None

    def _has_array(self, group: Path, name: str) -> bool:
        meta = group / name / "zarr.json"
        if not self.remote and not meta.exists():
            return False
        try:  # remotely one request: the read tells whether it exists
            return bool(json.loads(meta.read_text()).get("attributes", {}).get("complete", False))
        except (OSError, ValueError):
            return False

    # ------------------------------------------------------------------ packed per-image arrays
    @contextlib.contextmanager
    def packing(self, shard: str) -> Iterator[None]:
        """Write the per-image arrays of a shard (preliminary results, labels, feature-cache
        entries) as one pack per group (:mod:`tasks.store.packs`) when the block ends without an
        error; an error discards them (the shard is computed again). Reads inside the block see
        what it wrote. Nested blocks join the outer one."""
        if self._batch is not None:
            yield
            return
        self._batch, self._batch_shard = {}, shard
        try:
            yield
            for w in self._batch.values():
                w.flush()
        finally:
            self._batch, self._batch_shard = None, ""

    def _pack_index(self, group: Path) -> packs.GroupIndex:
        key = str(group)
        check = key not in self._checked  # once per Store instance (a task): a worker sees drops
        self._checked.add(key)
        return packs.index_of(group, check)

    def _put_packed(self, group: Path, name: str, arr: np.ndarray, attrs: dict | None = None,
                    staging: Path | None = None) -> None:
        """``arr`` as entry ``name`` of pack group ``group``: into the open :meth:`packing` block's
        pack, or else a pack of its own. ``staging``: the pack's index waits there until
        :func:`tasks.store.packs.publish` (reads do not see it before)."""
        if self._batch is not None:
            key = str(group if staging is None else staging)
            w = self._batch.get(key)
            if w is None:
                w = self._batch[key] = packs.PackWriter(group, self._batch_shard, staging)
            w.put(name, arr, attrs)
            return
        w = packs.PackWriter(group, name, staging)
        w.put(name, arr, attrs)
        w.flush()

    def _has_legacy(self, legacy: Path) -> bool:
        """Whether the per-image group ``legacy`` of an older run directory exists (asked once)."""
        key = str(legacy)
        if key not in self._legacy:
            self._legacy[key] = (legacy / "zarr.json").exists()
        return self._legacy[key]

    def _get_packed(self, group: Path, legacy: Path, name: str, probe: bool = False,
                    expected: bool = False) -> tuple | None:
        """``(array, attributes)`` of entry ``name``: from the open block, the group's packs, or
        the per-image array of an older run directory (``legacy``); None when none holds it.
        ``probe``: attributes only, no data read (the array is returned as None), and what this
        instance's first look at the group did not see counts as missing (a corpus's worth of
        misses lists nothing; a Store is made per task) unless ``expected``: the caller reads it
        next, so a miss lists the group again for packs written since (another process's)."""
        if self._batch is not None and str(group) in self._batch:
            got = self._batch[str(group)].get(name)
            if got is not None:
                return got
        ix = self._pack_index(group)
        if probe:  # this task's first look listed the group: a miss is not looked up again
            attrs = ix.attrs(name, look_again=expected)
            if attrs is not None:
                return None, attrs
        else:
            got = ix.read(name)
            if got is not None:
                return got
        if not self._has_legacy(legacy):
            return None
        attrs = self._legacy_attrs(legacy, name)
        if attrs is None:
            return None
        if probe:
            return None, attrs
        arr = self._read_array(legacy, name)
        return None if arr is None else (arr, attrs)

    def _legacy_attrs(self, group: Path, name: str) -> dict | None:
        """The attributes of a complete per-image array, or None."""
        try:
            attrs = json.loads((group / name / "zarr.json").read_text()).get("attributes", {})
        except (OSError, ValueError):
            return None
        return attrs if attrs.get("complete", False) else None

    # ------------------------------------------------------------------ corpus
    @property
    def corpus_dir(self) -> Path:
        return self.root / "corpus"

    def write_corpus(self, records: Iterable[ImageRecord], classes: ClassSpec) -> None:
        """The manifest and the class list. The manifest's footer also records the counts and
        the content hash of each split (:meth:`corpus_summary`): `wsseg status` reads those
        without reading the manifest's rows. ``records`` are read once, a row group at a time."""
        writer = self.manifest_writer()
        try:
            writer.add(records)
            writer.close()
        except BaseException:
            writer.abort()
            raise
        self.publish_manifest(classes)

    @property
    def _staged_manifest(self) -> Path:
        return self.corpus_dir / self.STAGING / "manifest.parquet"

    def manifest_writer(self):
        """A :class:`tasks.store.stream.ManifestWriter` of a new manifest, written into the staging
        area (a refused or stopped ingest's goes with :meth:`drop_staged`) until
        :meth:`publish_manifest` puts it in place."""
        from wsseg.tasks.store.stream import ManifestWriter

        return ManifestWriter(self._staged_manifest, MANIFEST_SCHEMA, self.ROW_GROUP)

    def publish_manifest(self, classes: ClassSpec) -> None:
        """Put the manifest :meth:`manifest_writer` wrote in place (a rename locally), with the
        class list, and count the corpus's files (:meth:`record_corpus_usage`)."""
        from wsseg.tasks.store.remote import replace, rmtree

        replace(self._staged_manifest, self.corpus_dir / "manifest.parquet")
        rmtree(self.corpus_dir / self.STAGING)
        _atomic_write_text(self.corpus_dir / "classes.json",
                           json.dumps({"names": list(classes.names), "background": classes.background}, indent=1))
        self.record_corpus_usage()

    def manifest_keys(self, staged: bool = False) -> pa.Table:
        """The columns of the manifest that say what an image is (image_id, sha256, tags, split),
        of the manifest in place or (``staged``) of the one :meth:`manifest_writer` wrote: what an
        ingest compares (:func:`tasks.corpus.ingest.corpus_changes`), about 130 bytes an image."""
        path = self._staged_manifest if staged else self.corpus_dir / "manifest.parquet"
        return self._read_parquet(path, columns=["image_id", "sha256", "tags", "split"])

    def write_ingest_report(self, report: dict) -> Path:
        """``corpus/ingest_report.json``: what an ingest listed, ingested and rejected (and why)."""
        path = self.corpus_dir / "ingest_report.json"
        _write_json(path, report)
        self.record_corpus_usage()  # written after the manifest's count: `wsseg status` counts it too
        return path

    def drop_images(self, image_ids: Iterable[str]) -> None:
        """Remove the images and masks of ``image_ids`` (images no longer in the source): their
        entries from the corpus's packs, and an older run directory's per-image arrays."""
        image_ids = [i for i in image_ids if valid_id(i)]
        if not image_ids:
            return
        for kind in ("images", "masks"):
            if (self._corpus_group(kind) / packs.INDEX_FILE).exists():
                packs.drop(self._corpus_group(kind), image_ids)
            self._drop_legacy(kind, image_ids)

    def _drop_legacy(self, kind: str, image_ids: list[str]) -> None:
        """Remove the per-image arrays ``kind`` of ``image_ids`` of an older run directory's
        corpus, and its per-image folder once it is empty."""
        from wsseg.tasks.store.remote import listdir, rmtree

        group = self._corpus_legacy(kind)
        if not image_ids or not (group / "zarr.json").exists():
            return
        for iid in image_ids:
            rmtree(group / iid)
        if not any(n != "zarr.json" for n in listdir(group)):
            rmtree(group)
        self._legacy.pop(str(group), None)

    def corpus_summary(self) -> dict | None:
        """``{"images": n, "splits": {split: {"images": k, "hash": corpus_hash}}}`` from the
        manifest's footer (no row read), or None for a manifest written before it was recorded."""
        path = self.corpus_dir / "manifest.parquet"
        try:
            # the file's key-value metadata: where a streamed writer's footer puts it
            # (tasks.store.stream.ManifestWriter), and where a table's schema metadata also went
            if is_local(path):
                meta = pq.read_metadata(path)
            else:
                with path.fs.open(path.path, "rb") as f:
                    meta = pq.read_metadata(f)
            raw = (meta.metadata or {}).get(b"wsseg")
            return json.loads(raw) if raw else None
        except FileNotFoundError:
            raise
        except (pa.ArrowException, OSError, ValueError) as e:
            raise DamagedFileError(path, f"damaged: its footer does not read ({str(e).strip()[:200]})") from None

    def has_corpus(self) -> bool:
        return (self.corpus_dir / "manifest.parquet").exists()

    def classes(self) -> ClassSpec:
        path = self.corpus_dir / "classes.json"
        try:
            d = json.loads(path.read_text())
            return ClassSpec(tuple(d["names"]), d["background"])
        except (ValueError, KeyError, TypeError) as e:
            raise DamagedFileError(path, f"damaged: not the class list's JSON ({type(e).__name__}: {e})") from None

    def manifest(self, split: str | None = None) -> list[ImageRecord]:
        path = self.corpus_dir / "manifest.parquet"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no corpus here; run `wsseg ingest` first")
        rows = self._read_parquet(path).to_pylist()
        recs = [ImageRecord(**(r | {"tags": tuple(r["tags"])})) for r in rows]
        if split is not None:
            recs = [r for r in recs if r.split == split]
        return recs

    #: where an ingest's corpus packs wait (their indexes) until the ingest is accepted
    STAGING = "staging"
    #: raw bytes of images a shard holds before it writes them as a pack (:meth:`flush_packed`)
    CORPUS_PACK_BYTES = 256 << 20

    def _corpus_group(self, kind: str) -> Path:
        """The pack group of the corpus's ``images`` or ``masks``."""
        return self.corpus_dir / kind

    def _corpus_legacy(self, kind: str) -> Path:
        """An older run directory's per-image arrays of ``kind`` (``images.zarr``, ``masks.zarr``)."""
        return self.corpus_dir / f"{kind}.zarr"

    def _corpus_staging(self, kind: str) -> Path:
        return self.corpus_dir / self.STAGING / kind

    def _corpus_entry(self, kind: str, image_id: str, data: bool = False) -> tuple | None:
        """``(array or None, attributes)`` of a stored image or mask (``data``: the array is read),
        from the corpus's packs (the newest holding it) or an older run directory's per-image
        arrays; None when neither holds it. A miss lists nothing again: the corpus changes only
        when an ingest publishes its packs, and this instance's first look (a task's) saw them."""
        group, legacy = self._corpus_group(kind), self._corpus_legacy(kind)
        if self._batch is not None and str(group) in self._batch:
            got = self._batch[str(group)].get(image_id)
            if got is not None:
                return got if data else (None, got[1])
        ix = self._pack_index(group)
        e = ix.lookup(image_id, look_again=False)
        if e is not None:
            if not data:
                return None, dict(e[5])
            got = ix.read(image_id)
            if got is not None:
                return got
        if not self._has_legacy(legacy):
            return None
        attrs = self._legacy_attrs(legacy, image_id)
        if attrs is None or not data:
            return None if attrs is None else (None, attrs)
        arr = self._read_array(legacy, image_id)
        return None if arr is None else (arr, attrs)

    def has_stored_image(self, image_id: str) -> bool:
        """Whether an image of ``image_id`` is stored, whatever its content."""
        return self._corpus_entry("images", image_id) is not None

    def put_image(self, image_id: str, image: np.ndarray, sha256: str, staged: bool = False) -> None:
        """Store an image (into the open :meth:`packing` block's pack of the corpus's images);
        ``staged``: its pack's index waits in the staging area until :meth:`commit_staged`, so
        that a refused ingest leaves the stored corpus as it was (:meth:`drop_staged`)."""
        self._put_corpus("images", image_id, image, {"sha256": sha256}, staged)

    def _put_corpus(self, kind: str, image_id: str, arr: np.ndarray, attrs: dict | None, staged: bool) -> None:
        self._put_packed(self._corpus_group(kind), image_id, arr, attrs,
                         staging=self._corpus_staging(kind) if staged else None)

    def commit_staged(self, image_ids: Iterable[str] = ()) -> None:
        """Publish the staged packs of images and masks: written after every stored one, they win
        over the stored images and masks they replace. ``image_ids``: the ids whose stored image or
        mask is replaced; a replaced image's old mask goes with it, even when the new one has none,
        and an older run directory's per-image arrays of them are removed."""
        image_ids = [i for i in image_ids if valid_id(i)]
        if image_ids:
            new_images = packs.staged_names(self._corpus_staging("images"))
            new_masks = packs.staged_names(self._corpus_staging("masks"))
            unmasked = [i for i in image_ids if i in new_images and i not in new_masks]
            if unmasked and (self._corpus_group("masks") / packs.INDEX_FILE).exists():
                packs.drop(self._corpus_group("masks"), unmasked)
            self._drop_legacy("images", [i for i in image_ids if i in new_images])
            self._drop_legacy("masks", [i for i in image_ids if i in new_images or i in new_masks])
        for kind in ("images", "masks"):
            packs.publish(self._corpus_group(kind), self._corpus_staging(kind))
        self._drop_staged_packs()  # the staged manifest waits for publish_manifest

    def _drop_staged_packs(self) -> None:
        """Remove the staged packs (what a refused or stopped ingest wrote) and a corpus group they
        alone made."""
        from wsseg.tasks.store.remote import listdir, rmtree

        for kind in ("images", "masks"):
            group = self._corpus_group(kind)
            packs.discard(group, self._corpus_staging(kind))
            if not any(n.endswith(".json") for n in listdir(group / "packs")):
                rmtree(group)
                packs.forget(group)
            rmtree(self._corpus_staging(kind))

    def drop_staged(self) -> None:
        """Remove the staging area: the staged packs and manifest (what a refused or stopped ingest
        wrote), and a corpus group or folder they alone made."""
        from wsseg.tasks.store.remote import rmtree

        self._drop_staged_packs()
        rmtree(self.corpus_dir / self.STAGING)
        if not self.remote and self.corpus_dir.is_dir() and not any(self.corpus_dir.iterdir()):
            self.corpus_dir.rmdir()

    def flush_packed(self, limit: int = 0) -> None:
        """Write the open :meth:`packing` block's packs now when they hold more than ``limit`` raw
        bytes, so that a shard of large images holds at most that much (its later arrays go to
        further packs)."""
        if self._batch is not None and sum(w.nbytes for w in self._batch.values()) > limit:
            for w in self._batch.values():
                w.flush()

    def image_shape(self, image_id: str) -> tuple[int, ...]:
        """Shape of a stored image, from its pack's index (no decoding)."""
        e = self._pack_index(self._corpus_group("images")).lookup(image_id, look_again=False)
        if e is not None:
            return tuple(e[4])
        meta = self._corpus_legacy("images") / image_id / "zarr.json"
        try:
            return tuple(json.loads(meta.read_text())["shape"])
        except (ValueError, KeyError, TypeError) as e:
            raise DamagedFileError(meta, f"damaged: not an array's metadata ({type(e).__name__}: {e})") from None

    def has_image(self, image_id: str, sha256: str) -> bool:
        got = self._corpus_entry("images", image_id)
        return got is not None and got[1].get("sha256") == sha256

    def image(self, image_id: str) -> np.ndarray:
        got = self._corpus_entry("images", image_id, data=True)
        if got is None:
            raise KeyError(f"image {image_id!r} is not in the corpus store {self.corpus_dir}")
        return got[0]

    def put_mask(self, image_id: str, mask: np.ndarray, sha256: str | None = None, staged: bool = False) -> None:
        """Store a ground-truth mask; ``sha256``: of the file it was read from (see :meth:`has_stored_mask`);
        ``staged``: as for :meth:`put_image`."""
        self._put_corpus("masks", image_id, mask, {"sha256": sha256} if sha256 else None, staged)

    def has_stored_mask(self, image_id: str, sha256: str) -> bool:
        """Whether the mask of ``image_id`` is stored, read from a file with this sha256 (an
        ingest again of an unchanged mask then decodes nothing)."""
        got = self._corpus_entry("masks", image_id)
        return got is not None and got[1].get("sha256") == sha256

    def mask(self, image_id: str) -> np.ndarray | None:
        """Ground-truth mask, for evaluation only (None when the corpus has none)."""
        got = self._corpus_entry("masks", image_id, data=True)
        return None if got is None else got[0]

    # ------------------------------------------------------------------ corrections
    # A person's corrected label maps (``wsseg ingest --corrections``): one array per image under
    # corpus/corrections.zarr, and corpus/corrections.json, the index the rounds read once (which
    # images are corrected, from which file, when): a round looks up no array of an image
    # without a correction.
    @property
    def corrections_path(self) -> Path:
        return self.corpus_dir / "corrections.json"

    def corrections(self) -> dict[str, dict]:
        """image id -> what its correction was read from (``file``, ``sha256``, ``at``,
        ``classes``); empty when the run has none."""
        return (_read_json(self.corrections_path) or {}).get("images", {})

    def put_correction(self, image_id: str, label: np.ndarray, info: dict) -> None:
        """Store ``label`` ((H, W) uint8 class indices, 255 = not labelled) as the corrected labels
        of ``image_id``; :meth:`write_corrections` records it in the index."""
        if label.dtype != np.uint8 or label.ndim != 2:
            raise ValueError(f"a correction must be (H, W) uint8, got {label.shape} {label.dtype}")
        self._write_array(self.corpus_dir / "corrections.zarr", image_id, label, info)

    def write_corrections(self, index: dict[str, dict]) -> None:
        """The corrections index (image id -> :meth:`corrections`' entry), written atomically."""
        _write_json(self.corrections_path, {"images": dict(sorted(index.items()))})
        self.record_corpus_usage()

    def correction(self, image_id: str) -> np.ndarray | None:
        """The corrected label map of ``image_id``, or None when no one corrected it."""
        return self._read_array(self.corpus_dir / "corrections.zarr", image_id)

    def drop_corrections(self, image_ids: Iterable[str]) -> list[str]:
        """Forget the corrections of ``image_ids`` (an image removed or changed: the correction
        was of other pixels); returns the ids that had one."""
        from wsseg.tasks.store.remote import rmtree

        index = self.corrections()
        gone = [i for i in image_ids if i in index]
        for iid in gone:
            index.pop(iid)
            if valid_id(iid):
                rmtree(self.corpus_dir / "corrections.zarr" / iid)
        if gone:
            self.write_corrections(index)
        return gone

    # ------------------------------------------------------------------ feature cache
    def cache_dir(self, stage: str, key: str) -> Path:
        return self.root / "cache" / f"{stage}-{key}"

    def has_cached(self, stage: str, key: str, sha: str) -> bool:
        base = self.cache_dir(stage, key)
        return self._get_packed(base, base, sha[:24], probe=True) is not None

    def put_cached(self, stage: str, key: str, sha: str, arrays: dict[str, np.ndarray]) -> None:
        """Write several arrays of one image, and last the marker entry naming them."""
        base = self.cache_dir(stage, key)
        with self.packing(f"{sha[:24]}"):  # inside a shard's block: its pack; alone: a pack of its own
            for name, arr in arrays.items():
                self._put_packed(base, f"{sha[:24]}.{name}", np.ascontiguousarray(arr))
            self._put_packed(base, sha[:24], np.zeros(1, np.uint8), {"parts": sorted(arrays)})

    def cached(self, stage: str, key: str, sha: str, parts: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The cached arrays of one image, all of them or only ``parts`` (the edge map alone is
        read every epoch by the segmenter's loader: the superpixel parts would double its cost).
        Parts next to each other in a pack are read in one request."""
        base = self.cache_dir(stage, key)
        got = self._get_packed(base, base, sha[:24], probe=True, expected=True)
        if got is None:
            raise KeyError(f"no cached {stage} output for image sha {sha[:12]} under {base}")
        have = got[1]["parts"]
        missing = [p for p in (parts or ()) if p not in have]
        if missing:
            raise KeyError(f"cached {stage} output of {sha[:12]} has no part {', '.join(missing)} under {base}")
        names = list(have if parts is None else parts)
        keys = [f"{sha[:24]}.{n}" for n in names]
        found = {}
        if self._batch is not None and str(base) in self._batch:  # written by this block
            found = {k: v for k in keys if (v := self._batch[str(base)].get(k)) is not None}
        if len(found) < len(keys):
            found |= self._pack_index(base).read_many([k for k in keys if k not in found])
        out = {}
        for name, k in zip(names, keys):
            if k in found:
                out[name] = found[k][0]
                continue
            meta = None if self.remote else chunked.metadata(base / k)
            arr = chunked.read(base / k, meta) if meta is not None else None
            if arr is not None:
                out[name] = arr
                continue
            import zarr

            try:  # an older run directory's per-image part: the marker, written after every part, vouches for it
                out[name] = zarr.open_array(self._zarr(base / k), mode="r")[...]
            except (FileNotFoundError, KeyError, zarr.errors.BaseZarrError) as e:
                raise KeyError(f"cached {stage} part {name!r} of {sha[:12]} is unreadable under {base}: {e}") from e
        return out

    # ------------------------------------------------------------------ checkpoints
    #: checkpoint kinds and where they live: per run (r is None) or per round
    #: the configuration's file name (the run directory's, and its copy in each MLflow run)
    CONFIG_FILE = "config.json"
    CHECKPOINTS = {"classifier": "classifier.pt", "segmenter": "model.pt", "mil": "mil.pt",
                   "proposal_classifier": "proposal_classifier.pt", "supervised": "supervised/model.pt"}

    def checkpoint_path(self, kind: str, r: int | None = None, *, name: str | None = None) -> Path:
        """Where checkpoint ``kind`` lives: the image classifier and the supervised reference per run,
        the segmenter and the corpus classifiers per round; ``kind="extra"`` with a ``name`` for a
        benchmark's further models (``models/<name>.pt``)."""
        if kind == "extra":
            if not name or not valid_id(name):
                raise ValueError(f"an extra checkpoint needs a plain name, got {name!r}")
            return self.root / "models" / f"{name}.pt"
        if kind not in self.CHECKPOINTS:
            raise ValueError(f"unknown checkpoint kind {kind!r}; one of: {', '.join(self.CHECKPOINTS)}, extra")
        if kind in ("segmenter", "mil", "proposal_classifier"):
            if r is None:
                raise ValueError(f"checkpoint {kind!r} belongs to a round: pass r")
            return self.round_dir(r) / self.CHECKPOINTS[kind]
        return self.root / self.CHECKPOINTS[kind]

    def has_checkpoint(self, kind: str, r: int | None = None, *, name: str | None = None) -> bool:
        return self.checkpoint_path(kind, r, name=name).is_file()

    def usable_checkpoint(self, kind: str, r: int | None = None, *, name: str | None = None) -> dict | None:
        """Checkpoint ``kind``'s plain content when it exists and reads back, else None. A damaged
        one (cut short, say) is named on the terminal and moved aside (``*.damaged``), so that its
        maker recomputes it."""
        from wsseg.tasks.store.checkpoints import CheckpointError, read_file

        path = self.checkpoint_path(kind, r, name=name)
        if not path.is_file():
            return None
        try:
            return read_file(path)
        except CheckpointError as e:
            from wsseg.tasks.store.remote import replace

            replace(path, path.with_name(path.name + ".damaged"))
            what = f"{e.path}: {e.problem}" if isinstance(e, DamagedFileError) else e
            print(f"  [store] {what}; moved aside to {path.name}.damaged and computed again", file=sys.stderr,
                  flush=True)
            return None

    def write_model(self, kind: str, model: torch.nn.Module, r: int | None = None, *, name: str | None = None,
                    **spec) -> Path:
        """Save a network (see :func:`tasks.store.checkpoints.save_model` for ``spec``)."""
        from wsseg.tasks.store.checkpoints import save_model
        return save_model(self.checkpoint_path(kind, r, name=name), model, **spec)

    def read_model(self, kind: str, r: int | None = None, *, name: str | None = None,
                   device: str | torch.device = "cpu") -> tuple[torch.nn.Module, dict]:
        from wsseg.tasks.store.checkpoints import load_model
        return load_model(self.checkpoint_path(kind, r, name=name), device)

    def model_meta(self, kind: str, r: int | None = None, *, name: str | None = None) -> dict:
        """The ``meta`` dict a network was saved with."""
        from wsseg.tasks.store.checkpoints import read_file
        return read_file(self.checkpoint_path(kind, r, name=name)).get("meta", {})

    def write_classifier(self, kind: str, r: int, model, **extra) -> Path:
        """A round's corpus classifier (``mil`` or ``proposal_classifier``) and plain data."""
        from wsseg.tasks.store.checkpoints import save_classifier
        return save_classifier(self.checkpoint_path(kind, r), model, **extra)

    def read_classifier(self, kind: str, r: int) -> dict:
        from wsseg.tasks.store.checkpoints import load_classifier
        return load_classifier(self.checkpoint_path(kind, r))

    def train_state(self, kind: str, r: int | None = None, *, name: str | None = None) -> StateFile:
        """The resumable training state of checkpoint ``kind`` (beside it, ``*.train_state.pt``)."""
        from wsseg.tasks.store.checkpoints import StateFile

        path = self.checkpoint_path(kind, r, name=name)
        return StateFile(path.with_name(f"{path.stem}.train_state.pt"))

    # ------------------------------------------------------------------ run-level state files
    @property
    def config_path(self) -> Path:
        return self.root / self.CONFIG_FILE

    def read_config(self) -> dict | None:
        """The configuration the run directory was started with (None before the first run)."""
        return _read_json(self.config_path)

    def write_config(self, config: dict) -> None:
        _write_json(self.config_path, config)

    @property
    def summary_path(self) -> Path:
        return self.root / "summary.json"

    #: the summary's paths of files in the run directory: recorded relative to it, so that a run
    #: directory moved or copied elsewhere names its own files (read back under where it is now)
    SUMMARY_PATHS = ("final_model",)

    def relative(self, path: str | os.PathLike) -> str:
        """``path`` relative to the run directory when it lies inside it (as a record keeps it),
        else as it is (a file outside the run: a user's input)."""
        text, root = str(path), str(self.root).rstrip("/")
        return text[len(root) + 1:] if text.startswith(root + "/") else text

    def located(self, recorded: str) -> str:
        """A path a record of this run directory holds, where it is now: a relative one under the
        run directory; an absolute one of an older wsseg's record that names a round's file
        (``.../rounds/rNNN/model.pt``) under this run directory when the run was moved, else as it is."""
        if "://" not in recorded and not os.path.isabs(recorded):
            return str(self.root / recorded)
        parts = recorded.split("/")
        if "rounds" in parts and not recorded.startswith(str(self.root).rstrip("/") + "/"):
            moved = self.root.joinpath(*parts[len(parts) - 1 - parts[::-1].index("rounds"):])
            if moved.exists():
                return str(moved)
        return recorded

    def write_summary(self, summary: dict) -> Path:
        """The run's summary (summary.json), its paths in the run directory recorded relative to it
        and without the run directory's own (:data:`SUMMARY_PATHS`, :meth:`read_summary`)."""
        record = {k: v for k, v in summary.items() if k != "run_dir"}
        for k in self.SUMMARY_PATHS:
            if isinstance(record.get(k), str):
                record[k] = self.relative(record[k])
        return _write_json(self.summary_path, record)

    def read_summary(self) -> dict | None:
        """The run's summary with ``run_dir`` (where the run directory is now) and its paths under it."""
        summary = _read_json(self.summary_path)
        if summary is None:
            return None
        out = summary | {"run_dir": str(self.root)}
        for k in self.SUMMARY_PATHS:
            if isinstance(out.get(k), str):
                out[k] = self.located(out[k])
        return out

    def write_last_error(self, command: str, message: str) -> None:
        """Record the error that ended ``command`` (``wsseg status`` shows it)."""
        import datetime as dt

        _write_json(self.root / "last_error.json", 
            {"command": command, "error": message,
             "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")})

    def last_error(self) -> dict | None:
        return _read_json(self.root / "last_error.json")

    def size_bytes(self) -> int:
        """Bytes on disk of the run directory (links not followed), or of its objects: walks
        every file (see :meth:`usage` for what `wsseg status` reads instead)."""
        from wsseg.tasks.store.remote import du

        return du(self.root)

    def record_corpus_usage(self) -> dict:
        """Count the corpus folder's files and bytes (one walk, done by the commands that write
        it: ingest, corrections) into ``corpus/usage.json``, which :meth:`usage` reads."""
        files = size = 0
        stack = [self.corpus_dir]
        while stack:
            folder = stack.pop()
            for name, is_dir, n in entries(folder):
                if name == "usage.json" and folder == self.corpus_dir:
                    continue
                if is_dir:
                    stack.append(folder / name)
                else:
                    files, size = files + 1, size + n
        rec = {"files": files, "bytes": size}
        _write_json(self.corpus_dir / "usage.json", rec)
        return rec

    def usage(self) -> dict[str, dict]:
        """Files and bytes of the run directory by part (``corpus``, ``cache``, ``rounds``,
        ``other``), without walking per-image files: the corpus's as recorded when it was written
        (:meth:`record_corpus_usage`), the packs' from one listing of each group, the rounds'
        markers and tables from one listing of each folder. What grows with the images is
        listed per shard, so the cost grows with shards, not images. An older run directory's
        per-image folders (``*.zarr``) are walked, and so is a corpus without a record."""
        out = {k: {"files": 0, "bytes": 0} for k in ("corpus", "cache", "rounds", "other")}

        def add(part: str, files: int, size: int) -> None:
            out[part]["files"] += files
            out[part]["bytes"] += size

        def walk(part: str, folder: Path) -> None:
            for name, is_dir, n in entries(folder):
                if not is_dir:
                    add(part, 1, n)
                elif (folder / name / packs.INDEX_FILE).exists():
                    add(part, *packs.usage(folder / name))
                else:
                    walk(part, folder / name)

        rec = _read_json(self.corpus_dir / "usage.json")
        if rec:
            add("corpus", rec["files"] + 1, rec["bytes"])
        else:
            walk("corpus", self.corpus_dir)
        for name, is_dir, n in entries(self.root):
            if not is_dir:
                add("other", 1, n)
            elif name in ("cache", "rounds"):
                walk(name, self.root / name)
            elif name.startswith("ablate-"):
                for part, v in Store(self.root / name).usage().items():
                    add(part, v["files"], v["bytes"])
            elif name != "corpus":
                walk("other", self.root / name)
        return out

    def lock(self, command: str, reentrant: bool = False):
        """The run directory's writer lock (:class:`tasks.store.lock.RunLock`), for ``with``: the
        ``flock`` of the state folder, and for a URL a lock object in the run directory too."""
        from wsseg.tasks.store.lock import RunLock
        return RunLock(self.state_dir, command, remote=self.root if self.remote else None, reentrant=reentrant)

    def round_summary_path(self, r: int) -> Path:
        """Round ``r``'s summary (``round.json``): written when the round is finished."""
        return self.round_dir(r) / "round.json"

    def finished_rounds(self) -> list[int]:
        """Indices of the rounds whose summary is written (a round in progress is not among them)."""
        return [r for r in self.rounds() if self.round_summary_path(r).exists()]

    def rounds(self) -> list[int]:
        """Indices of the rounds that have a folder (finished or not), ascending."""
        if not self.remote:
            return sorted(int(p.name[1:]) for p in (self.root / "rounds").glob("r[0-9][0-9][0-9]"))
        from wsseg.tasks.store.remote import listdir

        return sorted(int(n[1:]) for n in listdir(self.root / "rounds") if re.fullmatch(r"r[0-9]{3}", n))

    def write_json(self, name: str, data: dict) -> Path:
        """A named JSON report in the run directory (``<name>.json``), written atomically."""
        return _write_json(self.root / f"{name}.json", data)

    def read_json(self, name: str) -> dict | None:
        """A named JSON report of the run directory (``<name>.json``), or None when there is none."""
        return _read_json(self.root / f"{name}.json")

    def ablation(self, name: str) -> "Store":
        """The run directory of ablation variant ``name`` of this run (``RUN/ablate-<name>``)."""
        if not valid_id(name):
            raise ValueError(f"an ablation needs a plain name, got {name!r}")
        return Store(self.root / f"ablate-{name}")

    def share_round_from(self, other: "Store", r: int, arrays: Sequence[str] = ("prelim", "cam", "deep"),
                         stages: Sequence[str] = ("prelim", "foreground")) -> None:
        """Use ``other``'s round ``r`` arrays (symbolic links) and its finished-shard markers of
        ``stages`` (copies), e.g. an ablation reusing its main run's round-0 CAMs. A part already
        present is left as it is. On object storage (no links) the parts are copied."""
        src, dst = other.round_dir(r), self.round_dir(r)
        if self.remote or other.remote:
            self._copy_parts(other, [(src / f, dst / f) for n in arrays for f in (n, f"{n}.zarr")]
                             + [(src / "done" / m, dst / "done" / m) for stage in stages
                                for m in other.shard_markers(r, stage)]
                             + [(src / CLUSTERS, dst / CLUSTERS)])
            return
        (dst / "done").mkdir(parents=True, exist_ok=True)
        for name in arrays:
            for folder in (name, f"{name}.zarr"):  # packs, or an older run directory's per-image arrays
                s, d = src / folder, dst / folder
                if s.exists() and not (d.exists() or d.is_symlink()):
                    d.symlink_to(s.resolve(), target_is_directory=True)
        for stage in stages:
            for marker in (src / "done").glob(f"{stage}-*.json"):
                if not (dst / "done" / marker.name).exists():
                    shutil.copy(marker, dst / "done" / marker.name)
        if (src / CLUSTERS).exists() and not (dst / CLUSTERS).exists():  # what the "foreground" stage read
            shutil.copy(src / CLUSTERS, dst / CLUSTERS)

    def share_from(self, other: "Store", parts: Sequence[str] = ("corpus", "cache", "classifier")) -> None:
        """Use ``other``'s corpus, feature cache and image classifier (symbolic links), e.g. an
        ablation beside its main run. A part already present is left as it is. ``corpus_files``
        instead of ``corpus``: the corpus's images, masks and manifest, but corrections of its own
        (local run directories only)."""
        names = {"corpus": "corpus", "corpus_files": "corpus", "cache": "cache",
                 "classifier": self.CHECKPOINTS["classifier"]}
        if self.remote or other.remote:
            self._copy_parts(other, [(other.root / names[p], self.root / names[p]) for p in parts])
            return
        self.root.mkdir(parents=True, exist_ok=True)
        if "corpus_files" in parts:  # the corpus's files linked one by one: the corrections stay this run's own
            (self.root / "corpus").mkdir(exist_ok=True)
            for src in (other.root / "corpus").iterdir():
                dst = self.root / "corpus" / src.name
                if not src.name.startswith("corrections") and not (dst.exists() or dst.is_symlink()):
                    dst.symlink_to(src, target_is_directory=src.is_dir())
        for part in (p for p in parts if p != "corpus_files"):
            src, dst = other.root / names[part], self.root / names[part]
            if src.exists() and not (dst.exists() or dst.is_symlink()):
                dst.symlink_to(src, target_is_directory=src.is_dir())

    def _copy_parts(self, other: "Store", pairs: list) -> None:
        """Copy ``(source, destination)`` parts on one object store, those not present yet."""
        from wsseg.tasks.store.remote import copytree

        if not (self.remote and other.remote and self.root.fs.protocol == other.root.fs.protocol):
            raise ValueError(f"{self.root}: sharing parts with {other.root} needs both run directories local "
                             "(symbolic links) or on the same object store (copies)")
        for src, dst in pairs:
            if src.exists() and not dst.exists():
                copytree(src, dst)

    def shard_markers(self, r: int, stage: str) -> list[str]:
        """File names of round ``r``'s finished-shard markers of ``stage`` (``<stage>-<shard>.json``)."""
        from wsseg.tasks.store.remote import listdir

        return sorted(n for n in listdir(self.round_dir(r) / "done") if n.startswith(f"{stage}-") and
                      n.endswith(".json"))

    # ------------------------------------------------------------------ the manifest, streamed
    #: rows of a Parquet row group: a streamed read (:meth:`manifest_batches`) holds one group's
    #: column chunks at a time (pyarrow's default, 2^20 rows, made the manifest of 10^6 images one
    #: group). With groups of 65536 rows a read of msrc21's manifest grew by 11 MB of Arrow buffers
    #: at 2 x 10^4 rows and 83 MB of memory at 10^6; with 4096 rows it stays near its 10^3 figure,
    #: while the footer that every reader parses grows by about 7 KB a group, 16 MB at 10^7 rows
    #: (docs/large-corpora.md#the-manifest-read)
    ROW_GROUP = 4096
    #: manifest rows a streamed read holds at a time (:meth:`manifest_batches`), as many as a row
    #: group: a batch spanning two groups would hold both groups' column chunks
    MANIFEST_BATCH = ROW_GROUP
    #: rows turned into Python records at a time (:meth:`manifest_records`): a batch's worth at once
    #: was about 1 KB a row of dicts and strings beside the batch
    RECORD_SLICE = 256

    def manifest_batches(self, split: str | None = None, columns: Sequence[str] | None = None,
                         batch_size: int | None = None) -> Iterator[pa.RecordBatch]:
        """The manifest's rows of ``split`` (every row with None) in its order, ``batch_size`` rows
        (:attr:`MANIFEST_BATCH`) at a time, with only ``columns`` (all by default): a reader of a
        whole split holds a batch, not the 630 bytes of :class:`ImageRecord` per image that
        :meth:`manifest` returns."""
        path = self.corpus_dir / "manifest.parquet"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no corpus here; run `wsseg ingest` first")
        import pyarrow.compute as pc

        read = None if columns is None else list(dict.fromkeys([*columns, *(["split"] if split is not None else [])]))
        with contextlib.ExitStack() as stack:
            try:
                source = str(path) if is_local(path) else stack.enter_context(path.fs.open(path.path, "rb"))
                # without pre-buffering and threads: pyarrow otherwise reads ahead, and its peak
                # grew with the file (measured: 35 MB at 10^6 rows, 54 MB at 2 x 10^6; 16 MB flat without)
                batches = pq.ParquetFile(source, page_checksum_verification=True, pre_buffer=False).iter_batches(
                    batch_size or self.MANIFEST_BATCH, columns=read, use_threads=False)
                for batch in batches:
                    if split is not None:
                        batch = batch.filter(pc.equal(batch.column("split"), split))
                    if batch.num_rows:
                        yield batch if columns is None else batch.select(list(columns))
            except (pa.ArrowException, OSError) as e:
                raise DamagedFileError(path, f"damaged: not a readable Parquet table ({str(e).strip()[:200]})") \
                    from None

    def manifest_records(self, split: str | None = None) -> Iterator[ImageRecord]:
        """:meth:`manifest`'s records, the same ones in the same order, read a batch at a time."""
        for batch in self.manifest_batches(split):
            for start in range(0, batch.num_rows, self.RECORD_SLICE):
                for r in batch.slice(start, self.RECORD_SLICE).to_pylist():
                    yield ImageRecord(**(r | {"tags": tuple(r["tags"])}))

    def split_rows(self, split: str | None = None):
        """The rows of ``split`` as a :class:`tasks.store.stream.ManifestRows`: iterated like
        :meth:`manifest`'s list, read again at each iteration instead of held."""
        from wsseg.tasks.store.stream import ManifestRows

        return ManifestRows(self, split)

    def manifest_shards(self, split: str, size_for, keep=None):
        """The shards of ``split``'s rows that ``keep`` accepts (every row without it), exactly as
        :func:`flows.wsss.shards_of` cuts the list :meth:`manifest` returns (``size_for(n)``: the shard
        size of n images, :func:`tasks.config.shard_size_for` with the stage's settings), made one
        shard at a time as they are iterated (:class:`tasks.store.stream.Shards`)."""
        from wsseg.tasks.store.stream import Shards

        return Shards(self.split_rows(split), size_for, keep)

    def split_images(self, split: str | None = None) -> int:
        """How many images ``split`` (the corpus with None) has: the manifest's footer's count
        (:meth:`corpus_summary`), or for a manifest written before it recorded one, its rows counted."""
        summary = self.corpus_summary()
        if summary is not None:
            return summary["images"] if split is None else summary["splits"].get(split, {}).get("images", 0)
        return sum(b.num_rows for b in self.manifest_batches(split, columns=["split"]))

    def split_entry(self, split: str | None = None) -> dict:
        """``{"hash": corpus_hash, "images": n}`` of ``split``'s rows (:func:`tasks.corpus.resume.corpus_entry`
        of :meth:`manifest`'s list): the footer's, or for an older manifest computed a batch at a time."""
        summary = self.corpus_summary()
        if split is not None and summary is not None:
            entry = summary["splits"].get(split)
            return {"hash": entry["hash"], "images": entry["images"]} if entry else \
                {"hash": corpus_hash([]), "images": 0}
        n = 0

        def counted() -> Iterator[ImageRecord]:
            nonlocal n
            for rec in self.manifest_records(split):
                n += 1
                yield rec

        digest = corpus_hash(counted())  # type: ignore[arg-type]  (iterated once)
        return {"hash": digest, "images": n}

    # ------------------------------------------------------------------ rounds
    def round_dir(self, r: int) -> Path:
        return self.root / "rounds" / f"r{r:03d}"

    def write_prelim(self, r: int, image_id: str, prob: np.ndarray, class_idx: np.ndarray) -> None:
        """Preliminary result of round r: (T, H, W) float probabilities of the classes ``class_idx``
        (the image's tags and background), stored quantised to uint8."""
        q = np.clip(np.rint(prob * 255.0), 0, 255).astype(np.uint8)
        self._put_packed(self.round_dir(r) / "prelim", image_id, q, {"classes": [int(c) for c in class_idx]})

    def prelim(self, r: int, image_id: str, n_classes: int) -> np.ndarray:
        """(K, H, W) float32 preliminary probabilities (zero for classes not stored)."""
        group = self.round_dir(r) / "prelim"
        got = self._get_packed(group, self.round_dir(r) / "prelim.zarr", image_id)
        if got is None:
            raise KeyError(f"no preliminary result of round {r} for {image_id!r} under {group}")
        q, attrs = got
        out = np.zeros((n_classes,) + q.shape[1:], np.float32)
        out[attrs["classes"]] = q.astype(np.float32) / 255.0
        return out

    def write_deep(self, image_id: str, feats: np.ndarray) -> None:
        """Round 0's (S, D) float32 superpixel features of ``image_id`` pooled from its CAM pass
        (:mod:`tasks.wsss.deep_features`), beside its preliminary result: they go with round 0."""
        self._put_packed(self.round_dir(0) / "deep", image_id, np.ascontiguousarray(feats, np.float32))

    def deep(self, image_id: str) -> np.ndarray | None:
        """Round 0's superpixel features of ``image_id`` (:meth:`write_deep`); None in a run without them
        (``features.deep_features`` none: round 0 wrote none of any image). A run that has them for
        other images and not this one is an error naming it, never features of another width."""
        group = self.round_dir(0) / "deep"
        got = self._get_packed(group, self.round_dir(0) / "deep.zarr", image_id)
        if got is not None:
            return got[0]
        if (self._batch is not None and str(group) in self._batch) or self._pack_index(group).exists():
            raise KeyError(f"{group}: round 0 has the superpixel features of other images but not of "
                           f"{image_id!r}; run `wsseg train` again to compute them")
        return None

    def write_foreground_clusters(self, clusters: dict) -> None:
        """Round 0's corpus clusters of the foreground path (:func:`tasks.wsss.pipeline.fit_round_clusters`),
        plain numbers in JSON: they go with round 0."""
        _write_json(self.round_dir(0) / CLUSTERS, clusters, indent=None)

    def foreground_clusters(self) -> dict | None:
        """Round 0's corpus clusters (:meth:`write_foreground_clusters`), or None before they are fitted."""
        return _read_json(self.round_dir(0) / CLUSTERS)

    def write_pseudo(self, r: int, image_id: str, label: np.ndarray, name: str = "pseudo") -> None:
        if label.dtype != np.uint8 or label.ndim != 2:
            raise ValueError(f"pseudo-label must be (H, W) uint8, got {label.shape} {label.dtype}")
        self._put_packed(self.round_dir(r) / name, image_id, label)

    def pseudo(self, r: int, image_id: str, name: str = "pseudo") -> np.ndarray | None:
        got = self._get_packed(self.round_dir(r) / name, self.round_dir(r) / f"{name}.zarr", image_id)
        return None if got is None else got[0]

    def has_pseudo(self, r: int, image_id: str, name: str = "pseudo") -> bool:
        """Whether round ``r`` holds a complete label map ``name`` of ``image_id`` (no data read)."""
        return self._get_packed(self.round_dir(r) / name, self.round_dir(r) / f"{name}.zarr", image_id,
                                probe=True) is not None

    def drop_labels(self, image_ids: Iterable[str]) -> None:
        """Remove the per-image round arrays (preliminary results, pseudo-labels, CAM labels) of
        ``image_ids`` from every round: an image removed from the corpus, or changed, has none.
        Arrays shared from another run directory (links) are left alone."""
        from wsseg.tasks.store.remote import listdir, rmtree

        ids = [i for i in image_ids if valid_id(i)]
        if not ids:
            return
        for r in self.rounds():
            for name in listdir(self.round_dir(r)):
                group = self.round_dir(r) / name
                if not self.remote and group.is_symlink():
                    continue
                if name.endswith(".zarr"):  # an older run directory's per-image arrays
                    for iid in ids:
                        rmtree(group / iid)
                elif (group / packs.INDEX_FILE).exists():
                    packs.drop(group, ids)

    def drop_rounds(self, first: int) -> list[int]:
        """Remove round ``first`` and every later one (arrays, markers, checkpoints, summaries)
        and the run's table of rounds; returns the indices removed. Links to another run's
        arrays are removed, not followed."""
        from wsseg.tasks.store.remote import rmtree

        gone = [r for r in self.rounds() if r >= first]
        for r in gone:
            rmtree(self.round_dir(r))
        if gone and self.summary_path.exists():
            self.summary_path.unlink()
        return gone

    def drop_round_model(self, r: int) -> list[int]:
        """Remove round ``r``'s segmentation model (and its training state) and summary, every
        later round and the run's table of rounds, keeping round ``r``'s preliminary results,
        corpus classifiers and pseudo-labels; returns the later rounds' indices removed."""
        for path in (self.checkpoint_path("segmenter", r), self.train_state("segmenter", r).path,
                     self.round_summary_path(r)):
            if path.exists():
                path.unlink()
        gone = self.drop_rounds(r + 1)
        if self.summary_path.exists():
            self.summary_path.unlink()
        return gone

    def write_round_inputs(self, r: int, inputs: dict) -> None:
        """What round ``r`` is computed from (class list, corpus hash, configuration), written
        when it starts: a later run reuses the round's results only when they match."""
        _write_json(self.round_dir(r) / "inputs.json", inputs)

    def round_inputs(self, r: int) -> dict | None:
        return _read_json(self.round_dir(r) / "inputs.json")

    @staticmethod
    def shard_name(ids: Sequence[str]) -> str:
        """The name of the shard of images ``ids`` (its first id, its size and a hash of all its
        ids): a marker counts for exactly these images, so a round resumed with another shard
        size computes its new shards instead of taking another shard's marker for theirs."""
        digest = hashlib.sha256("\n".join(ids).encode()).hexdigest()[:10]
        return f"{ids[0]}.{len(ids)}.{digest}"

    def shard_done(self, r: int, stage: str, shard: str) -> dict | None:
        """The result a finished shard recorded, or None (a damaged marker counts as not done)."""
        p = self.round_dir(r) / "done" / f"{stage}-{shard}.json"
        if not p.exists():
            return None
        try:
            return json.loads(p.read_text())
        except ValueError:
            print(f"  [store] {p}: damaged marker; shard {shard!r} of round {r} is computed again", file=sys.stderr,
                  flush=True)
            return None

    def mark_shard_done(self, r: int, stage: str, shard: str, info: dict) -> None:
        _write_json(self.round_dir(r) / "done" / f"{stage}-{shard}.json", info, indent=None)

    def write_review(self, r: int, shard: str, rows: list[dict]) -> None:
        """The review signals of one pseudo-label shard of round ``r`` (one row per image:
        ``image_id`` and :data:`tasks.labels.review.SIGNALS`), one Parquet file per shard."""
        self.write_table(self.round_dir(r) / "review" / f"{shard}.parquet", rows)

    def review_rows(self, r: int) -> list[dict]:
        """Every review row round ``r``'s shards recorded (empty for a round computed by a wsseg
        without the review queue)."""
        from wsseg.tasks.store.remote import listdir

        folder = self.round_dir(r) / "review"
        rows: list[dict] = []
        for name in sorted(listdir(folder)):
            if name.endswith(".parquet"):
                rows += self._read_parquet(folder / name).to_pylist()
        return rows

    def write_round(self, r: int, summary: dict) -> None:
        _write_json(self.round_summary_path(r), summary)

    def read_round(self, r: int, aside: bool = True) -> dict | None:
        """Round ``r``'s summary, or None when the round is not finished. A damaged summary is
        named on the terminal and moved aside: the round is then finished again (``aside=False``,
        for a reader that changes nothing: a :class:`DamagedFileError`)."""
        p = self.round_summary_path(r)
        if not p.exists():
            return None
        try:
            return json.loads(p.read_text())
        except ValueError as e:
            if not aside:
                raise DamagedFileError(p, f"not readable JSON ({e})") from None
            from wsseg.tasks.store.remote import replace

            replace(p, p.with_name(p.name + ".damaged"))
            print(f"  [store] {p}: damaged ({e}); moved aside, round {r} is finished again", file=sys.stderr,
                  flush=True)
            return None

    def write_table(self, path: Path, rows: list[dict]) -> None:
        self._put_parquet(pa.Table.from_pylist(rows), path)

    def read_table(self, path: Path) -> list[dict]:
        return self._read_parquet(path).to_pylist()

    def _put_parquet(self, table: pa.Table, path: Path) -> None:
        """A Parquet file: locally a temporary file renamed into place, remotely one put."""
        if not is_local(path):
            sink = pa.BufferOutputStream()
            pq.write_table(table, sink, write_page_checksum=True, row_group_size=self.ROW_GROUP)
            path.write_bytes(sink.getvalue().to_pybytes())
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(table, tmp, write_page_checksum=True, row_group_size=self.ROW_GROUP)
        os.replace(tmp, path)

    def _read_parquet(self, path: Path, columns: Sequence[str] | None = None) -> pa.Table:
        """A Parquet table (only ``columns``, when given); :class:`DamagedFileError` when it does not
        read (the pages' CRC-32 are checked where the file carries them: those this store writes do)."""
        try:
            if is_local(path):
                return pq.read_table(path, columns=columns, page_checksum_verification=True)
            return pq.read_table(pa.BufferReader(path.read_bytes()), columns=columns, page_checksum_verification=True)
        except FileNotFoundError:
            raise
        except (pa.ArrowException, OSError) as e:
            raise DamagedFileError(path, f"damaged: not a readable Parquet table ({str(e).strip()[:200]})") from None


def sparse_to_arrays(m: "sp.csr_matrix") -> dict[str, np.ndarray]:
    import scipy.sparse as sp

    m = sp.csr_matrix(m)
    return {"m_indptr": m.indptr.astype(np.int64), "m_indices": m.indices.astype(np.int32),
            "m_shape": np.asarray(m.shape, np.int64)}


def arrays_to_sparse(d: dict[str, np.ndarray]) -> "sp.csr_matrix":
    import scipy.sparse as sp

    indptr, indices, shape = d["m_indptr"], d["m_indices"], tuple(int(s) for s in d["m_shape"])
    data = np.ones(len(indices), bool)
    return sp.csr_matrix((data, indices, indptr), shape=shape)


def corpus_hash(records: Iterable[ImageRecord]) -> str:
    """A short hash of the corpus content ``records`` stand for: their ids, file sha256s, tags and
    splits, in order (the order the trainers see them in)."""
    h = hashlib.sha256()
    for r in records:
        h.update(corpus_line(r.image_id, r.sha256, r.tags, r.split))
    return h.hexdigest()[:16]


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def records_by_id(records: list[ImageRecord], ids: list[str]) -> list[ImageRecord]:
    index = {r.image_id: r for r in records}
    missing = [i for i in ids if i not in index]
    if missing:
        raise KeyError(f"image ids not in the corpus manifest: {missing[:5]}")
    return [index[i] for i in ids]


def shard_records(store: Store, ids: list[str], records: list[ImageRecord] | None = None) -> list[ImageRecord]:
    """The manifest rows of a shard task's images ``ids``: ``records``, the rows its flow handed it
    (:func:`flows.wsss.handing`), or without them the manifest's, read whole. The flow holds the
    manifest already; a task that reads it to find its few hundred rows holds all of it meanwhile
    (630 MB of records at 10^6 images) and reads it once a shard instead of once a stage."""
    if records is None:
        return records_by_id(store.manifest(), ids)
    if [r.image_id for r in records] != list(ids):
        raise ValueError(f"the rows handed to the shard of {ids[0] if ids else 'no image'} are not its images' "
                         f"({len(records)} rows for {len(ids)} ids)")
    return list(records)
