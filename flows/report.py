"""Pictures and tables built from a run directory."""
from __future__ import annotations

from pathlib import Path

from tasks.overlay import grid, overlay, write_png
from tasks.store import ImageRecord, Store


def overlay_grid(store: Store, records: list[ImageRecord], sources: list[tuple[str, int, str]], out: Path) -> Path:
    """One row per image: the image, each label source over it, and the ground truth if any.

    ``sources``: (title, round, stored label name) triples.
    """
    rows = []
    for rec in records:
        image = store.image(rec.image_id)
        row = [(f"{rec.image_id}: {', '.join(rec.tags)}", image)]
        for title, r, name in sources:
            label = store.pseudo(r, rec.image_id, name=name)
            if label is not None:
                row.append((title, overlay(image, label)))
        gt = store.mask(rec.image_id)
        if gt is not None:
            row.append(("ground truth", overlay(image, gt)))
        rows.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_png(out, grid(rows))
    return out
