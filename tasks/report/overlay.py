"""Pictures where looking beats reading: label maps coloured over their images, in grids."""
from __future__ import annotations

from typing import Sequence

import cv2
import numpy as np


def palette(n: int = 256) -> np.ndarray:
    """(n, 3) uint8 PASCAL VOC colour map (index 255 is drawn white = ignore/void)."""
    pal = np.zeros((n, 3), np.uint8)
    for i in range(n):
        c, r, g, b = i, 0, 0, 0
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        pal[i] = (r, g, b)
    if n > 255:
        pal[255] = (255, 255, 255)
    return pal


def colorize(label: np.ndarray) -> np.ndarray:
    """(H, W) uint8 label map -> (H, W, 3) uint8 RGB."""
    return palette()[label]


def overlay(image: np.ndarray, label: np.ndarray, *, alpha: float = 0.55) -> np.ndarray:
    """Blend a label map's colours over an (H, W, 3) uint8 image; ignore (255) stays unblended
    but hatched lightly so undecided pixels are visible."""
    if image.shape[:2] != label.shape:
        raise ValueError(f"image {image.shape[:2]} and label {label.shape} sizes differ")
    col = colorize(label).astype(np.float32)
    out = image.astype(np.float32) * (1 - alpha) + col * alpha
    ign = label == 255
    hatch = ((np.add.outer(np.arange(label.shape[0]), np.arange(label.shape[1])) // 3) % 4 == 0)
    out[ign] = image[ign]
    out[ign & hatch] = 255
    return np.clip(out, 0, 255).astype(np.uint8)


FONT = cv2.FONT_HERSHEY_SIMPLEX


def _title_bar(title: str, width: int, *, height: int = 18, max_scale: float = 0.42) -> np.ndarray:
    """A white bar with ``title`` in black, the font shrunk (down to 0.3) and then the text cut
    with '...' so that it fits ``width`` pixels."""
    bar = np.full((height, width, 3), 255, np.uint8)
    scale = max_scale
    while scale > 0.3 and cv2.getTextSize(title, FONT, scale, 1)[0][0] > width - 6:
        scale -= 0.02
    text = title
    while len(text) > 1 and cv2.getTextSize(text, FONT, scale, 1)[0][0] > width - 6:
        text = text[:-2] + "~" if not text.endswith("~") else text[:-3] + "~"
    cv2.putText(bar, text, (3, height - 5), FONT, scale, (0, 0, 0), 1, cv2.LINE_AA)
    return bar


def legend(names: Sequence[str], class_ids: Sequence[int], width: int, *, swatch: int = 14) -> np.ndarray:
    """(h, width, 3) uint8 key of the colours of ``class_ids`` (names from ``names``), wrapped onto
    as many lines as the width needs; 255 is shown as 'ignore'."""
    pal = palette()
    entries = [(("ignore" if c == 255 else (names[c] if c < len(names) else str(c))), pal[c]) for c in class_ids]
    line_h = swatch + 8
    lines: list[list[tuple[int, str, np.ndarray]]] = [[]]
    x = 4
    for name, colour in entries:
        w = swatch + 6 + cv2.getTextSize(name, FONT, 0.42, 1)[0][0] + 12
        if lines[-1] and x + w > width:
            lines.append([])
            x = 4
        lines[-1].append((x, name, colour))
        x += w
    out = np.full((line_h * len(lines) + 4, width, 3), 255, np.uint8)
    for k, line in enumerate(lines):
        y = 4 + k * line_h
        for x, name, colour in line:
            cv2.rectangle(out, (x, y), (x + swatch, y + swatch), tuple(int(v) for v in colour), -1)
            cv2.rectangle(out, (x, y), (x + swatch, y + swatch), (0, 0, 0), 1)
            cv2.putText(out, name, (x + swatch + 6, y + swatch - 2), FONT, 0.42, (0, 0, 0), 1, cv2.LINE_AA)
    return out


def with_legend(picture: np.ndarray, names: Sequence[str], *labels: np.ndarray) -> np.ndarray:
    """``picture`` with a colour key of the classes that occur in ``labels`` below it."""
    present = sorted(set().union(*(np.unique(lab).tolist() for lab in labels)))
    return np.concatenate([picture, legend(names, present, picture.shape[1])], 0)


def grid(rows: list[list[tuple[str, np.ndarray]]], *, width: int | None = None, cell_height: int = 160,
         gap: int = 4) -> np.ndarray:
    """Tile titled RGB panels into one (H, W, 3) uint8 picture, one list per row.

    Every row is scaled to the same total ``width`` (default: the widest row at ``cell_height``),
    so rows of portrait photos are taller instead of leaving empty space; titles are shrunk or
    cut to fit their panel."""
    def natural(row):
        return sum(img.shape[1] * cell_height / img.shape[0] for _, img in row)

    width = width or int(max(natural(row) + gap * len(row) for row in rows))
    lines = []
    for row in rows:
        avail = width - gap * len(row)
        height = max(1, int(round(cell_height * avail / natural(row))))
        panels, used = [], 0
        for k, (title, img) in enumerate(row):
            h, w = img.shape[:2]
            pw = max(1, int(round(w * height / h))) if k < len(row) - 1 else max(1, avail - used)
            used += pw
            im = cv2.resize(img, (pw, height), interpolation=cv2.INTER_NEAREST)
            panels.append(np.concatenate([_title_bar(title, pw), im], 0))
            panels.append(np.full((height + 18, gap, 3), 255, np.uint8))
        lines.append(np.concatenate(panels, 1))
        lines.append(np.full((gap, lines[-1].shape[1], 3), 255, np.uint8))
    return np.concatenate(lines, 0)


def write_png(path, rgb: np.ndarray) -> None:
    if hasattr(path, "fs"):  # a file of a run directory on object storage (a UPath): one put
        ok, data = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
        if not ok:
            raise OSError(f"{path}: could not write the picture")
        path.write_bytes(data.tobytes())
        return
    path = str(path)
    if not cv2.imwrite(path, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)):
        raise OSError(f"{path}: could not write the picture")
