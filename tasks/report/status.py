"""Where a run directory stands, read from the store alone (``wsseg status``): nothing is started,
nothing is written. Damage it sees on the way (a record that does not parse, a checkpoint missing
or cut short: :func:`tasks.store.check.visible_damage`) is listed with the ``wsseg check`` that
reads every byte."""
from __future__ import annotations

from wsseg.tasks.config import WSSSConfig, shard_size_for
from wsseg.tasks.store import DamagedFileError, Store


def _live_writer(store: Store) -> dict | None:
    """The lock holder's record while its process lives (a stale record names no writer)."""
    import os
    import socket

    w = store.lock("wsseg status").holder()
    if not w.get("pid"):
        return None
    if w.get("host") == socket.gethostname():
        try:
            os.kill(int(w["pid"]), 0)
        except (ProcessLookupError, ValueError):
            return None
        except PermissionError:
            pass
    return w


def _refresh_state(store: Store, config: dict, finished: list[int], summary: dict | None) -> dict:
    """``refresh``: the last `wsseg refresh`'s record; ``stale``: what changed since the last
    finished round was computed (class list, corpus, configuration: `wsseg train` recomputes);
    ``refresh_pending``: images of its split without its pseudo-label (`wsseg refresh` labels
    them), looked up only when the corpus changed since the round."""
    from wsseg.tasks.config import WSSSConfig, without_removed
    from wsseg.tasks.corpus.resume import round_inputs, round_view, what_changed
    from wsseg.tasks.labels.corrections import corrections_entry
    from wsseg.tasks.store import corpus_hash

    out: dict = {"refresh": store.read_json("refresh"), "stale": [], "refresh_pending": None}
    if not finished:
        return out
    r = finished[-1]
    try:
        cfg = WSSSConfig.model_validate(without_removed(config))
    except ValueError:
        return out
    split = (summary or {}).get("splits", {}).get(cfg.split)
    # the manifest's rows are read only when its footer does not say (an older one), when the run
    # has corrections (which of them are of this split) and when something changed
    records = store.manifest(cfg.split) if summary is None or store.corrections() else None
    corpus = split if records is None else records
    if corpus is None:  # the split is empty now
        corpus = {"hash": corpus_hash([]), "images": 0}
    recorded = store.round_inputs(r)
    now = round_inputs(store.classes(), corpus, cfg, corrections_entry(store, records) if records else None)
    out["stale"] = what_changed(round_view(recorded, r), round_view(now, r))
    if out["stale"]:
        records = store.manifest(cfg.split) if records is None else records
        pending = sum(not store.has_pseudo(r, rec.image_id) for rec in records)
        out["refresh_pending"] = {"round": r, "images": pending} if pending else None
    return out


def run_status(store: Store) -> dict:
    """The corpus (images, classes, splits), the finished rounds with their metrics, the shards done
    and pending of a round in progress, the store's size, the holder of its lock, the last error
    and the damaged files seen on the way (``damaged``: path, what it holds, the problem)."""
    from wsseg.tasks.store.check import visible_damage

    usage = store.usage()
    damaged = visible_damage(store)
    out: dict = {"run_dir": str(store.root), "corpus": None, "rounds": [], "in_progress": None,
                 "size_mb": round(sum(v["bytes"] for v in usage.values()) / 2 ** 20, 1),
                 "files": sum(v["files"] for v in usage.values()), "usage": usage, "last_error": None,
                 "writer": _live_writer(store), "damaged": damaged}
    out["last_error"] = _unless_damaged(store.last_error)
    try:
        _status(store, out)
    except DamagedFileError as e:  # a file read past what visible_damage looks at: named, the rest left out
        from pathlib import Path

        from wsseg.tasks.store.damage import holds

        path = Path(e.path)
        rel = path.relative_to(store.root).as_posix() if path.is_relative_to(str(store.root)) else e.path
        if not any(d["path"] == rel for d in damaged):
            damaged.append({"path": rel, "holds": e.what or holds(rel), "problem": e.problem})
    return out


def _unless_damaged(read):
    """``read()``, or None when the record is damaged (:func:`tasks.store.check.visible_damage` names it)."""
    try:
        return read()
    except DamagedFileError:
        return None


def _status(store: Store, out: dict) -> None:
    """:func:`run_status`'s parts read from the corpus, the rounds and the summaries, into ``out``."""
    if store.remote:  # what cannot live on object storage (MLflow, Prefect, the lock's flock) lies here
        out["state_dir"] = str(store.state_dir)
    if not store.has_corpus():
        return
    # counts from the manifest's footer (nothing per image read); an older manifest is read whole
    summary = store.corpus_summary()
    if summary is None:
        splits: dict[str, int] = {}
        for rec in store.manifest():
            splits[rec.split] = splits.get(rec.split, 0) + 1
        summary = {"images": sum(splits.values()), "splits": {k: {"images": v} for k, v in splits.items()}}
        recorded = None
    else:
        recorded = summary
    splits = {k: v["images"] for k, v in summary["splits"].items()}
    classes = store.classes()
    out["corpus"] = {"images": summary["images"], "classes": len(classes.names), "splits": splits,
                     "implicit_background": classes.names[classes.background] if classes.background is not None
                     else None, "corrected": len(store.corrections())}
    config = _unless_damaged(store.read_config) or {}
    finished = store.finished_rounds()
    seen = {d["path"] for d in out["damaged"]}
    for r in finished:
        if store.relative(store.round_summary_path(r)) in seen:
            continue
        s = store.read_round(r, aside=False) or {}
        out["rounds"].append({k: s.get(k) for k in ("round", "pseudo_label_miou", "changed_share", "ignore_share",
                                                    "tag_coverage", "wall_seconds", "train_epochs")})
    unfinished = [r for r in store.rounds() if r not in finished]
    if unfinished:
        r = unfinished[-1]
        n = splits.get(config.get("split", "train"), 0)
        defaults = WSSSConfig.model_fields
        size = shard_size_for(n, int(config.get("shard_size", defaults["shard_size"].default)),
                              int(config.get("max_shards", defaults["max_shards"].default)))
        shards = -(-n // size)
        done = {stage: len(store.shard_markers(r, stage)) for stage in ("prelim", "pseudo")}
        out["in_progress"] = {"round": r, "shards": shards,
                              "done": done, "pending": {k: shards - v for k, v in done.items()},
                              "model_trained": store.has_checkpoint("segmenter", r)}
    if store.relative(store.config_path) not in seen:  # without the run's configuration nothing compares with it
        out.update(_refresh_state(store, config, finished, recorded))
    run_summary = _unless_damaged(store.read_summary)
    if run_summary:
        out["final_model"] = run_summary.get("final_model")
        out["converged"] = run_summary.get("converged")
        out["final_round"] = run_summary.get("final_round")
        out["stop_reason"] = run_summary.get("stop_reason")


def format_status(st: dict) -> str:
    """The status as lines for the terminal."""
    lines = [f"run directory {st['run_dir']} ({st['size_mb']} MB in {st['files']} files)"]
    if st.get("state_dir"):
        lines.append(f"local state (Prefect, MLflow, lock): {st['state_dir']}")
    c = st["corpus"]
    lines.append("corpus: none (run `wsseg ingest`)" if c is None else
                 f"corpus: {c['images']} images, {c['classes']} classes, splits {c['splits']}, implicit background "
                 f"{c['implicit_background']}" + (f"; {c['corrected']} image(s) corrected by a person (wsseg ingest "
                                                  "--corrections)" if c.get("corrected") else ""))
    from wsseg.tasks.common.metrics import tag_share

    for r in st["rounds"]:
        f = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        lines.append(f"round {r['round']}: pseudo-label mIoU {f(r['pseudo_label_miou'])}, changed "
                     f"{f(r['changed_share'])}, ignore {f(r['ignore_share'])}, tag share "
                     f"{f(tag_share(r.get('tag_coverage')))}")
    p = st["in_progress"]
    if p:
        lines.append(f"round {p['round']} in progress: preliminary {p['done']['prelim']}/{p['shards']} shards, "
                     f"pseudo-labels {p['done']['pseudo']}/{p['shards']}, model {'trained' if p['model_trained'] else 'not yet'}")
    if st.get("stale"):
        lines.append(f"changed since the last round: {'; '.join(st['stale'])} (`wsseg train` recomputes)")
    if st.get("refresh_pending"):
        p = st["refresh_pending"]
        lines.append(f"{p['images']} image(s) without a round-{p['round']} pseudo-label: `wsseg refresh` labels them")
    if st.get("refresh"):
        f = st["refresh"]
        lines.append(f"last refresh ({f.get('at')}): {f.get('labelled')} image(s) labelled with round {f.get('round')}'s "
                     f"models, {f.get('core_ms_per_image', 0):.0f} core-ms per image")
    if st.get("final_round") is not None:
        lines.append(f"final labels: round {st['final_round']} ({st.get('stop_reason')})")
    if st.get("final_model"):
        lines.append(f"final model: {st['final_model']} (converged: {st.get('converged')})")
    if st["writer"]:
        w = st["writer"]
        lines.append(f"written now by pid {w.get('pid')} on {w.get('host')} since {w.get('started')} ({w.get('command')})")
    if st["last_error"]:
        e = st["last_error"]
        lines.append(f"last error ({e['command']}, {e['at']}): {e['error']}")
    for d in st.get("damaged") or []:
        lines.append(f"damaged: {d['path']}: {d['problem']} ({d['holds']})")
    if st.get("damaged"):
        lines.append(f"`wsseg check --run-dir {st['run_dir']}` reads every file and says what to do")
    return "\n".join(lines)
