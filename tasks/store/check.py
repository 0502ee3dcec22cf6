"""``wsseg check``: every file a run directory's records name, read whole and verified, and with
``repair`` the damaged derived data removed so that the next ``wsseg train`` (or ``wsseg refresh``)
computes exactly that again.

What is read, and what it is verified against:

* **packs** (the feature cache, each round's preliminary results, pseudo-labels and CAM labels):
  each pack's bytes against the blake2b digest its index recorded when it was written, its length
  against the index, its keys against its entries, its index against the digest of its entries
  (a pack of an older wsseg, without digests: every entry decoded); every image of a shard whose
  marker says done must have its entry (:func:`tasks.store.packs.verify`);
* **the corpus** (images, masks, corrections): its packs of images and masks as the other packs,
  every image and mask the manifest names present in one (its shape from the pack's index compared
  with the manifest's); an older run directory's per-image arrays and the corrections, every one
  the manifest or the corrections index names decoded (its zstd frame carries a checksum of its
  content) and its shape compared with the manifest's;
* **checkpoints** (the image classifier, each round's segmenter, MIL and proposal classifiers,
  training states, a benchmark's models): every zip member's CRC-32, then read as a checkpoint; a
  finished round's checkpoints must be there;
* **records**: the manifest (its pages' CRC-32 where it carries them, its rows against the split
  hashes its footer recorded), the class list, every JSON record (configuration, summaries, round
  inputs, shard markers), the review tables, the overlay pictures (their PNG CRCs).

A folder that is a symbolic link (a round or corpus shared from another run directory) belongs to
that run directory and is not read here; the Prefect and MLflow state is not the store's.

``repair`` removes what can be computed again, and makes sure the next command does: a damaged pack
is removed with its entries (from older packs too) and its shard's marker, and the round it
belongs to counts as unfinished (its ``round.json`` and the run's ``summary.json`` go), so that
``wsseg train`` computes that shard, and nothing else, again (the round's models are kept); a
damaged or missing checkpoint of a round makes the round unfinished too (its trainer computes it
again), one of the image classifier removes the summary (``train`` trains it again). What only the
source can bring back (the manifest, the class list, a pack of images or masks, an image or mask
array) is moved aside (``*.damaged``; a pack's names are dropped from the group's other packs) and
named: ``wsseg ingest SOURCE`` writes it again (its content unchanged, every
result computed from it is kept); corrections come back from their file
(``wsseg ingest --corrections PATH``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from wsseg.tasks.store import chunked, packs
from wsseg.tasks.store.damage import DamagedFileError, holds
from wsseg.tasks.store.remote import entries, is_local, listdir, replace, rmtree
from wsseg.tasks.store.run import Store, corpus_hash, valid_id

__all__ = ["check_run", "visible_damage"]

#: round groups -> the stage whose shard marker vouches for them (tasks.wsss.pipeline)
_STAGE_OF = {"prelim": "prelim", "cam": "prelim", "pseudo": "pseudo"}
_ROUND_CHECKPOINTS = ("model.pt", "mil.pt", "proposal_classifier.pt")


@dataclass
class _Finding:
    """A damaged or missing file: where, what is wrong, what to do, and what repair does."""

    path: object
    problem: str
    action: str
    holds: str | None = None  # what it holds, when more is known than its place says
    source: bool = False  # only the source (or the corrections file) brings it back
    fixes: list[Callable[[], None]] = field(default_factory=list)
    round: int | None = None  # the round that counts as unfinished once it is repaired
    summary: bool = False  # the run's summary goes too
    drop_from: int | None = None  # the rounds from this one on are removed (computed again)
    done: str = ""  # what repair did, in words


class _Checker:
    """One pass over a run directory: :attr:`found` collects the findings, :attr:`files` and
    :attr:`bytes` what was read."""

    def __init__(self, store: Store):
        self.store, self.root = store, store.root
        self.files = self.bytes = 0
        self.found: list[_Finding] = []
        self.config: dict = {}
        self.records: list | None = None

    # ------------------------------------------------------------------ helpers
    def rel(self, path) -> str:
        return self.store.relative(path)

    def add(self, path, problem: str, action: str, **kw) -> _Finding:
        f = _Finding(path, problem, action, **kw)
        self.found.append(f)
        return f

    def count(self, path) -> None:
        self.files += 1
        try:
            self.bytes += path.stat().st_size if is_local(path) else int(path.fs.size(path.path))
        except OSError:
            pass

    @staticmethod
    def derived(r: int | None) -> str:
        again = f" (round {r} is finished again)" if r is not None else ""
        return f"--repair removes it; the next `wsseg train` computes it again{again}"

    @staticmethod
    def remover(path) -> Callable[[], None]:
        def fix() -> None:
            if path.is_dir():
                rmtree(path)
            elif path.exists():
                path.unlink()
        return fix

    @staticmethod
    def aside(path) -> Callable[[], None]:
        def fix() -> None:
            if path.exists():
                target = path.with_name(path.name + ".damaged")
                if target.is_dir():
                    rmtree(target)
                elif target.exists():
                    target.unlink()
                replace(path, target)
        return fix

    def json_record(self, path, action: str, fix: Callable[[], None] | None = None, **kw) -> dict | None:
        """A JSON record read and parsed; None when there is none or it does not parse (then a
        finding, which ``fix`` repairs: by default the record is removed)."""
        if not path.exists():
            return None
        self.count(path)
        try:
            return json.loads(path.read_bytes())
        except ValueError as e:
            self.add(path, f"damaged: not readable JSON ({e})", action, fixes=[fix or self.remover(path)], **kw)
            return None

    def checkpoint(self, path, r: int | None, kind: str) -> None:
        """A torch file read whole (its zip CRCs, then as a checkpoint)."""
        from wsseg.tasks.store.checkpoints import CheckpointError, read_file

        self.count(path)
        try:
            read_file(path)
        except CheckpointError as e:
            problem = e.problem if isinstance(e, DamagedFileError) else str(e).removeprefix(f"{path}: ")
            fixes = [self.remover(path)]
            if kind == "state":
                self.add(path, problem, "--repair removes it; the unfinished training starts over", fixes=fixes)
            elif kind == "bench":
                self.add(path, problem, "--repair removes it; the benchmark that wrote it writes it again",
                         fixes=fixes)
            else:  # the image classifier (r None) or a round's model: computed again by `wsseg train`
                self.add(path, problem, self.derived(r), fixes=fixes, round=r, summary=True)

    def array(self, path, shape: tuple | None, action: str, source: bool, **kw) -> bool:
        """A single-chunk Zarr array decoded whole, its shape compared with ``shape``; False (and
        a finding) when it is missing or damaged. ``source``: a corpus array, moved aside by repair
        (else removed)."""
        meta_path = path / "zarr.json"
        fixes = [self.aside(path) if source else self.remover(path)]
        if not meta_path.exists():
            self.add(path, "missing", action, source=source, **kw)
            return False
        self.count(meta_path)
        try:
            try:
                meta = json.loads(meta_path.read_bytes())
            except ValueError as e:
                raise DamagedFileError(meta_path, f"damaged: not readable JSON ({e})") from None
            if not meta.get("attributes", {}).get("complete", False):
                raise DamagedFileError(meta_path, "not completely written (a write cut short)")
            for c in _files_under(path / "c"):
                self.count(c)
            arr = chunked.read(path, meta) if is_local(path) else None
            if arr is None:
                arr = self.store._zarr_read(path)
            if shape is not None and tuple(arr.shape) != tuple(shape):
                raise DamagedFileError(meta_path, f"damaged: holds a {tuple(arr.shape)} array where the manifest "
                                                  f"says {tuple(shape)}")
        except DamagedFileError as e:
            self.add(e.path, e.problem, action, source=source, fixes=fixes, **kw)
            return False
        return True

    # ------------------------------------------------------------------ the parts
    def run(self) -> None:
        self.run_records()
        self.corpus()
        self.cache()
        for r in self.store.rounds():
            self.round(r)
        self.checkpoints()

    def run_records(self) -> None:
        """The JSON records at the top: configuration, summary, the last refresh and error, reports."""
        actions = {"config.json": "--repair removes it; the next `wsseg train` writes it again (with the options "
                                  "you give it)", "summary.json": "--repair removes it; the next `wsseg train` writes "
                                                                  "it again"}
        for name, is_dir, _ in sorted(entries(self.root)):
            if not is_dir and name.endswith(".json"):
                d = self.json_record(self.root / name, actions.get(
                    name, "--repair removes it; the command that wrote it writes it again"))
                if name == "config.json" and isinstance(d, dict):
                    self.config = d

    def corpus(self) -> None:
        store, corpus = self.store, self.store.corpus_dir
        if _linked(corpus) or not corpus.exists():
            return
        ingest = f"only the source brings it back: `wsseg ingest SOURCE --run-dir {self.root}` (--repair moves it " \
                 "aside so that the ingest writes it again; what was computed from it is kept)"
        manifest, classes = corpus / "manifest.parquet", corpus / "classes.json"
        both = [self.aside(manifest), self.aside(classes)]  # an ingest reads either only with the other
        if manifest.exists():
            self.count(manifest)
            try:
                self.records = store.manifest()
                footer = store.corpus_summary()
            except DamagedFileError as e:
                self.add(manifest, e.problem, ingest, source=True, fixes=both)
            else:
                if footer:
                    self.footer(manifest, footer, ingest, both)
        if classes.exists():
            self.count(classes)
            try:
                store.classes()
            except DamagedFileError as e:
                self.add(classes, e.problem, ingest, source=True, fixes=both)
        self.json_record(corpus / "usage.json", "--repair counts the corpus's files again", store.record_corpus_usage)
        self.json_record(corpus / "ingest_report.json", "--repair removes it; the next `wsseg ingest` writes it again")
        corr = f"only the corrections file brings it back: `wsseg ingest --corrections PATH --run-dir {self.root}` " \
               "(--repair moves it aside; the rounds are computed again with the corrections there are)"
        index = self.json_record(corpus / "corrections.json", corr, self.aside(corpus / "corrections.json"),
                                 source=True)
        packed = {kind: self.corpus_packs(kind, ingest) for kind in ("images", "masks")}
        for rec in self.records or []:
            if valid_id(rec.image_id):
                self.corpus_entry("images", rec.image_id, (rec.height, rec.width, 3), packed["images"], ingest)
                if rec.has_mask:
                    self.corpus_entry("masks", rec.image_id, (rec.height, rec.width), packed["masks"], ingest)
        shapes = {rec.image_id: (rec.height, rec.width) for rec in self.records or []}
        for iid in sorted((index or {}).get("images", {})):
            if valid_id(iid):
                self.array(corpus / "corrections.zarr" / iid, shapes.get(iid), corr, True)

    def corpus_packs(self, kind: str, action: str) -> dict[str, tuple]:
        """The corpus's pack group ``kind`` (``images``, ``masks``) verified as the stages' groups
        are; a damaged pack is moved aside by repair and its images named: only the source brings
        them back. Returns, for each name, where its newest entry lies: ``(written, shape, pack,
        sound)``."""
        group = self.store.corpus_dir / kind
        newest: dict[str, tuple] = {}
        if not group.exists():
            return newest
        self.json_record(group / packs.INDEX_FILE, "--repair writes a new generation (the packs are kept)",
                         lambda: packs.remove_packs(group, []))
        for rec in packs.verify(group):
            for f in rec["files"]:
                self.count(group / "packs" / f)
            pack = group / "packs" / f"{rec['stem']}.pack"
            for name, e in rec["entries"].items():
                if name not in newest or rec["written"] > newest[name][0]:
                    newest[name] = (rec["written"], tuple(e[3]), pack, rec["problem"] is None)
            if rec["problem"] is None:
                continue
            path, names = group / "packs" / rec["file"], sorted(rec["names"])
            what = holds(self.rel(path)) + (f" of {len(names)} image(s): {', '.join(names[:5])}"
                                            f"{', ...' if len(names) > 5 else ''}" if names else "")
            self.add(path, rec["problem"], action, holds=what, source=True,
                     fixes=[self.pack_aside(group, rec["stem"], names)])
        return newest

    @staticmethod
    def pack_aside(group, stem: str, names: list[str]) -> Callable[[], None]:
        """Move a corpus pack's files aside (``*.damaged``) and drop its names from the group's other
        packs: an older version of an image is not read in its place, the ingest writes it again."""
        def fix() -> None:
            for suffix in (".json", ".keys", ".pack"):
                path = group / "packs" / f"{stem}{suffix}"
                if path.exists():
                    replace(path, path.with_name(path.name + ".damaged"))
            packs.remove_packs(group, [], names)
        return fix

    def corpus_entry(self, kind: str, iid: str, shape: tuple, packed: dict[str, tuple], action: str) -> None:
        """Image (or mask) ``iid`` of the manifest: in a pack (verified whole by :meth:`corpus_packs`,
        its shape from the index compared with the manifest's), or an older run directory's
        per-image array, decoded; a finding when neither holds it."""
        got = packed.get(iid)
        if got is not None:
            _, stored, pack, sound = got
            if sound and stored != tuple(shape):
                group = pack.parent.parent
                self.add(pack, f"damaged: holds a {stored} array of {iid} where the manifest says {tuple(shape)}",
                         action, holds=f"{holds(self.rel(pack))} of 1 image(s): {iid}", source=True,
                         fixes=[lambda: packs.remove_packs(group, [], [iid])])
            return
        corpus = self.store.corpus_dir
        if (corpus / f"{kind}.zarr").exists():  # an older run directory's per-image arrays
            self.array(corpus / f"{kind}.zarr" / iid, shape, action, True)
        else:
            self.add(corpus / kind / iid, "missing", action, source=True)

    def footer(self, manifest, footer: dict, action: str, fixes: list) -> None:
        """The manifest's rows against the counts and hashes of each split its footer recorded."""
        splits: dict[str, list] = {}
        for rec in self.records:
            splits.setdefault(rec.split, []).append(rec)
        now = {k: {"images": len(v), "hash": corpus_hash(v)} for k, v in splits.items()}
        if footer.get("images") != len(self.records) or footer.get("splits") != now:
            self.add(manifest, "damaged: its rows differ from the split hashes its footer recorded when it was "
                               "written", action, source=True, fixes=fixes)

    def cache(self) -> None:
        base = self.root / "cache"
        if _linked(base):
            return
        for name, is_dir, _ in sorted(entries(base)):
            if is_dir and not _linked(base / name):
                self.group(base / name, None, name)

    def images_of(self, names: list[str], r: int | None) -> list[str]:
        """The images entries ``names`` are of: a round's are image ids, the cache's ``<sha>[.part]``."""
        if r is not None:
            return sorted(set(names))
        by_sha = {rec.sha256[:24]: rec.image_id for rec in self.records or []}
        return sorted({by_sha.get(n.split(".", 1)[0], n.split(".", 1)[0]) for n in names})

    def group(self, group, r: int | None, name: str, shards: dict | None = None) -> set[str]:
        """A pack group (and an older run directory's per-image arrays beside its packs) verified;
        returns the names its packs index. ``shards``: a round's stage -> shard name -> its ids."""
        present: set[str] = set()
        stage = _STAGE_OF.get(name) if r is not None else None
        action = self.derived(r) if r is not None else \
            "--repair removes it; the next `wsseg train` (or `wsseg refresh`) computes these images' features again"
        kw = {"round": r, "summary": True} if r is not None else {}

        def markers(ids: set[str]) -> list:
            """The done markers of the shards holding ``ids`` (their shards are computed again)."""
            return [self.remover(self.store.round_dir(r) / "done" / f"{stage}-{s}.json")
                    for s, sids in (shards or {}).get(stage, {}).items() if ids & set(sids)] if stage else []

        self.json_record(group / packs.INDEX_FILE, "--repair writes a new generation (the packs are kept)",
                         lambda: packs.remove_packs(group, []))
        for rec in packs.verify(group):
            for f in rec["files"]:
                self.count(group / "packs" / f)
            present.update(rec["names"])  # a damaged pack's entries are named with it, not as missing
            if rec["problem"] is None:
                continue
            names, path = rec["names"], group / "packs" / rec["file"]
            images = self.images_of(names, r)
            what = holds(self.rel(path)) + (f" of {len(images)} image(s): {', '.join(images[:5])}"
                                            f"{', ...' if len(images) > 5 else ''}" if images else "")
            gone = set(names) | ({n.split(".", 1)[0] for n in names} if r is None else set())
            fixes = [lambda g=group, s=rec["stem"], n=gone: packs.remove_packs(g, [s], n)] + markers(set(names))
            if stage:  # the marker of the shard that wrote it, found by the pack's name
                shard = rec["stem"].rsplit(".", 1)[0]
                fixes.append(self.remover(self.store.round_dir(r) / "done" / f"{stage}-{shard}.json"))
            self.add(path, rec["problem"], action, holds=what, fixes=fixes, **kw)
        for aname, is_dir, _ in sorted(entries(group)):  # an older wsseg's per-image arrays
            if is_dir and aname != "packs" and (group / aname / "zarr.json").exists():
                if self.array(group / aname, None, action, False, **kw):
                    present.add(aname)
                else:
                    self.found[-1].fixes += markers({aname})
        return present

    def round_shards(self, r: int, inputs: dict | None) -> dict[str, dict[str, list[str]]]:
        """Stage -> shard name -> ids of round ``r``'s shards that have a done marker. A shard's
        name is its first id, its size and a hash of its ids (:meth:`Store.shard_name`): its ids
        are the manifest's rows of the round's split from that first one on, where the hash agrees
        (a marker of a corpus since changed names no images of today's)."""
        if not self.records:
            return {}
        split = ((inputs or {}).get("config") or {}).get("split", self.config.get("split", "train"))
        ids = [rec.image_id for rec in self.records if rec.split == split]
        where = {iid: i for i, iid in enumerate(ids)}
        out: dict[str, dict[str, list[str]]] = {}
        for name in listdir(self.store.round_dir(r) / "done"):
            stage, _, shard = name.removesuffix(".json").partition("-")
            first, _, rest = shard.rpartition(".")[0].rpartition(".")
            if stage not in ("prelim", "pseudo") or first not in where or not rest.isdigit():
                continue
            part = ids[where[first]:where[first] + int(rest)]
            if Store.shard_name(part) == shard:
                out.setdefault(stage, {})[shard] = part
        return out

    def round(self, r: int) -> None:
        store, folder = self.store, self.store.round_dir(r)
        if _linked(folder):
            return
        again, kw = self.derived(r), {"round": r, "summary": True}
        summary = self.json_record(store.round_summary_path(r), again, **kw)
        inputs = self.json_record(folder / "inputs.json", f"--repair removes round {r} and the later ones; the next "
                                  "`wsseg train` computes them again (what it was computed from is unknown)",
                                  summary=True, drop_from=r)
        for name in sorted(listdir(folder / "done")):
            if name.endswith(".json") and not name.startswith("."):
                self.json_record(folder / "done" / name, again, **kw)
        shards = self.round_shards(r, inputs)
        for name in sorted(listdir(folder / "review")):
            if name.endswith(".parquet") and not name.startswith("."):
                path = folder / "review" / name
                self.count(path)
                try:
                    store.read_table(path)
                except DamagedFileError as e:  # its shard is labelled again, its signals with it
                    self.add(path, e.problem, again, fixes=[self.remover(path), self.remover(
                        folder / "done" / f"pseudo-{name[:-len('.parquet')]}.json")], **kw)
        present: dict[str, set[str]] = {}
        for name, is_dir, _ in sorted(entries(folder)):
            if is_dir and name not in ("done", "review") and not _linked(folder / name):
                base = name.removesuffix(".zarr")
                present.setdefault(base, set()).update(self.group(folder / name, r, base, shards))
        for gname, stage in _STAGE_OF.items():  # a shard marked done has its entry of each image
            if gname == "cam" and (r != 0 or "cam" not in present):
                continue
            for sname, ids in shards.get(stage, {}).items():
                missing = [i for i in ids if i not in present.get(gname, set())]
                if missing:
                    self.add(folder / gname, f"missing: the entries of {len(missing)} image(s) of a shard marked "
                                             f"done ({', '.join(missing[:5])})", again,
                             fixes=[self.remover(folder / "done" / f"{stage}-{sname}.json")], **kw)
        for name in sorted(listdir(folder)):
            if name.endswith(".pt"):
                self.checkpoint(folder / name, r, "state" if name.endswith(".train_state.pt") else "round")
        if isinstance(summary, dict):
            for name in _expected(store, r, summary, inputs):
                if not (folder / name).exists():
                    self.add(folder / name, "missing", f"--repair marks round {r} unfinished; the next `wsseg train` "
                                                       "computes it again", **kw)
        if (folder / "overlay.png").exists():
            self.picture(folder / "overlay.png", r)

    def picture(self, path, r: int) -> None:
        """A PNG decoded whole (its chunks' CRCs checked)."""
        from PIL import Image

        self.count(path)
        try:
            with Image.open(path) as im:
                im.verify()
            with Image.open(path) as im:
                im.load()
        except Exception as e:  # PIL raises many kinds for a damaged file: each means the same here
            self.add(path, f"damaged: not a readable PNG ({type(e).__name__}: {e})", self.derived(r), round=r,
                     summary=True, fixes=[self.remover(path)])

    def checkpoints(self) -> None:
        """The run's own torch files: the image classifier (which a finished training must have),
        training states, a benchmark's models."""
        root = self.root
        for name in sorted(listdir(root)):
            if name.endswith(".pt"):
                self.checkpoint(root / name, None, "state" if name.endswith(".train_state.pt") else "classifier")
        if (root / "summary.json").exists() and not (root / "classifier.pt").exists():
            self.add(root / "classifier.pt", "missing", "--repair removes the run's summary; the next `wsseg train` "
                                                        "trains it again", summary=True)
        for folder in ("supervised", "models"):
            if not _linked(root / folder):
                for name in sorted(listdir(root / folder)):
                    if name.endswith(".pt"):
                        self.checkpoint(root / folder / name, None,
                                        "state" if name.endswith(".train_state.pt") else "bench")

    # ------------------------------------------------------------------ repair
    def repair(self) -> None:
        """Apply every finding's fixes, then make the rounds and the run they touch unfinished."""
        store = self.store
        rounds = {f.round for f in self.found if f.round is not None}
        again = "the next `wsseg train` computes it again"
        for f in self.found:
            for fix in f.fixes:
                fix()
            if f.source:
                f.done = "moved aside" if f.fixes else ""
            elif f.drop_from is not None:
                gone = store.drop_rounds(f.drop_from)
                f.done = f"removed with round(s) {', '.join(map(str, gone)) or f.drop_from}; {again}"
            elif f.fixes:
                f.done = f"removed; {again}"
            elif f.round is not None or f.summary:
                where = f"round {f.round}" if f.round is not None else "the run"
                f.done = f"{where} marked unfinished; {again}"
        for r in sorted(rounds):
            path = store.round_summary_path(r)
            if path.exists():
                path.unlink()
        if any(f.summary for f in self.found) and store.summary_path.exists():
            store.summary_path.unlink()
        if any(f.source and f.fixes for f in self.found) and store.corpus_dir.exists():
            store.record_corpus_usage()
        packs.forget()


def _expected(store: Store, r: int, summary: dict, inputs: dict | None) -> list[str]:
    """The checkpoints finished round ``r`` must have: its proposal classifier, its MIL classifier
    when MIL was on, its segmenter when it trained one (a later round started from it, the run's
    summary names it, or the round's summary says it trained it)."""
    want = ["proposal_classifier.pt"]
    if (((inputs or {}).get("config") or {}).get("mil") or {}).get("iterations", 1):
        want.append("mil.pt")
    try:
        final = (store.read_summary() or {}).get("final_model")
    except DamagedFileError:
        final = None
    if (summary.get("train_epochs") is not None or any(x > r for x in store.finished_rounds())
            or final == str(store.round_dir(r) / "model.pt")):
        want.append("model.pt")
    return want


def _files_under(folder) -> list:
    out = []
    for name, is_dir, _ in entries(folder):
        out.extend(_files_under(folder / name) if is_dir else [folder / name])
    return out


def _linked(path) -> bool:
    """Whether ``path`` is a symbolic link (a part shared from another run directory)."""
    return is_local(path) and Path(path).is_symlink()


def check_run(store: Store, repair: bool = False) -> dict:
    """Read and verify every file ``store``'s records name (see the module's docstring); with
    ``repair``, remove the damaged derived data (and move aside the damaged corpus files) so that
    the next ``wsseg train`` or ``wsseg refresh`` computes exactly that again.

    Returns plain data (what ``wsseg check --json`` prints): ``run_dir``; ``files`` and ``bytes``
    read; ``damaged``, one dict per damaged or missing file (``path`` relative to the run
    directory, ``holds``, ``problem``, ``action``); ``repaired`` (``path`` and ``done``, with
    ``repair``); ``from_source``, the files only ``wsseg ingest`` of the source or of the
    corrections file brings back (``path``, ``holds``, ``action``); ``ok``: nothing damaged is
    left."""
    c = _Checker(store)
    c.run()
    if repair:
        c.repair()
    out = {"run_dir": str(store.root), "files": c.files, "bytes": c.bytes, "damaged": [], "repaired": [],
           "from_source": [], "ok": True}
    for f in c.found:
        rel = c.rel(f.path)
        d = {"path": rel, "holds": f.holds or holds(rel), "problem": f.problem, "action": f.action}
        out["damaged"].append(d)
        if f.source:
            out["from_source"].append({k: d[k] for k in ("path", "holds", "action")})
        elif f.done:
            out["repaired"].append({"path": rel, "done": f.done})
        if f.source or not f.done:
            out["ok"] = False
    return out


def visible_damage(store: Store) -> list[dict]:
    """What ``wsseg status`` sees without reading every byte: the records that do not parse
    (configuration, summaries, the class list, the manifest's footer, each round's summary and
    inputs) and the checkpoints a finished round or training must have that are missing or whose
    zip directory does not read (a file cut short). One dict each: ``path`` (relative),
    ``holds``, ``problem``."""
    import zipfile

    out: list[dict] = []
    root = store.root

    def note(path, problem: str) -> None:
        rel = Path(str(path)).relative_to(str(root)).as_posix()
        out.append({"path": rel, "holds": holds(rel), "problem": problem})

    def parse(path) -> dict | None:
        if not path.exists():
            return None
        try:
            return json.loads(path.read_bytes())
        except ValueError as e:
            note(path, f"damaged: not readable JSON ({e})")
            return None

    def torch_file(path, needed: bool) -> None:
        if not path.exists():
            if needed:
                note(path, "missing")
            return
        try:
            with path.open("rb") as f, zipfile.ZipFile(f):
                pass
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            note(path, f"damaged: not a readable checkpoint ({type(e).__name__}: {e})")

    records = {name: parse(root / name) for name in ("config.json", "summary.json", "refresh.json",
                                                     "last_error.json")}
    for name in ("classes.json", "corrections.json", "usage.json"):
        parse(store.corpus_dir / name)
    if store.has_corpus():
        try:
            store.corpus_summary()
        except DamagedFileError as e:
            note(store.corpus_dir / "manifest.parquet", e.problem)
    torch_file(root / "classifier.pt", records["summary.json"] is not None)
    for r in store.rounds():
        if _linked(store.round_dir(r)):
            continue
        done, inputs = parse(store.round_summary_path(r)), parse(store.round_dir(r) / "inputs.json")
        want = _expected(store, r, done, inputs) if isinstance(done, dict) else []
        for name in _ROUND_CHECKPOINTS:
            torch_file(store.round_dir(r) / name, name in want)
    return out
