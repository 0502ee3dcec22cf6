"""Single-chunk Zarr v3 arrays of a local run directory, written and read without zarr's machinery.

Every per-image array of the store is one chunk (an image, a label map, a part of its feature
cache). zarr 3 spends about 4 ms of CPU writing such an array and 2.7 ms reading it (its async
event loop, a thread per codec call, the metadata written twice for the completeness marker), 50
times what the bytes cost; at 10 writes and 11 reads per image in a round that was a third of the
CPU stages' time. Here the same files are written directly: the chunk (``bytes`` codec, little
endian, then zstd, zarr 3's defaults) and then ``zarr.json`` with the attributes, so that the
metadata's ``complete`` attribute is written after the data in one write, not two. zarr reads these
arrays and this module reads zarr's (``tests/test_store.py`` checks both ways); anything it does
not write itself (another codec, several chunks) it leaves to zarr. The zstd frame carries its
content's checksum (zarr's ``checksum`` option), so a changed byte fails the read: a
:class:`~tasks.store.damage.DamagedFileError` naming the chunk (arrays of an older wsseg, without
it, fail only where zstd's own structure does).

Local paths only: on object storage each file is a request either way and zarr's own path is kept.
Nothing here runs code from a file: JSON, zstd and ``numpy.frombuffer``.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
from numcodecs import Zstd

from wsseg.tasks.store.damage import DamagedFileError

__all__ = ["write", "read", "metadata", "SUPPORTED"]

#: dtypes written directly (others go through zarr): the store's arrays are of these
SUPPORTED = {np.dtype(t): t for t in ("bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64",
                                      "int64", "float16", "float32", "float64")}
_ZSTD = Zstd(level=0, checksum=True)


def _codecs(dtype: np.dtype) -> list[dict]:
    bytes_codec = {"name": "bytes"} if dtype.itemsize == 1 else {"name": "bytes", "configuration": {"endian": "little"}}
    return [bytes_codec, {"name": "zstd", "configuration": {"level": 0, "checksum": True}}]


def _chunk_path(path: Path, ndim: int) -> Path:
    """The one chunk's file under the default chunk key encoding (``c/0/0...``; ``c`` for 0-d)."""
    return path.joinpath("c", *(["0"] * ndim)) if ndim else path / "c"


def writable(arr: np.ndarray) -> bool:
    """Whether :func:`write` takes ``arr`` (a supported dtype and no zero-length axis)."""
    return arr.dtype in SUPPORTED and arr.size > 0


def write(path: Path, arr: np.ndarray, attrs: dict | None = None) -> None:
    """Write ``arr`` as the single-chunk Zarr v3 array at the local folder ``path``, replacing
    what is there: the old metadata is removed first, the chunk written, the metadata (with
    ``attrs``) last, each file by an atomic rename."""
    if not writable(arr):
        raise ValueError(f"{path}: {arr.dtype} arrays of shape {arr.shape} are left to zarr")
    dtype = arr.dtype
    meta_path = path / "zarr.json"
    try:
        meta_path.unlink()  # an array being replaced reads as missing until it is whole again
    except FileNotFoundError:
        pass
    chunk = _chunk_path(path, arr.ndim)
    chunk.parent.mkdir(parents=True, exist_ok=True)
    data = np.ascontiguousarray(arr, dtype=dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype)
    atomic_write(chunk, _ZSTD.encode(data.tobytes()))
    meta = {"shape": list(arr.shape), "data_type": SUPPORTED[dtype],
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(arr.shape)}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": False if dtype == np.bool_ else (0.0 if dtype.kind == "f" else 0),
            "codecs": _codecs(dtype), "attributes": dict(attrs or {}), "zarr_format": 3, "node_type": "array",
            "storage_transformers": []}
    atomic_write(meta_path, json.dumps(meta, indent=2).encode())


def atomic_write(path: Path, data: bytes) -> None:
    """``data`` into ``path`` through a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def metadata(path: Path) -> dict | None:
    """The array's ``zarr.json``, or None when it is missing; :class:`DamagedFileError` when it
    is not readable JSON."""
    try:
        return json.loads((path / "zarr.json").read_bytes())
    except OSError:
        return None
    except ValueError as e:
        raise DamagedFileError(path / "zarr.json", f"damaged: not readable JSON ({e})") from None


def read(path: Path, meta: dict) -> np.ndarray | None:
    """The data of the array at ``path`` whose metadata is ``meta``, or None when it is not one
    this module reads (another codec, chunk grid or data type: let zarr read it). A chunk that is
    not there is the fill value, as zarr writes no chunk equal to it."""
    shape = tuple(meta.get("shape", ()))
    dtype_name = meta.get("data_type")
    grid = meta.get("chunk_grid", {})
    if (meta.get("node_type") != "array" or dtype_name not in SUPPORTED.values() or meta.get("storage_transformers")
            or grid.get("name") != "regular" or tuple(grid.get("configuration", {}).get("chunk_shape", ())) != shape
            or meta.get("chunk_key_encoding") != {"name": "default", "configuration": {"separator": "/"}}
            or 0 in shape):
        return None
    dtype = np.dtype(dtype_name)
    codecs = meta.get("codecs", [])
    if len(codecs) != 2 or codecs[0].get("name") != "bytes" or codecs[1].get("name") != "zstd" or \
            codecs[0].get("configuration", {}).get("endian", "little") != "little":
        return None
    chunk = _chunk_path(path, len(shape))
    try:
        raw = chunk.read_bytes()
    except FileNotFoundError:
        return np.full(shape, meta.get("fill_value", 0), dtype)
    try:  # a bytearray: the array is writable, as zarr's are
        data = np.frombuffer(bytearray(_ZSTD.decode(raw)), dtype=dtype.newbyteorder("<") if dtype.itemsize > 1
                             else dtype)
        return data.astype(dtype, copy=False).reshape(shape)
    except (RuntimeError, ValueError) as e:
        raise DamagedFileError(chunk, f"damaged: does not decode to its {dtype} array {shape} "
                                      f"({str(e).strip() or type(e).__name__})") from None
