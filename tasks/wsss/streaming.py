"""The training rows of a corpus-wide trainer under a memory cap (superpixels of the MIL,
proposals of the proposal classifier).

A trainer adds each image's rows (one per superpixel or proposal) to a :class:`RowBuffer`.
While the corpus has at most ``max_rows`` rows they stay in memory, one array per image, and
the trainer computes exactly what it always did on those lists. Past the cap the buffer writes
them to a temporary folder in *pieces* of at most ``max_rows / pieces_per_chunk`` rows
(consecutive images) and from then on holds at most one open piece; training then streams
each epoch in *chunks*: a seeded shuffle of the pieces, packed into groups of at most
``max_rows`` rows, each loaded, shuffled row by row and cut into minibatches. Every row is seen
once an epoch, as in memory, and the memory held is bounded by ``max_rows``, not by the corpus.

A :class:`RowBudget` counts the rows held at once (``held``) and the most ever held
(``peak``); it refuses to hold more than its cap, so the bound holds by construction.

The temporary folder is the trainer's own scratch on local disk (``TMPDIR``), not part of the
run directory; it is removed when the buffer is closed.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np


class RowBudget:
    """The training rows held in memory at once (``held``) and the most held so far (``peak``).

    Parameters
    ----------
    max_rows : int
        Holding more than this at once raises :class:`MemoryError`.
    """

    def __init__(self, max_rows: int):
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.max_rows, self.held, self.peak = int(max_rows), 0, 0

    def hold(self, n: int) -> None:
        if self.held + n > self.max_rows:
            raise MemoryError(f"holding {self.held + n} training rows would pass the cap of {self.max_rows}")
        self.held += n
        self.peak = max(self.peak, self.held)

    def release(self, n: int) -> None:
        self.held -= n


@dataclass
class Piece:
    """Rows of consecutive images written to the buffer's folder."""

    path: str
    rows: int
    first_image: int   # index (in the order images were added) of its first image
    images: int


class RowBuffer:
    """Per-image training rows, in memory up to ``max_rows`` and in pieces on disk beyond.

    Each :meth:`add` gives one image's ``rows`` (arrays whose first dimension is the image's
    row count, the same for all) and ``per_image`` arrays (the image's tag vector, ...).

    Parameters
    ----------
    max_rows : int
        The cap (``max_samples`` of the trainer's configuration).
    budget : RowBudget, optional
        The counter of the rows held; a new one with ``max_rows`` by default. A test or a
        benchmark passes its own and reads ``peak`` afterwards.
    pieces_per_chunk : int
        Pieces hold at most ``max_rows // pieces_per_chunk`` rows; an epoch's chunks mix about
        this many pieces from anywhere in the corpus.
    folder : str, optional
        Where the temporary folder of the pieces is made (default: ``TMPDIR``).

    Examples
    --------
    >>> buf = RowBuffer(4, pieces_per_chunk=2)
    >>> for i in range(3):
    ...     buf.add({"x": np.full((2, 1), i, np.float32)}, {"t": np.array([i])})
    >>> buf.finish(); buf.resident, len(buf.pieces), buf.n_rows
    (False, 3, 6)
    >>> buf.close()
    """

    def __init__(self, max_rows: int, *, budget: RowBudget | None = None, pieces_per_chunk: int = 32,
                 folder: str | None = None):
        self.budget = budget if budget is not None else RowBudget(max_rows)
        self.max_rows = int(max_rows)
        if self.budget.max_rows < self.max_rows:
            raise ValueError(f"the budget's cap {self.budget.max_rows} is below max_rows {self.max_rows}")
        self.piece_rows = max(1, self.max_rows // max(1, pieces_per_chunk))
        self.folder, self._parent = None, folder
        self.pieces: list[Piece] = []
        self._images: list[tuple[dict, dict]] = []  # in memory: all images (resident) or the open piece
        self._open_rows = 0
        self.n_rows = self.n_images = 0
        self.resident = True
        self.row_fields: tuple[str, ...] = ()
        self.image_fields: tuple[str, ...] = ()
        self.shapes: dict[str, tuple[int, ...]] = {}  # per field: a row's (or an image's) shape

    # ------------------------------------------------------------------ filling
    def add(self, rows: dict[str, np.ndarray], per_image: dict[str, np.ndarray]) -> None:
        """One image's rows and per-image arrays (added in the corpus's order)."""
        n = {len(v) for v in rows.values()}
        if len(n) != 1:
            raise ValueError(f"image {self.n_images}: row arrays of different lengths {sorted(n)}")
        n = n.pop()
        if n > self.max_rows:
            raise ValueError(f"image {self.n_images} has {n} training rows, more than max_samples = {self.max_rows}; "
                             "raise max_samples above the largest image's rows")
        if not self.row_fields:
            self.row_fields, self.image_fields = tuple(rows), tuple(per_image)
            self.shapes = {k: v.shape[1:] for k, v in rows.items()} | {k: v.shape for k, v in per_image.items()}
        if tuple(rows) != self.row_fields or tuple(per_image) != self.image_fields:
            raise ValueError(f"image {self.n_images}: fields {sorted(rows)} / {sorted(per_image)}, the buffer has "
                             f"{sorted(self.row_fields)} / {sorted(self.image_fields)}")
        if self.resident and self.n_rows + n > self.max_rows:
            self._spill()
        if not self.resident and self._open_rows + n > self.piece_rows:
            self._flush()
        self.budget.hold(n)
        self._images.append((rows, per_image))
        self._open_rows += n
        self.n_rows += n
        self.n_images += 1

    def finish(self) -> None:
        """After the last :meth:`add`: writes the open piece (when the rows are on disk)."""
        if not self.resident:
            self._flush()

    def _spill(self) -> None:
        """Past the cap: the images held so far go to disk in pieces."""
        self.folder = tempfile.mkdtemp(prefix="wsseg-rows-", dir=self._parent)
        self.resident = False
        held, self._images, self._open_rows = self._images, [], 0
        for rows, per_image in held:
            n = len(next(iter(rows.values())))
            if self._open_rows + n > self.piece_rows:
                self._flush()
            self._images.append((rows, per_image))
            self._open_rows += n
        del held

    def _next_image(self) -> int:
        return self.pieces[-1].first_image + self.pieces[-1].images if self.pieces else 0

    def _flush(self) -> None:
        if not self._images:
            return
        path = os.path.join(self.folder, f"piece{len(self.pieces):06d}")
        os.makedirs(path)
        for name in self.row_fields:
            np.save(os.path.join(path, f"{name}.npy"), np.concatenate([r[name] for r, _ in self._images]))
        for name in self.image_fields:
            np.save(os.path.join(path, f"img.{name}.npy"), np.stack([p[name] for _, p in self._images]))
        counts = np.array([len(next(iter(r.values()))) for r, _ in self._images], np.int64)
        np.save(os.path.join(path, "counts.npy"), counts)
        self.pieces.append(Piece(path, int(counts.sum()), self._next_image(), len(self._images)))
        self.budget.release(self._open_rows)
        self._images, self._open_rows = [], 0

    # ------------------------------------------------------------------ in memory
    def lists(self, name: str) -> list[np.ndarray]:
        """Per image, field ``name`` (in memory only: ``resident``)."""
        if not self.resident:
            raise RuntimeError("the rows are on disk: stream them with chunk()")
        if name in self.row_fields:
            return [r[name] for r, _ in self._images]
        return [p[name] for _, p in self._images]

    # ------------------------------------------------------------------ on disk
    def plan(self, order: Sequence[int]) -> list[list[int]]:
        """The pieces, in ``order`` (a permutation of their indices), packed into chunks of at
        most ``max_rows`` rows and of about equal size (no small last chunk of a few correlated
        pieces that the epoch would end on)."""
        target = self.n_rows / max(1, -(-self.n_rows // self.max_rows))
        chunks, rows = [], 0
        for i in order:
            n = self.pieces[int(i)].rows
            if not chunks or rows >= target or rows + n > self.max_rows:
                chunks.append([])
                rows = 0
            chunks[-1].append(int(i))
            rows += n
        return chunks

    @contextmanager
    def chunk(self, pieces: Sequence[int], fields: Sequence[str]) -> Iterator[dict[str, np.ndarray]]:
        """Fields of ``pieces`` loaded together (held against the budget until the block ends).

        Yields a dict: each row field concatenated over the pieces, each per-image field
        (``img.<name>`` on disk) stacked, ``counts`` (rows of each image) and ``image_index``
        (each image's index in the order of :meth:`add`)."""
        n = sum(self.pieces[i].rows for i in pieces)
        self.budget.hold(n)
        out: dict[str, np.ndarray] = {}
        try:
            for name in fields:
                stored = name if name in self.row_fields or name not in self.image_fields else f"img.{name}"
                out[name] = np.concatenate([np.load(os.path.join(self.pieces[i].path, f"{stored}.npy"))
                                            for i in pieces])
            out["counts"] = np.concatenate([np.load(os.path.join(self.pieces[i].path, "counts.npy")) for i in pieces])
            out["image_index"] = np.concatenate([np.arange(self.pieces[i].first_image,
                                                           self.pieces[i].first_image + self.pieces[i].images)
                                                 for i in pieces])
            yield out
        finally:
            out.clear()  # the arrays go with the block (a caller keeps none of them past it)
            self.budget.release(n)

    def write(self, piece: int, name: str, rows: np.ndarray) -> None:
        """Replace (or add) row field ``name`` of one piece (e.g. the MIL's labels of an iteration)."""
        if len(rows) != self.pieces[piece].rows:
            raise ValueError(f"piece {piece} has {self.pieces[piece].rows} rows, got {len(rows)}")
        path = os.path.join(self.pieces[piece].path, f"{name}.npy")
        np.save(path + ".tmp.npy", rows)
        os.replace(path + ".tmp.npy", path)
        if name not in self.row_fields:
            self.row_fields += (name,)

    def moments(self, name: str) -> tuple[int, np.ndarray, np.ndarray]:
        """(rows, sum, sum of squares) over all rows of row field ``name``, in float64, one
        piece at a time."""
        s = q = None
        for i in range(len(self.pieces)):
            with self.chunk([i], [name]) as c:
                v = c[name].astype(np.float64)
                s = v.sum(0) if s is None else s + v.sum(0)
                q = (v * v).sum(0) if q is None else q + (v * v).sum(0)
        return self.n_rows, s, q

    def close(self) -> None:
        """Remove the pieces (and forget the rows in memory)."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None
        self.budget.release(self._open_rows)
        self._images, self._open_rows, self.pieces = [], 0, []

    def __enter__(self) -> "RowBuffer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def split_images(chunk: dict[str, np.ndarray], name: str) -> list[np.ndarray]:
    """Row field ``name`` of a loaded chunk cut into its images' rows (views)."""
    return np.split(chunk[name], np.cumsum(chunk["counts"])[:-1])


def mean_std(n: int, s: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and unbiased standard deviation from :meth:`RowBuffer.moments`."""
    mean = s / max(n, 1)
    var = np.maximum(q - n * mean * mean, 0.0) / max(n - 1, 1)
    return mean, np.sqrt(var)
