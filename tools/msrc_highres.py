"""Build the high-resolution context benchmark of ``wsseg bench highres`` from msrc21.

Every photo of the chosen splits is upscaled by ``--upscale`` (bicubic) and its mask by the same
factor (nearest, so void 255 stays void and class boundaries stay where they were), so that a
256-pixel patch at working scale 1 sees only a small part of the scene: at 6x a 320 x 213 photo
becomes 1920 x 1278 and a patch covers 43 x 43 of its original pixels (an eighth of its width),
where sky, water, grass, road and building look alike without the rest of the image.  The
output folder has the dataset layout ``wsseg bench highres`` and ``wsseg ingest`` read:
``images/<id>.jpg``, ``masks/<id>.png`` (palette PNG, class index, 255 void), ``classes.txt``,
``labels.csv`` (the original tags) and ``<split>.txt``, plus ``corpus.json`` (how it was built).

    python tools/msrc_highres.py --src ../shared/data/msrc21 --out /tmp/msrc21_x6 --upscale 6

Writes nothing into the source folder; an existing output folder is refused unless it was built
with the same options (then finished images are kept), so an interrupted build resumes.
"""
from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def upscale_pair(image: np.ndarray, mask: np.ndarray, factor: int) -> tuple[np.ndarray, np.ndarray]:
    """(H, W, 3) uint8 image and (H, W) uint8 mask -> (f H, f W, 3) bicubic and (f H, f W) nearest."""
    import cv2
    if mask.shape != image.shape[:2]:
        raise ValueError(f"mask {mask.shape} and image {image.shape[:2]} differ in size")
    size = (image.shape[1] * factor, image.shape[0] * factor)
    big = cv2.resize(image, size, interpolation=cv2.INTER_CUBIC)
    return big, np.repeat(np.repeat(mask, factor, 0), factor, 1)


def _write_mask(path: Path, mask: np.ndarray, palette: list[int]) -> None:
    """A palette PNG of class indices (PIL: much faster than the streaming writer at this size)."""
    from PIL import Image
    im = Image.fromarray(mask, mode="P")
    im.putpalette(palette)
    tmp = path.with_suffix(".tmp.png")
    im.save(tmp, optimize=False)
    tmp.rename(path)


def build(src: Path, out: Path, factor: int, splits: list[str], quality: int = 95) -> dict:
    """Write the upscaled corpus into ``out``; returns what ``corpus.json`` records."""
    from wsseg.tasks.store import files

    if factor < 1:
        raise ValueError(f"--upscale must be >= 1, got {factor}")
    if src.resolve() == out.resolve():
        raise ValueError(f"--out {out} is the source folder")
    spec = {"source": str(src.resolve()), "upscale": factor, "splits": splits, "jpeg_quality": quality,
            "image_interpolation": "bicubic", "mask_interpolation": "nearest"}
    record = out / "corpus.json"
    if out.exists() and any(out.iterdir()):
        old = json.loads(record.read_text()) if record.exists() else None
        if old is None or {k: old.get(k) for k in spec} != spec:
            raise ValueError(f"{out} exists and was not built with these options ({record}); remove it or "
                             "choose another --out")
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "masks").mkdir(exist_ok=True)
    if not record.exists():
        files.write_json(record, spec)          # the options first: an interrupted build resumes with them
    classes = (src / "classes.txt").read_text().split()
    palette = files.palette(len(classes))
    ids: dict[str, list[str]] = {s: files.dataset_ids(src, s) for s in splits}
    t0, done, n = time.perf_counter(), 0, sum(len(v) for v in ids.values())
    for split, split_ids in ids.items():
        for i in split_ids:
            img_out, mask_out = files.dataset_image_path(out, i), files.dataset_mask_path(out, i)
            done += 1
            if img_out.exists() and mask_out.exists():
                continue
            image = files.read_image(files.dataset_image_path(src, i))
            mask = files.read_mask(files.dataset_mask_path(src, i))
            try:
                big, big_mask = upscale_pair(image, mask, factor)
            except ValueError as e:
                raise ValueError(f"{files.dataset_mask_path(src, i)}: {e}") from None
            _write_mask(mask_out, big_mask, palette)
            files.write_jpeg(img_out.with_suffix(".tmp.jpg"), big, quality).rename(img_out)
            if done % 50 == 0 or done == n:
                print(f"  {done}/{n} images ({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    for split, split_ids in ids.items():
        (out / f"{split}.txt").write_text("\n".join(split_ids) + "\n")
    shutil.copyfile(src / "classes.txt", out / "classes.txt")
    keep = {i for v in ids.values() for i in v}
    with open(src / "labels.csv", newline="") as f_in, open(out / "labels.csv", "w", newline="") as f_out:
        reader = csv.DictReader(f_in)
        writer = csv.DictWriter(f_out, fieldnames=reader.fieldnames)
        writer.writeheader()
        writer.writerows(r for r in reader if r["image_id"] in keep)
    sizes = sorted({tuple(files.read_image(files.dataset_image_path(out, v[0]), 0.125).shape[:2]) for v in
                    ids.values()})
    spec |= {"images": {s: len(v) for s, v in ids.items()}, "classes": classes,
             "example_size_at_1_8": [list(s) for s in sizes]}
    files.write_json(record, spec)
    return spec


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", type=Path, required=True, help="msrc21-layout folder (images/, masks/, classes.txt, "
                                                             "labels.csv, <split>.txt)")
    ap.add_argument("--out", type=Path, required=True, help="output folder (created; never inside --src)")
    ap.add_argument("--upscale", type=int, default=6, help="integer upscaling factor (default 6: 320 x 213 -> "
                                                            "1920 x 1278)")
    ap.add_argument("--splits", nargs="+", default=["train", "val"], help="id lists to convert (default train val)")
    ap.add_argument("--quality", type=int, default=95, help="JPEG quality of the upscaled images (default 95)")
    args = ap.parse_args(argv)
    try:
        spec = build(args.src, args.out, args.upscale, args.splits, args.quality)
    except (ValueError, OSError) as e:
        print(f"msrc_highres: error: {e}", file=sys.stderr)
        return 2
    print(f"msrc_highres: {sum(spec['images'].values())} images x{args.upscale} in {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
