"""A split's manifest rows streamed, and cut into shard tasks without holding them all.

A flow that read the manifest whole held about 630 bytes of :class:`ImageRecord` per image (6.3 GB
at 10^7 images) for as long as its stages ran. :class:`ManifestRows` stands for one split's rows
and reads them again, a Parquet batch at a time (:meth:`Store.manifest_records`), each time it is
iterated; :class:`Shards` cuts any such rows (or a list) into the shards
:func:`flows.wsss.shards_of` makes of the same rows, one shard at a time, so that a stage's tasks
can be submitted while the rows of the shards not yet submitted are still on disk.
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

# (ImageRecord and Store are named in the annotations only: tasks.store.run imports this module)


class ManifestRows:
    """The manifest rows of ``split`` (of every split with None) in the manifest's order, read
    again from the manifest at each iteration; ``len()`` from its footer where it records it
    (:meth:`Store.split_images`). Use it where a list of the rows was used and every use iterates
    them: nothing is held between two iterations."""

    def __init__(self, store: "Store", split: str | None):
        self.store, self.split = store, split
        self._n: int | None = None

    def __iter__(self) -> Iterator["ImageRecord"]:
        return self.store.manifest_records(self.split)

    def __len__(self) -> int:
        if self._n is None:
            self._n = self.store.split_images(self.split)
        return self._n

    def __bool__(self) -> bool:
        return len(self) > 0

    def ids(self) -> Iterator[str]:
        """The rows' image ids alone (one column read)."""
        for batch in self.store.manifest_batches(self.split, columns=["image_id"]):
            yield from batch.column("image_id").to_pylist()

    def __repr__(self) -> str:
        return f"ManifestRows({self.store!r}, {self.split!r})"


class Shards:
    """The shards of ``rows`` (those ``keep`` accepts, when given) exactly as
    ``shards_of([r for r in rows if keep(r)], size, max_shards)`` cuts them, ``size_for(n)`` being
    the shard size of n images (:func:`tasks.config.shard_size_for` with the stage's settings) (the same images in the
    same order: the same shard names, so resumed stages find their markers), as lists of rows,
    made one at a time from a fresh iteration of ``rows`` each time the shards are iterated.

    ``keep`` is asked once per row, when the shards are made (its answers, one byte per row, are
    kept): the shard size depends on how many rows it keeps. ``images`` counts the images of
    the shards iterated, ``len()`` the shards; :meth:`only` leaves some out (those finished)."""

    def __init__(self, rows: Iterable["ImageRecord"], size_for: Callable[[int], int],
                 keep: Callable[["ImageRecord"], bool] | None = None):
        self.rows = rows
        if keep is None:
            self._kept = None
            n = len(rows)  # type: ignore[arg-type]  (a list, or ManifestRows: its footer's count)
        else:
            self._kept = np.fromiter((bool(keep(r)) for r in rows), bool)
            n = int(self._kept.sum())
        self.kept = n  # rows in every shard together, before :meth:`only`
        self.size = size_for(n)
        self._only: frozenset[int] | None = None

    def _sizes(self) -> list[int]:
        """The number of images of each shard, in order (before :meth:`only`)."""
        return [min(self.size, self.kept - i) for i in range(0, self.kept, self.size)]

    def indices(self) -> list[int]:
        """The indices of the shards iterated."""
        every = range(len(self._sizes()))
        return [i for i in every if self._only is None or i in self._only]

    @property
    def images(self) -> int:
        sizes = self._sizes()
        return sum(sizes[i] for i in self.indices())

    def __len__(self) -> int:
        return len(self.indices())

    def kept_rows(self) -> "KeptRows":
        """The rows of every shard (before :meth:`only`), in order, read again at each iteration:
        what ``keep`` accepted when the shards were made, whatever it would say now."""
        return KeptRows(self.rows, self._kept)

    def only(self, indices: Iterable[int]) -> "Shards":
        """These shards, but only those of ``indices`` (positions among all of them)."""
        out = object.__new__(Shards)
        out.__dict__.update(self.__dict__)
        out._only = frozenset(indices) if self._only is None else self._only & frozenset(indices)
        return out

    def __iter__(self) -> Iterator[list["ImageRecord"]]:
        return self._cut(iter(self.rows))

    def ids(self) -> Iterator[list[str]]:
        """The shards as lists of image ids: for a split's rows one column read (:meth:`ManifestRows.ids`)."""
        return self._cut(self.rows.ids() if hasattr(self.rows, "ids") else (r.image_id for r in self.rows))

    def _cut(self, items: Iterator) -> Iterator[list]:
        """``items`` (one per row of :attr:`rows`) cut into the shards."""
        shard: list = []
        index = 0
        kept = self._kept
        for row, rec in enumerate(items):
            if kept is not None:
                if row >= len(kept):
                    raise RuntimeError(f"{self.rows!r}: more rows than when its shards were made: the manifest "
                                       "changed during the stage")
                if not kept[row]:
                    continue
            shard.append(rec)
            if len(shard) == self.size:
                if self._only is None or index in self._only:
                    yield shard
                shard, index = [], index + 1
        if shard and (self._only is None or index in self._only):
            yield shard


class KeptRows:
    """The rows of ``rows`` whose entry of ``kept`` is true (every row with None), re-iterable."""

    def __init__(self, rows: Iterable["ImageRecord"], kept: np.ndarray | None):
        self.rows, self.kept = rows, kept

    def __iter__(self) -> Iterator["ImageRecord"]:
        if self.kept is None:
            yield from self.rows
            return
        for row, rec in enumerate(self.rows):
            if row < len(self.kept) and self.kept[row]:
                yield rec

    def __len__(self) -> int:
        return len(self.rows) if self.kept is None else int(self.kept.sum())  # type: ignore[arg-type]


def ids_of(shard: Sequence) -> list[str]:
    """The image ids of a shard of rows or of ids."""
    return [x if isinstance(x, str) else x.image_id for x in shard]
