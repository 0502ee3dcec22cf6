"""The one module that knows paths and formats (Zarr arrays, Parquet tables, JSON).

Everything else asks the store for ``image(id)`` or ``write_pseudo(round, id, label)``.

Layout of a run directory::

    RUN/
      corpus/manifest.parquet      id, height, width, tags, sha256, split, source, mask
      corpus/classes.json          class names and the implicit background class (or null)
      corpus/images.zarr/<id>      (H, W, 3) uint8, one array (= one chunk) per image
      corpus/masks.zarr/<id>       (H, W) uint8 ground truth, for evaluation only
      cache/<stage>-<key>/<sha>    per-image stage outputs, content-addressed: the key hashes
                                   the stage's parameters, <sha> the image bytes, so a changed
                                   image or parameter recomputes and nothing else does
      rounds/r000/prelim.zarr/<id> preliminary result (tagged classes, quantised to uint8)
      rounds/r000/pseudo.zarr/<id> pseudo-label (H, W) uint8, 255 = ignore
      rounds/r000/done/<stage>-<shard>.json   a shard counts as done only once this exists
      rounds/r000/round.json       the round's metrics, written last
      rounds/r000/*.pt             checkpoints

Every array is one Zarr chunk written by exactly one process, and a marker is written (by an
atomic rename) only after the data, so an interrupted run is resumed by re-running it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import scipy.sparse as sp
import zarr

_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")

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
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class Store:
    """Read and write everything of one run directory. Cheap to construct; picklable."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # ------------------------------------------------------------------ arrays
    def _group(self, path: Path, mode: str = "a") -> zarr.Group:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return zarr.open_group(str(path), mode=mode)
        except zarr.errors.ContainsGroupError:
            # another worker created the group between our check and our create: open theirs
            return zarr.open_group(str(path), mode="r+")

    def _write_array(self, group: Path, name: str, arr: np.ndarray, attrs: dict | None = None) -> None:
        g = self._group(group)
        a = g.create_array(name, shape=arr.shape, dtype=arr.dtype, chunks=arr.shape,
                           overwrite=True, fill_value=0)
        a[...] = arr
        # The attribute is written after the data: an array without it is incomplete.
        a.attrs.update({**(attrs or {}), "complete": True})

    def _read_array(self, group: Path, name: str) -> np.ndarray | None:
        """The array's data, or None when it is missing or was not completely written."""
        if not self._has_array(group, name):
            return None
        return zarr.open_array(str(group / name), mode="r")[...]

    def _has_array(self, group: Path, name: str) -> bool:
        meta = group / name / "zarr.json"
        if not meta.exists():
            return False
        try:
            return bool(json.loads(meta.read_text()).get("attributes", {}).get("complete", False))
        except (OSError, ValueError):
            return False

    # ------------------------------------------------------------------ corpus
    @property
    def corpus_dir(self) -> Path:
        return self.root / "corpus"

    def write_corpus(self, records: list[ImageRecord], classes: ClassSpec) -> None:
        table = pa.Table.from_pylist([r.__dict__ | {"tags": list(r.tags)} for r in records],
                                     schema=MANIFEST_SCHEMA)
        self.corpus_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.corpus_dir / ".manifest.parquet.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, self.corpus_dir / "manifest.parquet")
        _atomic_write_text(self.corpus_dir / "classes.json",
                           json.dumps({"names": list(classes.names), "background": classes.background}, indent=1))

    def has_corpus(self) -> bool:
        return (self.corpus_dir / "manifest.parquet").exists()

    def classes(self) -> ClassSpec:
        d = json.loads((self.corpus_dir / "classes.json").read_text())
        return ClassSpec(tuple(d["names"]), d["background"])

    def manifest(self, split: str | None = None) -> list[ImageRecord]:
        path = self.corpus_dir / "manifest.parquet"
        if not path.exists():
            raise FileNotFoundError(f"{path}: no corpus here; run `wsseg ingest` first")
        rows = pq.read_table(path).to_pylist()
        recs = [ImageRecord(**(r | {"tags": tuple(r["tags"])})) for r in rows]
        if split is not None:
            recs = [r for r in recs if r.split == split]
        return recs

    def put_image(self, image_id: str, image: np.ndarray, sha256: str) -> None:
        self._write_array(self.corpus_dir / "images.zarr", image_id, image, {"sha256": sha256})

    def has_image(self, image_id: str, sha256: str) -> bool:
        meta = self.corpus_dir / "images.zarr" / image_id / "zarr.json"
        if not meta.exists():
            return False
        attrs = json.loads(meta.read_text()).get("attributes", {})
        return attrs.get("complete", False) and attrs.get("sha256") == sha256

    def image(self, image_id: str) -> np.ndarray:
        arr = self._read_array(self.corpus_dir / "images.zarr", image_id)
        if arr is None:
            raise KeyError(f"image {image_id!r} is not in the corpus store {self.corpus_dir}")
        return arr

    def put_mask(self, image_id: str, mask: np.ndarray) -> None:
        self._write_array(self.corpus_dir / "masks.zarr", image_id, mask)

    def mask(self, image_id: str) -> np.ndarray | None:
        """Ground-truth mask, for evaluation only (None when the corpus has none)."""
        return self._read_array(self.corpus_dir / "masks.zarr", image_id)

    # ------------------------------------------------------------------ feature cache
    def cache_dir(self, stage: str, key: str) -> Path:
        return self.root / "cache" / f"{stage}-{key}"

    def has_cached(self, stage: str, key: str, sha: str) -> bool:
        return self._has_array(self.cache_dir(stage, key), sha[:24])

    def put_cached(self, stage: str, key: str, sha: str, arrays: dict[str, np.ndarray]) -> None:
        """Write several arrays of one image; the group's marker array is written last."""
        base = self.cache_dir(stage, key)
        for name, arr in arrays.items():
            self._write_array(base, f"{sha[:24]}.{name}", np.ascontiguousarray(arr))
        self._write_array(base, sha[:24], np.zeros(1, np.uint8), {"parts": sorted(arrays)})

    def cached(self, stage: str, key: str, sha: str, parts: Sequence[str] | None = None) -> dict[str, np.ndarray]:
        """The cached arrays of one image, all of them or only ``parts`` (the edge map alone is
        read every epoch by the segmenter's loader: the superpixel parts would double its cost)."""
        base = self.cache_dir(stage, key)
        meta = base / sha[:24] / "zarr.json"
        if not self._has_array(base, sha[:24]):
            raise KeyError(f"no cached {stage} output for image sha {sha[:12]} under {base}")
        have = json.loads(meta.read_text())["attributes"]["parts"]
        missing = [p for p in (parts or ()) if p not in have]
        if missing:
            raise KeyError(f"cached {stage} output of {sha[:12]} has no part {', '.join(missing)} under {base}")
        out = {}
        for name in (have if parts is None else parts):
            arr = self._read_array(base, f"{sha[:24]}.{name}")
            if arr is None:
                raise KeyError(f"cached {stage} part {name!r} of {sha[:12]} is incomplete under {base}")
            out[name] = arr
        return out

    # ------------------------------------------------------------------ rounds
    def round_dir(self, r: int) -> Path:
        return self.root / "rounds" / f"r{r:03d}"

    def write_prelim(self, r: int, image_id: str, prob: np.ndarray, class_idx: np.ndarray) -> None:
        """Preliminary result of round r: (T, H, W) float probabilities of the classes ``class_idx``
        (the image's tags and background), stored quantised to uint8."""
        q = np.clip(np.rint(prob * 255.0), 0, 255).astype(np.uint8)
        self._write_array(self.round_dir(r) / "prelim.zarr", image_id, q,
                          {"classes": [int(c) for c in class_idx]})

    def prelim(self, r: int, image_id: str, n_classes: int) -> np.ndarray:
        """(K, H, W) float32 preliminary probabilities (zero for classes not stored)."""
        group = self.round_dir(r) / "prelim.zarr"
        q = self._read_array(group, image_id)
        if q is None:
            raise KeyError(f"no preliminary result of round {r} for {image_id!r} under {group}")
        cls = json.loads((group / image_id / "zarr.json").read_text())["attributes"]["classes"]
        out = np.zeros((n_classes,) + q.shape[1:], np.float32)
        out[cls] = q.astype(np.float32) / 255.0
        return out

    def write_pseudo(self, r: int, image_id: str, label: np.ndarray, name: str = "pseudo") -> None:
        if label.dtype != np.uint8 or label.ndim != 2:
            raise ValueError(f"pseudo-label must be (H, W) uint8, got {label.shape} {label.dtype}")
        self._write_array(self.round_dir(r) / f"{name}.zarr", image_id, label)

    def pseudo(self, r: int, image_id: str, name: str = "pseudo") -> np.ndarray | None:
        return self._read_array(self.round_dir(r) / f"{name}.zarr", image_id)

    def shard_done(self, r: int, stage: str, shard: str) -> dict | None:
        p = self.round_dir(r) / "done" / f"{stage}-{shard}.json"
        return json.loads(p.read_text()) if p.exists() else None

    def mark_shard_done(self, r: int, stage: str, shard: str, info: dict) -> None:
        _atomic_write_text(self.round_dir(r) / "done" / f"{stage}-{shard}.json", json.dumps(info))

    def write_round(self, r: int, summary: dict) -> None:
        _atomic_write_text(self.round_dir(r) / "round.json", json.dumps(summary, indent=1, default=float))

    def read_round(self, r: int) -> dict | None:
        p = self.round_dir(r) / "round.json"
        return json.loads(p.read_text()) if p.exists() else None

    def write_table(self, path: Path, rows: list[dict]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        pq.write_table(pa.Table.from_pylist(rows), tmp)
        os.replace(tmp, path)

    def read_table(self, path: Path) -> list[dict]:
        return pq.read_table(path).to_pylist()


def sparse_to_arrays(m: sp.csr_matrix) -> dict[str, np.ndarray]:
    m = sp.csr_matrix(m)
    return {"m_indptr": m.indptr.astype(np.int64), "m_indices": m.indices.astype(np.int32),
            "m_shape": np.asarray(m.shape, np.int64)}


def arrays_to_sparse(d: dict[str, np.ndarray]) -> sp.csr_matrix:
    indptr, indices, shape = d["m_indptr"], d["m_indices"], tuple(int(s) for s in d["m_shape"])
    data = np.ones(len(indices), bool)
    return sp.csr_matrix((data, indices, indptr), shape=shape)


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
