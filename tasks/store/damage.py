"""Damaged files of a run directory: the error the store's readers raise, and what each file holds.

A file is *damaged* when it does not read back as it was written: a zstd frame whose checksum or
structure fails (packs, the corpus's arrays), a pack whose bytes differ from the digest its index
recorded or that is cut short, a torch file whose zip CRC fails, a Parquet page whose CRC fails, a
JSON record that does not parse. Each reader raises :class:`DamagedFileError` (a ``ValueError``:
the CLI prints it as one line) naming the file, what it holds (:func:`holds`) and, for a file of a
run directory, the ``wsseg check`` that lists every damaged file of it and says what to do
(:mod:`tasks.store.check`). Nothing here reads a file but the few ``stat`` calls that find the
run directory a path lies in.
"""
from __future__ import annotations

import re
from pathlib import Path

__all__ = ["DamagedFileError", "holds", "run_root_of"]

_ROUND_ARRAYS = {"prelim": "preliminary results", "pseudo": "pseudo-labels", "cam": "CAM labels"}
_ROUND_FILES = {"model.pt": "segmentation model", "mil.pt": "superpixel MIL classifier",
                "proposal_classifier.pt": "proposal classifier", "round.json": "summary",
                "inputs.json": "record of what it was computed from", "overlay.png": "overlay picture"}
_RUN_FILES = {"classifier.pt": "the image classifier", "config.json": "the run's configuration",
              "summary.json": "the table of rounds", "refresh.json": "the record of the last `wsseg refresh`",
              "last_error.json": "the record of the last error", "corpus/manifest.parquet":
              "the corpus manifest (ids, tags, splits and hashes of the images)", "corpus/classes.json":
              "the class list", "corpus/usage.json": "the corpus's file count", "corpus/corrections.json":
              "the index of a person's corrected labels", "corpus/ingest_report.json": "the last ingest's report",
              "supervised/model.pt": "the supervised reference model of `wsseg bench quality`"}


def holds(rel: str) -> str:
    """What the file at ``rel`` (a path relative to its run directory, with ``/``) holds, in words.

    >>> holds("rounds/r002/pseudo/packs/a.1.x.pack"), holds("corpus/images.zarr/img7/c/0/0/0")
    ("round 2's pseudo-labels", 'image img7')
    >>> holds("corpus/images/packs/a.1.x.pack"), holds("corpus/masks/img7")
    ("the corpus's images", 'the ground-truth mask of image img7')
    """
    parts = rel.split("/")
    if rel in _RUN_FILES:
        return _RUN_FILES[rel]
    if len(parts) >= 3 and parts[0] == "corpus" and parts[1].endswith(".zarr"):
        kind, iid = parts[1][:-len(".zarr")], parts[2]
        return {"images": f"image {iid}", "masks": f"the ground-truth mask of image {iid}",
                "corrections": f"a person's corrected labels of image {iid}"}.get(kind, f"corpus array {kind}/{iid}")
    if len(parts) >= 3 and parts[0] == "corpus" and parts[1] in ("images", "masks"):
        if parts[2] == "packs":
            return "the corpus's images" if parts[1] == "images" else "the corpus's ground-truth masks"
        return f"image {parts[2]}" if parts[1] == "images" else f"the ground-truth mask of image {parts[2]}"
    if parts[0] == "corpus" and len(parts) > 1 and parts[1] == "staging":
        return "an ingest's staged packs (not yet accepted)"
    if parts[0] == "cache" and len(parts) > 1:
        return f"feature-cache entries ({parts[1]})"
    m = re.fullmatch(r"r(\d{3})", parts[1]) if parts[0] == "rounds" and len(parts) > 2 else None
    if m:
        r, name = int(m.group(1)), parts[2]
        if name.removesuffix(".zarr") in _ROUND_ARRAYS or (len(parts) > 3 and parts[3] == "packs"):
            base = name.removesuffix(".zarr")
            return f"round {r}'s {_ROUND_ARRAYS.get(base, base + ' labels')}"
        if name == "done":
            return f"a finished-shard marker of round {r}"
        if name == "review":
            return f"round {r}'s review-queue signals"
        if name.endswith(".train_state.pt"):
            return f"the state of round {r}'s unfinished training"
        if name in _ROUND_FILES:
            return f"round {r}'s {_ROUND_FILES[name]}"
    if rel.endswith(".train_state.pt"):
        return "the state of an unfinished training"
    if parts[0] == "models" and rel.endswith(".pt"):
        return f"a benchmark's model ({parts[-1]})"
    return "a file of the run directory"


def run_root_of(path) -> Path | None:
    """The local run directory ``path`` lies in (the nearest folder above it holding ``corpus/``
    or ``config.json``), or None (a file elsewhere, or on object storage)."""
    from wsseg.tasks.store.remote import is_local

    if not is_local(path):
        return None
    path = Path(path)
    for folder in path.parents:
        if (folder / "corpus" / "manifest.parquet").exists() or (folder / "config.json").is_file():
            return folder
    return None


class DamagedFileError(ValueError):
    """A file that does not read back as it was written. ``path``: the file; ``problem``: what is
    wrong with it, in words; ``what``: what it holds (from its place in the run directory when not
    given); ``root``: its run directory (found from ``path`` when not given), which the message
    tells to check. One line."""

    def __init__(self, path, problem: str, what: str | None = None, root=None):
        self.path, self.problem = str(path), " ".join(problem.split())  # a library's message may span lines
        self.root = root if root is not None else run_root_of(path)
        if what is None and self.root is not None:
            try:
                what = holds(Path(path).relative_to(self.root).as_posix())
            except ValueError:
                what = None
        self.what = what
        hint = (f"; `wsseg check --run-dir {self.root}` lists every damaged file of the run directory and "
                "what to do" if self.root is not None else "")
        super().__init__(f"{path}: {self.problem}" + (f" ({what})" if what else "") + hint)

    def __reduce__(self):  # raised in a Dask worker, it reaches the flow pickled
        return type(self), (self.path, self.problem, self.what, self.root)
