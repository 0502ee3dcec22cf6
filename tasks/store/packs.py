"""Per-image arrays packed by shard: a few files per shard instead of a few per image.

A *pack group* is a folder of one kind of per-image array (a round's preliminary results, its
pseudo-labels, the feature cache of one key). A shard task writes all its images' arrays as one
pack: ``packs/<shard>.<token>.pack``, the arrays' zstd-compressed bytes one after another, then
``packs/<shard>.<token>.json``, its index (name -> offset, length, dtype, shape, attributes),
written after the data: a pack without its index does not exist for readers, so a shard cut
short leaves nothing half-written. ``packs.json`` beside ``packs/`` holds the group's
*generation*, a token that changes when entries are dropped, so that a long-lived process
(a Dask worker) knows its in-memory index is out of date.

A reader loads the group's indexes once per process (one listing and one read per pack) and
keeps ``name -> (pack, offset, length, dtype, shape, attributes)``; a name it does not find makes
it list the folder again for packs written since (another worker's). Reading one array is then
one ranged read (locally a seek; on object storage one ranged GET). When two packs hold the same
name, the one written last wins (a shard computed again, a correction of a label).

Files here grow with shards: a round of 10^6 images in shards of 500 is 4,000 files a group,
where the per-image layout (:mod:`tasks.store.chunked`) made 2 files an image and array. Nothing
read runs code: JSON, zstd and ``numpy.frombuffer``.
"""
from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
from numcodecs import Zstd

from tasks.store.remote import is_local, listdir

__all__ = ["PackWriter", "GroupIndex", "index_of", "drop", "usage", "forget", "INDEX_FILE"]

INDEX_FILE = "packs.json"
_ZSTD = Zstd(level=0)
_DTYPES = {np.dtype(t).str: np.dtype(t) for t in ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32",
                                                      "uint64", "int64", "float16", "float32", "float64")}


def _le(dtype: np.dtype) -> np.dtype:
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype


def _write_bytes(path, data: bytes) -> None:
    """Locally a temporary file renamed into place; on object storage one put (whole or not at all)."""
    if not is_local(path):
        path.write_bytes(data)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _read_range(path, offset: int, length: int) -> bytes:
    if is_local(path):
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    return path.fs.cat_file(path.path, start=offset, end=offset + length)


class PackWriter:
    """The arrays one shard writes to one pack group, held until :meth:`flush` (nothing is on
    disk before: a shard cut short leaves no part of its pack)."""

    def __init__(self, group, shard: str):
        self.group, self.shard = group, shard
        self.entries: dict[str, tuple[np.ndarray, dict | None]] = {}

    def put(self, name: str, arr: np.ndarray, attrs: dict | None = None) -> None:
        arr = np.asarray(arr)
        if arr.dtype.str not in _DTYPES and _le(arr.dtype).str not in _DTYPES:
            raise ValueError(f"{self.group}: {arr.dtype} arrays cannot be packed")
        self.entries[name] = (np.array(arr, copy=True), attrs)

    def get(self, name: str) -> tuple[np.ndarray, dict] | None:
        e = self.entries.get(name)
        return None if e is None else (e[0], dict(e[1] or {}))

    def flush(self) -> dict:
        """Write the pack, then its index; returns ``{"files": 2, "bytes": ...}`` (nothing when empty)."""
        if not self.entries:
            return {"files": 0, "bytes": 0}
        stem = f"{self.shard}.{secrets.token_hex(4)}"
        chunks, index, offset = [], {}, 0
        for name, (arr, attrs) in self.entries.items():
            dtype = _le(arr.dtype)
            raw = _ZSTD.encode(np.ascontiguousarray(arr, dtype=dtype).tobytes())
            chunks.append(raw)
            index[name] = [offset, len(raw), dtype.str, list(arr.shape), attrs or {}]
            offset += len(raw)
        folder = self.group / "packs"
        gen = self.group / INDEX_FILE
        if not gen.exists():
            _write_bytes(gen, json.dumps({"generation": secrets.token_hex(8), "format": 1}).encode())
        _write_bytes(folder / f"{stem}.pack", b"".join(chunks))
        meta = json.dumps({"pack": f"{stem}.pack", "written": time.time_ns(), "bytes": offset,
                           "entries": index}, separators=(",", ":")).encode()
        _write_bytes(folder / f"{stem}.json", meta)  # the index last: it makes the pack visible
        return {"files": 2, "bytes": offset + len(meta)}


class GroupIndex:
    """What one process knows of one pack group: name -> where its bytes are."""

    def __init__(self, group):
        self.group = group
        self.generation: str | None = None
        self.loaded: set[str] = set()  # index files read
        self.entries: dict[str, tuple] = {}  # name -> (pack file, offset, length, dtype, shape, attrs, written)

    def _generation(self) -> str | None:
        try:
            return json.loads((self.group / INDEX_FILE).read_bytes()).get("generation")
        except (OSError, ValueError):
            return None

    def exists(self) -> bool:
        return self._generation() is not None

    def refresh(self, check_generation: bool = True) -> None:
        """Read the index files written since the last look (all of them when the generation
        changed: entries were dropped or the group was removed and written again)."""
        if check_generation:
            gen = self._generation()
            if gen != self.generation:
                self.generation, self.loaded, self.entries = gen, set(), {}
            if gen is None:
                return
        names = [n for n in listdir(self.group / "packs") if n.endswith(".json") and n not in self.loaded]
        new = []
        for n in names:
            try:
                d = json.loads((self.group / "packs" / n).read_bytes())
            except (OSError, ValueError):
                continue  # removed or being replaced meanwhile: the next look reads it
            new.append((d["written"], n, d))
        for written, n, d in sorted(new):
            for name, (off, length, dt, shape, attrs) in d["entries"].items():
                old = self.entries.get(name)
                if old is None or old[6] <= written:
                    self.entries[name] = (d["pack"], off, length, dt, tuple(shape), attrs, written)
            self.loaded.add(n)

    def lookup(self, name: str) -> tuple | None:
        e = self.entries.get(name)
        if e is None:
            self.refresh(check_generation=self.generation is None)
            e = self.entries.get(name)
        return e

    def attrs(self, name: str) -> dict | None:
        e = self.lookup(name)
        return None if e is None else dict(e[5])

    def read(self, name: str) -> tuple[np.ndarray, dict] | None:
        """The array ``name`` and its attributes, or None when no pack holds it."""
        out = self.read_many([name])
        return out.get(name)

    def read_many(self, names: Iterable[str]) -> dict[str, tuple[np.ndarray, dict]]:
        """Several arrays; those lying next to each other in one pack are read in one request."""
        found = {n: e for n in names if (e := self.lookup(n)) is not None}
        by_pack: dict[str, list] = {}
        for n, e in found.items():
            by_pack.setdefault(e[0], []).append((n, e))
        out = {}
        for pack, items in by_pack.items():
            items.sort(key=lambda it: it[1][1])
            start = items[0][1][1]
            end = max(e[1] + e[2] for _, e in items)
            total = sum(e[2] for _, e in items)
            path = self.group / "packs" / pack
            try:
                if end - start <= 2 * total:
                    blob = _read_range(path, start, end - start)
                    parts = {n: blob[e[1] - start:e[1] - start + e[2]] for n, e in items}
                else:
                    parts = {n: _read_range(path, e[1], e[2]) for n, e in items}
            except FileNotFoundError:
                # the pack went (its round was removed and computed again): look again, once
                self.generation = None
                self.refresh()
                return {n: v for n in found if (v := self._read_one_fresh(n)) is not None}
            for n, e in items:
                out[n] = (_decode(parts[n], e), dict(e[5]))
        return out

    def _read_one_fresh(self, name: str) -> tuple[np.ndarray, dict] | None:
        e = self.entries.get(name)
        if e is None:
            return None
        try:
            return _decode(_read_range(self.group / "packs" / e[0], e[1], e[2]), e), dict(e[5])
        except FileNotFoundError:
            return None

    def names(self) -> list[str]:
        self.refresh()
        return list(self.entries)


def _decode(raw: bytes, e: tuple) -> np.ndarray:
    dtype = np.dtype(e[3])
    data = np.frombuffer(bytearray(_ZSTD.decode(raw)), dtype=dtype)
    return data.astype(dtype.newbyteorder("="), copy=False).reshape(e[4])


#: group path -> its index in this process
_INDEXES: dict[str, GroupIndex] = {}


def index_of(group, check: bool = False) -> GroupIndex:
    """This process's index of ``group``; ``check``: compare the group's generation first (once
    per task: a long-lived worker then sees what another process dropped)."""
    key = str(group)
    ix = _INDEXES.get(key)
    if ix is None:
        ix = _INDEXES[key] = GroupIndex(group)
        ix.refresh()
    elif check:
        ix.refresh()
    return ix


def forget(group=None) -> None:
    """Drop this process's index of ``group`` (of every group when None)."""
    if group is None:
        _INDEXES.clear()
    else:
        _INDEXES.pop(str(group), None)


def drop(group, names: Iterable[str]) -> int:
    """Remove ``names`` from every pack index of ``group`` (their bytes stay in the pack until the
    group is removed) and change its generation; returns how many entries went."""
    names = set(names)
    folder = group / "packs"
    removed = 0
    for n in listdir(folder):
        if not n.endswith(".json"):
            continue
        try:
            d = json.loads((folder / n).read_bytes())
        except (OSError, ValueError):
            continue
        gone = names & d["entries"].keys()
        if not gone:
            continue
        for name in gone:
            d["entries"].pop(name)
        removed += len(gone)
        _write_bytes(folder / n, json.dumps(d, separators=(",", ":")).encode())
    if removed:
        _write_bytes(group / INDEX_FILE, json.dumps({"generation": secrets.token_hex(8), "format": 1}).encode())
    forget(group)
    return removed


def usage(group) -> tuple[int, int]:
    """(files, bytes) of ``group``'s packs, from one listing (no file is read)."""
    folder = group / "packs"
    if is_local(folder):
        files = size = 0
        try:
            with os.scandir(folder) as it:
                for e in it:
                    files += 1
                    size += e.stat(follow_symlinks=False).st_size
        except (FileNotFoundError, NotADirectoryError):
            return 0, 0
        return files + 1, size
    try:
        listing = folder.fs.ls(folder.path, detail=True)
    except FileNotFoundError:
        return 0, 0
    return len(listing) + 1, int(sum(e.get("size", 0) for e in listing))


def iter_groups(root) -> Iterator[Path]:
    """Pack groups directly under ``root`` (folders holding ``packs.json``)."""
    for n in listdir(root):
        if (root / n / INDEX_FILE).exists():
            yield root / n
