"""A split's manifest rows streamed, and cut into shard tasks without holding them all.

A flow that read the manifest whole held about 630 bytes of :class:`ImageRecord` per image (6.3 GB
at 10^7 images) for as long as its stages ran. :class:`ManifestRows` stands for one split's rows
and reads them again, a Parquet batch at a time (:meth:`Store.manifest_records`), each time it is
iterated; :class:`Shards` cuts any such rows (or a list) into the shards
:func:`flows.wsss.shards_of` makes of the same rows, one shard at a time, so that a stage's tasks
can be submitted while the rows of the shards not yet submitted are still on disk.

The other way, :class:`ManifestWriter` writes a new manifest a shard's records at a time (an
ingest's shards, put back in the source's order by :class:`InOrder` as they finish): a flow that
gathered every shard's records first held about 6 KB an image.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, Sequence

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


def corpus_line(image_id: str, sha256: str, tags: Iterable[str], split: str) -> bytes:
    """What a corpus hash takes of one record (:func:`tasks.store.run.corpus_hash`,
    :class:`ManifestWriter`'s footer): its id, file sha256, tags and split."""
    return f"{image_id}\t{sha256}\t{';'.join(tags)}\t{split}\n".encode()


def ids_of(shard: Sequence) -> list[str]:
    """The image ids of a shard of rows or of ids."""
    return [x if isinstance(x, str) else x.image_id for x in shard]


class ManifestWriter:
    """A corpus manifest written a shard's records at a time, in the order they are added, so that
    its writer (the ingest flow) never holds more than one row group of them: rows go out in
    groups of ``row_group`` (:attr:`Store.ROW_GROUP`); the footer's summary (the images of each
    split and their :func:`corpus_hash`, which `wsseg status` reads without a row) is accumulated
    on the way and written by :meth:`close`.

    ``path``: the file, local or on object storage (written as it goes, as one object); ``schema``:
    the manifest's (:data:`tasks.store.run.MANIFEST_SCHEMA`, given by the store). An ingest
    writes it into its staging area and :meth:`Store.publish_manifest` puts it in place once the
    ingest is accepted. Records are :class:`ImageRecord` or dicts of its fields (tags as a list or
    tuple)."""

    def __init__(self, path, schema, row_group: int):
        import pyarrow.parquet as pq

        from wsseg.tasks.store.remote import is_local

        self.schema, self.row_group = schema, row_group
        if is_local(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = None
        else:
            self._file = path.fs.open(path.path, "wb")
        self._writer = pq.ParquetWriter(str(path) if self._file is None else self._file, schema,
                                        write_page_checksum=True)
        self._rows: list[dict] = []
        self._hash: dict[str, Any] = {}
        self._count: dict[str, int] = {}

    def add(self, records: Iterable) -> None:
        import hashlib

        for r in records:
            r = dict(r.__dict__) if hasattr(r, "__dict__") else dict(r)
            r["tags"] = list(r["tags"])
            split = r["split"]
            if split not in self._hash:
                self._hash[split], self._count[split] = hashlib.sha256(), 0
            # corpus_hash's digest (tasks.store.run.corpus_hash), record by record
            self._hash[split].update(corpus_line(r["image_id"], r["sha256"], r["tags"], split))
            self._count[split] += 1
            self._rows.append(r)
            if len(self._rows) == self.row_group:
                self._flush()

    def _flush(self) -> None:
        import pyarrow as pa

        if self._rows:
            table = pa.Table.from_pylist(self._rows, schema=self.schema)
            self._writer.write_table(table, row_group_size=self.row_group)
            self._rows = []

    @property
    def summary(self) -> dict:
        """``{"images": n, "splits": {split: {"images": k, "hash": corpus_hash}}}`` of the rows added."""
        return {"images": sum(self._count.values()),
                "splits": {k: {"images": self._count[k], "hash": h.hexdigest()[:16]} for k, h in self._hash.items()}}

    def close(self) -> dict:
        """Write the last rows and the footer; returns :attr:`summary`."""
        import json

        self._flush()
        self._writer.add_key_value_metadata({"wsseg": json.dumps(self.summary)})
        self._writer.close()
        if self._file is not None:
            self._file.close()
        return self.summary

    def abort(self) -> None:
        """Close the file unfinished (an ingest that failed: :meth:`Store.drop_staged` removes it)."""
        for close in (self._writer.close, *(() if self._file is None else (self._file.close,))):
            try:
                close()
            except Exception:  # noqa: BLE001  (a writer that failed half-way: its file is discarded)
                pass


class InOrder:
    """Hands ``sink`` the items given to :meth:`put` by position (0, 1, 2, ...) in that order, each
    as soon as every one before it has come: shards finish in any order, their records go into
    the manifest in the source's. Holds only the items that came ahead of a missing one."""

    def __init__(self, sink: Callable[[Any], None]):
        self.sink, self.next, self.waiting = sink, 0, {}

    def put(self, position: int, item: Any) -> None:
        if position < self.next or position in self.waiting:
            raise ValueError(f"position {position} given twice")
        self.waiting[position] = item
        while self.next in self.waiting:
            self.sink(self.waiting.pop(self.next))
            self.next += 1
