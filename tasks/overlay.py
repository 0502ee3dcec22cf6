"""Pictures where looking beats reading: label maps coloured over their images, in grids."""
from __future__ import annotations

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


def grid(rows: list[list[tuple[str, np.ndarray]]], *, cell_height: int = 160) -> np.ndarray:
    """Tile titled RGB panels into one (H, W, 3) uint8 picture, one list per row."""
    lines = []
    for row in rows:
        panels = []
        for title, img in row:
            h, w = img.shape[:2]
            im = cv2.resize(img, (max(1, int(w * cell_height / h)), cell_height), interpolation=cv2.INTER_NEAREST)
            bar = np.full((18, im.shape[1], 3), 255, np.uint8)
            cv2.putText(bar, title[:40], (3, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.42, (0, 0, 0), 1, cv2.LINE_AA)
            panels.append(np.concatenate([bar, im], 0))
            panels.append(np.full((cell_height + 18, 4, 3), 255, np.uint8))
        lines.append(np.concatenate(panels, 1))
    width = max(l.shape[1] for l in lines)
    lines = [np.pad(l, ((0, 4), (0, width - l.shape[1]), (0, 0)), constant_values=255) for l in lines]
    return np.concatenate(lines, 0)


def write_png(path, rgb: np.ndarray) -> None:
    path = str(path)
    if not cv2.imwrite(path, cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)):
        raise OSError(f"{path}: could not write the picture")
