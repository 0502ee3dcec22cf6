"""Per-image arrays packed by shard: a few files per shard instead of a few per image.

A *pack group* is a folder of one kind of per-image array (a round's preliminary results, its
pseudo-labels, the feature cache of one key). A shard task writes all its images' arrays as one
pack: ``packs/<shard>.<token>.pack``, the arrays' zstd-compressed bytes one after another, then
``<shard>.<token>.keys`` (when it was written and a 64-bit hash of each name), then
``<shard>.<token>.json``, its index (name -> offset, length, dtype, shape, attributes; the blake2b
digests of the pack's bytes and of the entries), written last: a pack without its index does not
exist for readers, so a shard cut short leaves nothing half-written. Each array is one zstd frame
carrying its content's checksum, so a reader notices a changed byte of what it reads (a
:class:`~tasks.store.damage.DamagedFileError` naming the pack); ``wsseg check`` compares whole packs
with their digests (:func:`verify`). Packs of an older wsseg, without checksums or digests, still
read. ``packs.json`` beside ``packs/`` holds the group's
*generation*, a token that changes when entries are dropped, so that a long-lived process
(a Dask worker) knows its in-memory index is out of date.

A reader lists the group once per task and reads each new pack's keys (:class:`GroupIndex`): it
holds two arrays, the names' hashes sorted and the pack of each, 12 bytes a name (a round of 10^7
images: 120 MB a group), and parses a pack's JSON index only when it reads from that pack (at
most 16 kept). A name it does not find makes it list the folder again for packs written since
(another worker's). Reading one array is then one ranged read (locally a seek; on object storage
one ranged GET). When two packs hold the same name, the one written last wins (a shard computed
again, a label written again).

Files here grow with shards: a round of 10^6 images in shards of 500 is 6,000 files a group,
where the per-image layout (:mod:`tasks.store.chunked`) made 2 files an image and array. Nothing
read runs code: JSON, zstd and ``numpy.frombuffer``.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from collections import OrderedDict
from typing import Iterable

import numpy as np
from numcodecs import Zstd

from wsseg.tasks.store import chunked
from wsseg.tasks.store.damage import DamagedFileError
from wsseg.tasks.store.remote import is_local, listdir, replace

__all__ = ["PackWriter", "GroupIndex", "index_of", "drop", "usage", "forget", "verify", "remove_packs", "publish",
           "discard", "staged_names", "INDEX_FILE"]

INDEX_FILE = "packs.json"
#: each array one zstd frame with its content's checksum (XXH64), verified by every decode
_ZSTD = Zstd(level=0, checksum=True)
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
    chunked.atomic_write(path, data)


def _read_range(path, offset: int, length: int) -> bytes:
    if is_local(path):
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    return path.fs.cat_file(path.path, start=offset, end=offset + length)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _entries_digest(entries: dict) -> str:
    """The digest of a pack index's entries, as its JSON is written (``wsseg check`` parses the
    index and compares)."""
    return _digest(json.dumps(entries, separators=(",", ":")).encode())


def name_hash(name: str) -> int:
    """The 64-bit key of an entry's name in the in-memory index (blake2b)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _hashes(names: Iterable[str]) -> np.ndarray:
    return np.fromiter((name_hash(n) for n in names), np.uint64)


class PackWriter:
    """The arrays one shard writes to one pack group, held until :meth:`flush` (nothing is on
    disk before: a shard cut short leaves no part of its pack). ``staging``: a folder that takes
    the pack's index instead of the group's ``packs/``, so that the pack exists for readers only
    once :func:`publish` moves its index in (an ingest's images, until the ingest is accepted)."""

    def __init__(self, group, shard: str, staging=None):
        self.group, self.shard, self.staging = group, shard, staging
        self.entries: dict[str, tuple[np.ndarray, dict | None]] = {}
        self.nbytes = 0

    def put(self, name: str, arr: np.ndarray, attrs: dict | None = None) -> None:
        arr = np.asarray(arr)
        if _le(arr.dtype).str not in _DTYPES:
            raise ValueError(f"{self.group}: {arr.dtype} arrays cannot be packed")
        self.entries[name] = (np.array(arr, copy=True), attrs)
        self.nbytes += arr.nbytes

    def get(self, name: str) -> tuple[np.ndarray, dict] | None:
        e = self.entries.get(name)
        return None if e is None else (e[0], dict(e[1] or {}))

    def flush(self) -> dict:
        """Write the pack, its keys, then its index, and empty the writer; returns ``{"files": 3,
        "bytes": ...}`` (nothing when empty)."""
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
        written = time.time_ns()
        keys = _keys_file(written, index)
        data = b"".join(chunks)
        _write_bytes(folder / f"{stem}.pack", data)
        _write_bytes(folder / f"{stem}.keys", keys)
        meta = json.dumps({"pack": f"{stem}.pack", "written": written, "bytes": offset, "blake2b": _digest(data),
                           "entries_blake2b": _entries_digest(index), "entries": index},
                          separators=(",", ":")).encode()
        self.entries, self.nbytes = {}, 0
        if self.staging is not None:  # visible once published
            _write_bytes(self.staging / f"{stem}.json", meta)
            return {"files": 3, "bytes": offset + len(keys) + len(meta)}
        _write_bytes(folder / f"{stem}.json", meta)  # the index last: it makes the pack visible
        ix = _INDEXES.get(str(self.group))
        if ix is not None:  # this process reads what it wrote
            if ix.generation is None:  # the group's first pack: its generation is new too
                ix.refresh()
            else:
                ix.add([(f"{stem}.json", written, _hashes(index))])
        return {"files": 3, "bytes": offset + len(keys) + len(meta)}


class GroupIndex:
    """What one process knows of one pack group: which pack holds each name, as two arrays
    (the names' 64-bit hashes, sorted, and the pack of each: 12 bytes a name, whatever the
    corpus), and the full indexes of the packs read lately (at most :attr:`OPEN` parsed at once)."""

    #: pack indexes kept parsed (an LRU): a shard task reads a few, a trainer one after another
    OPEN = 16

    def __init__(self, group):
        self.group = group
        self.generation: str | None = None
        self.packs: list[str] = []  # index file names, in the order read
        self.written: list[int] = []
        self.hashes = np.zeros(0, np.uint64)
        self.slots = np.zeros(0, np.int32)
        self._parsed: OrderedDict[int, dict] = OrderedDict()

    def _generation(self) -> str | None:
        try:
            return json.loads((self.group / INDEX_FILE).read_bytes()).get("generation")
        except (OSError, ValueError):
            return None

    def exists(self) -> bool:
        return self._generation() is not None

    def _reset(self, gen: str | None) -> None:
        self.generation, self.packs, self.written = gen, [], []
        self.hashes, self.slots = np.zeros(0, np.uint64), np.zeros(0, np.int32)
        self._parsed.clear()

    def refresh(self, check_generation: bool = True) -> None:
        """Take in the packs written since the last look (all of them when the generation
        changed: entries were dropped, or the group was removed and written again)."""
        if check_generation:
            gen = self._generation()
            if gen != self.generation:
                self._reset(gen)
            if gen is None:
                return
        known = set(self.packs)
        names = sorted(n for n in listdir(self.group / "packs") if n.endswith(".json") and n not in known)
        new = []
        for n in names:
            stem = n[:-len(".json")]
            path = self.group / "packs" / f"{stem}.keys"
            try:  # the keys are written before the index: an index listed has its keys
                raw = np.frombuffer(path.read_bytes(), "<u8").astype(np.uint64)
            except OSError:
                continue  # removed meanwhile: the next look sees what is there
            except ValueError:
                raise DamagedFileError(path, "damaged: not a whole number of 8-byte keys") from None
            if not len(raw):
                raise DamagedFileError(path, "damaged: empty")
            new.append((n, int(raw[0]), raw[1:]))
        self.add(new)

    def add(self, new: list[tuple[str, int, np.ndarray]]) -> None:
        """Take in packs ``(index file name, written, name hashes)``."""
        known = set(self.packs)
        new = [p for p in new if p[0] not in known]
        if not new:
            return
        hashes, slots = [self.hashes], [self.slots]
        for n, written, keys in new:
            self.packs.append(n)
            self.written.append(written)
            hashes.append(keys)
            slots.append(np.full(len(keys), len(self.packs) - 1, np.int32))
        h, sl = np.concatenate(hashes), np.concatenate(slots)
        order = np.lexsort((sl, h))  # by hash, then by pack: the equal hashes' packs in the order read
        self.hashes, self.slots = h[order], sl[order]

    def _pack(self, slot: int) -> dict | None:
        d = self._parsed.get(slot)
        if d is not None:
            self._parsed.move_to_end(slot)
            return d
        path = self.group / "packs" / self.packs[slot]
        try:
            d = json.loads(path.read_bytes())
        except OSError:
            return None
        except ValueError as e:
            raise DamagedFileError(path, f"damaged: not readable JSON ({e})") from None
        self._parsed[slot] = d
        while len(self._parsed) > self.OPEN:
            self._parsed.popitem(last=False)
        return d

    def _find(self, name: str) -> tuple | None:
        h = np.uint64(name_hash(name))
        lo = int(np.searchsorted(self.hashes, h, "left"))
        hi = int(np.searchsorted(self.hashes, h, "right"))
        best = None  # the newest pack that holds the name (equal hashes: several packs, or a collision)
        for slot in {int(s) for s in self.slots[lo:hi]}:
            d = self._pack(slot)
            e = None if d is None else d["entries"].get(name)
            if e is not None and (best is None or self.written[slot] > best[0]):
                best = (self.written[slot], d["pack"], e)
        if best is None:
            return None
        _, pack, (off, length, dt, shape, attrs) = best
        return pack, off, length, dt, tuple(shape), attrs

    def lookup(self, name: str, look_again: bool = True) -> tuple | None:
        """Where ``name`` lies: ``(pack, offset, length, dtype, shape, attributes)``, or None.
        ``look_again``: on a miss, list the folder for packs written since (another process's)."""
        e = self._find(name)
        if e is None and look_again:
            self.refresh(check_generation=self.generation is None)
            e = self._find(name)
        return e

    def attrs(self, name: str, look_again: bool = True) -> dict | None:
        e = self.lookup(name, look_again)
        return None if e is None else dict(e[5])

    def read(self, name: str) -> tuple[np.ndarray, dict] | None:
        """The array ``name`` and its attributes, or None when no pack holds it."""
        return self.read_many([name]).get(name)

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
                self._reset(None)
                self.refresh()
                return {n: v for n in found if (v := self._read_fresh(n)) is not None}
            for n, e in items:
                out[n] = (_decode(parts[n], e, path), dict(e[5]))
        return out

    def _read_fresh(self, name: str) -> tuple[np.ndarray, dict] | None:
        e = self._find(name)
        if e is None:
            return None
        path = self.group / "packs" / e[0]
        try:
            return _decode(_read_range(path, e[1], e[2]), e, path), dict(e[5])
        except FileNotFoundError:
            return None

    def memory_bytes(self) -> int:
        """Bytes of the name arrays (the parsed pack indexes come on top, at most :attr:`OPEN`)."""
        return int(self.hashes.nbytes + self.slots.nbytes)


def _keys_file(written: int, names: Iterable[str]) -> bytes:
    """A pack's ``.keys`` file: when it was written (ns), then its names' hashes (uint64, little endian)."""
    return np.concatenate([np.array([written], np.uint64), _hashes(names)]).astype("<u8").tobytes()


def _decode(raw: bytes, e: tuple, path=None) -> np.ndarray:
    """The array of entry ``e`` from its bytes ``raw``; :class:`DamagedFileError` naming ``path``
    (the pack) when they are cut short or do not decode to it (a checksum fails)."""
    dtype = np.dtype(e[3])
    if len(raw) != e[2]:
        raise DamagedFileError(path, f"damaged: cut short ({len(raw)} of the {e[2]} bytes of an entry at "
                                     f"offset {e[1]})")
    try:
        data = np.frombuffer(bytearray(_ZSTD.decode(raw)), dtype=dtype)
        return data.astype(dtype.newbyteorder("="), copy=False).reshape(e[4])
    except (RuntimeError, ValueError) as exc:
        raise DamagedFileError(path, f"damaged: an entry at offset {e[1]} does not decode "
                                     f"({str(exc).strip() or type(exc).__name__})") from None


#: group path -> its index in this process
_INDEXES: dict[str, GroupIndex] = {}


def index_of(group, check: bool = False) -> GroupIndex:
    """This process's index of ``group``; ``check``: compare the group's generation and list its
    new packs (once per task: a long-lived worker then sees what another process wrote or dropped)."""
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
        if "entries_blake2b" in d:
            d["entries_blake2b"] = _entries_digest(d["entries"])
        removed += len(gone)
        stem = n[:-len(".json")]
        _write_bytes(folder / f"{stem}.keys", _keys_file(d["written"], d["entries"]))
        _write_bytes(folder / n, json.dumps(d, separators=(",", ":")).encode())
    if removed:
        _write_bytes(group / INDEX_FILE, json.dumps({"generation": secrets.token_hex(8), "format": 1}).encode())
    forget(group)
    return removed


def publish(group, staging) -> int:
    """Move the pack indexes written to ``staging`` (:class:`PackWriter`'s ``staging``) into
    ``group``: their packs exist for readers from now on, and, written after every pack the group
    held, win over them. Returns how many packs were published."""
    names = sorted(n for n in listdir(staging) if n.endswith(".json"))
    for n in names:
        replace(staging / n, group / "packs" / n)
    forget(group)
    return len(names)


def discard(group, staging) -> None:
    """Remove the packs whose index waits in ``staging`` (each index first, then its pack and keys
    in ``group``): what a refused ingest wrote."""
    for n in listdir(staging):
        if n.endswith(".json"):
            stem = n[:-len(".json")]
            _remove_file(staging / n)
            for suffix in (".pack", ".keys"):
                _remove_file(group / "packs" / f"{stem}{suffix}")


def staged_names(staging) -> set[str]:
    """The entries of the pack indexes waiting in ``staging``."""
    out: set[str] = set()
    for n in listdir(staging):
        if n.endswith(".json"):
            path = staging / n
            try:
                out.update(json.loads(path.read_bytes())["entries"])
            except (ValueError, KeyError, TypeError) as e:
                raise DamagedFileError(path, f"damaged: not a pack index ({e})") from None
    return out


def _remove_file(path) -> None:
    if is_local(path):
        path.unlink(missing_ok=True)
    elif path.exists():
        path.fs.rm(path.path)


def verify(group) -> list[dict]:
    """Every pack of ``group`` read whole and checked against what its index recorded: its bytes
    against their digest (a pack of an older wsseg, without one: every entry decoded), its length,
    its keys against its entries, its entries against their digest. One dict per pack: ``stem``,
    ``files`` (its file names), ``bytes`` (read), ``names`` (its entries; empty when its index
    does not read), ``entries`` (name -> offset, length, dtype, shape, attributes), ``written``,
    ``problem`` (None when sound) and ``file`` (the file the problem is in). A pack
    without an index (a shard cut short before it) does not exist for readers and is left out."""
    folder = group / "packs"
    listed = {n for n in listdir(folder) if not n.startswith(".")}
    out = []
    for stem in sorted(n[:-len(".json")] for n in listed if n.endswith(".json")):
        files = [f"{stem}{s}" for s in (".pack", ".keys", ".json") if f"{stem}{s}" in listed]
        rec = {"stem": stem, "files": files, "bytes": 0, "names": [], "entries": {}, "written": 0, "problem": None,
               "file": None}
        out.append(rec)

        def bad(suffix: str, problem: str) -> None:
            rec["problem"], rec["file"] = problem, f"{stem}{suffix}"

        raw = (folder / f"{stem}.json").read_bytes()
        rec["bytes"] += len(raw)
        try:
            d = json.loads(raw)
            entries = d["entries"]
            rec["names"], rec["entries"], rec["written"] = list(entries), entries, d.get("written", 0)
        except (ValueError, KeyError, TypeError) as e:
            bad(".json", f"damaged: its index is not readable JSON ({e})")
            continue
        if "entries_blake2b" in d and _entries_digest(entries) != d["entries_blake2b"]:
            bad(".json", "damaged: its index differs from the digest recorded when it was written")
            continue
        if f"{stem}.keys" not in listed:
            bad(".keys", "missing: the keys of a pack its index names")
            continue
        keys = (folder / f"{stem}.keys").read_bytes()
        rec["bytes"] += len(keys)
        if keys != _keys_file(d.get("written", 0), entries):
            bad(".keys", "damaged: its keys differ from its index's entries")
            continue
        if f"{stem}.pack" not in listed:
            bad(".pack", "missing: the pack its index names")
            continue
        data = (folder / f"{stem}.pack").read_bytes()
        rec["bytes"] += len(data)
        if len(data) != d.get("bytes", len(data)):
            bad(".pack", f"damaged: {'cut short' if len(data) < d['bytes'] else 'longer than written'} "
                         f"({len(data)} of the {d['bytes']} bytes its index records)")
        elif "blake2b" in d:
            if _digest(data) != d["blake2b"]:
                bad(".pack", "damaged: its bytes differ from the digest recorded when it was written")
        else:  # an older wsseg's pack: as far as its format tells, every entry decoded
            for name, (off, length, dt, shape, attrs) in entries.items():
                try:
                    _decode(data[off:off + length], (None, off, length, dt, tuple(shape), attrs),
                            folder / f"{stem}.pack")
                except DamagedFileError as e:
                    bad(".pack", e.problem)
                    break
    return out


def remove_packs(group, stems: Iterable[str], names: Iterable[str] = ()) -> None:
    """Remove the packs ``stems`` of ``group`` (each index first: the pack is gone for readers at
    once) and the entries ``names`` from every other pack of the group (an older pack holding one
    would otherwise be read in its place), then change the group's generation."""
    if not group.exists():
        forget(group)
        return
    drop(group, names)
    for stem in stems:
        for suffix in (".json", ".keys", ".pack"):
            _remove_file(group / "packs" / f"{stem}{suffix}")
    _write_bytes(group / INDEX_FILE, json.dumps({"generation": secrets.token_hex(8), "format": 1}).encode())
    forget(group)


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
