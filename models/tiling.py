"""Patch inference helpers: cut an image into fixed-size patches and stitch outputs back.

Boxes are ``(y0, x0, y1, x1)`` in pixels, end-exclusive, and every box has the full patch
size ``(patch, patch)``.  When the image is at least one patch large along an axis the
boxes lie inside it (the last patch of a row/column is shifted inward, so it overlaps its
neighbour more than ``overlap``).  When the image is *smaller* than the patch along an axis
there is one box on that axis, ``[0, patch)``, which extends past the image:
:func:`extract_patches` pads the missing part with ``pad_value`` and the stitchers drop it.

Everything here works on numpy arrays and on torch tensors alike (stitching torch tensors is
differentiable), and touches no files.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["patch_grid", "extract_patches", "stitch", "Stitcher", "RowStitcher"]

_MODES = ("average", "max")


def _starts(length: int, patch: int, stride: int) -> list[int]:
    if length <= patch:
        return [0]
    starts = list(range(0, length - patch, stride))
    starts.append(length - patch)
    return starts


def patch_grid(height: int, width: int, patch: int, *, overlap: int = 0) -> list[tuple[int, int, int, int]]:
    """Boxes of equal-size patches that cover an image.

    Parameters
    ----------
    height, width : int
        Image size in pixels.
    patch : int
        Side of the square patches.
    overlap : int, optional
        Minimum overlap in pixels between neighbouring patches (``0 <= overlap < patch``);
        the stride is ``patch - overlap``.

    Returns
    -------
    boxes : list of (y0, x0, y1, x1)
        Row-major (y0 outer, then x0), ``y1 - y0 == x1 - x0 == patch``.  Along an axis
        longer than the patch the boxes stay inside the image; along a shorter axis there is
        a single box ``[0, patch)`` (pad the image, see :func:`extract_patches`).

    Raises
    ------
    ValueError
        If a size is not positive or ``overlap`` is outside ``[0, patch)``.

    Examples
    --------
    >>> patch_grid(5, 7, 4)
    [(0, 0, 4, 4), (0, 3, 4, 7), (1, 0, 5, 4), (1, 3, 5, 7)]
    """
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be positive, got {height}x{width}")
    if patch < 1:
        raise ValueError(f"patch must be a positive number of pixels, got {patch}")
    if not 0 <= overlap < patch:
        raise ValueError(f"overlap must lie in [0, patch={patch}), got {overlap}")
    stride = patch - overlap
    return [(y0, x0, y0 + patch, x0 + patch)
            for y0 in _starts(int(height), int(patch), stride)
            for x0 in _starts(int(width), int(patch), stride)]


def _is_torch(a) -> bool:
    return type(a).__module__.startswith("torch")


def extract_patches(image, boxes: Sequence[tuple[int, int, int, int]], *, channel_axis: int | None = -1,
                    pad_value: float = 0):
    """Cut boxes out of an image, padding where a box extends past the image.

    Parameters
    ----------
    image : (H, W, C), (C, H, W) or (H, W) array or torch tensor
        The image; ``channel_axis`` says where the channels are (``None`` for 2-D).  Any
        array-like that slices like numpy (zarr array, memmap) works too; only the boxes
        are read.
    boxes : sequence of (y0, x0, y1, x1)
        All of the same size, as returned by :func:`patch_grid`.
    channel_axis : {-1, 0, None}
        Channel axis of ``image`` (``-1`` for numpy images, ``0`` for a ``(C, H, W)``
        tensor).
    pad_value : float
        Value of the pixels outside the image.

    Returns
    -------
    patches : (N, p, p, C), (N, C, p, p) or (N, p, p)
        Same layout, type, dtype (and device) as ``image``.

    Raises
    ------
    ValueError
        If the boxes differ in size, start outside the image, or the layout is unknown.
    """
    if channel_axis not in (-1, 0, None):
        raise ValueError(f"channel_axis must be -1, 0 or None, got {channel_axis!r}")
    expected_ndim = 2 if channel_axis is None else 3
    if len(image.shape) != expected_ndim:
        raise ValueError(f"image has {len(image.shape)} dims but channel_axis={channel_axis!r} needs {expected_ndim}")
    if len(boxes) == 0:
        raise ValueError("boxes is empty; build it with patch_grid(height, width, patch)")
    height, width = (image.shape[:2] if channel_axis in (-1, None) else image.shape[1:])
    ph, pw = boxes[0][2] - boxes[0][0], boxes[0][3] - boxes[0][1]
    for y0, x0, y1, x1 in boxes:
        if (y1 - y0, x1 - x0) != (ph, pw):
            raise ValueError(f"all boxes must have the same size {ph}x{pw}, got {(y0, x0, y1, x1)}")
        if not (0 <= y0 < height and 0 <= x0 < width):
            raise ValueError(f"box {(y0, x0, y1, x1)} starts outside the {height}x{width} image")
    if channel_axis is None:
        shape = (len(boxes), ph, pw)
    elif channel_axis == 0:
        shape = (len(boxes), image.shape[0], ph, pw)
    else:
        shape = (len(boxes), ph, pw, image.shape[-1])
    if _is_torch(image):
        out = image.new_full(shape, pad_value)
    else:
        out = np.full(shape, pad_value, dtype=np.dtype(image.dtype))
    for i, (y0, x0, y1, x1) in enumerate(boxes):
        h, w = min(y1, height) - y0, min(x1, width) - x0
        if channel_axis == 0:
            out[i, :, :h, :w] = image[:, y0:y0 + h, x0:x0 + w]
        else:
            out[i, :h, :w] = image[y0:y0 + h, x0:x0 + w]
    return out


class Stitcher:
    """Accumulate patch outputs into a whole-image output, one batch at a time.

    Memory is the output accumulator (``C x H x W`` plus an ``H x W`` count), independent of
    the number of patches.  With ``mode="average"`` overlapping pixels get the mean of the
    patch values, with ``mode="max"`` their maximum.  The accumulator is allocated at the
    first :meth:`add` with the type (numpy/torch), dtype and device of the outputs.

    Parameters
    ----------
    height, width : int
        Size of the whole output.
    mode : {"average", "max"}
        How overlapping patch values are combined.
    row_offset : int
        Image row of the accumulator's first row (used by :class:`RowStitcher`); boxes
        are in image coordinates.

    Examples
    --------
    >>> s = Stitcher(2, 3)
    >>> s.add(np.ones((1, 1, 2, 2)), [(0, 0, 2, 2)])
    >>> s.add(np.full((1, 1, 2, 2), 3.0), [(0, 1, 2, 3)])
    >>> s.result()[0]
    array([[1., 2., 3.],
           [1., 2., 3.]])
    """

    def __init__(self, height: int, width: int, *, mode: str = "average", row_offset: int = 0) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
        if height < 1 or width < 1:
            raise ValueError(f"height and width must be positive, got {height}x{width}")
        self.height, self.width, self.mode, self.row_offset = int(height), int(width), mode, int(row_offset)
        self.acc = None
        self.count = None

    def _allocate(self, outputs) -> None:
        shape = (outputs.shape[1], self.height, self.width)
        if _is_torch(outputs):
            import torch
            fill = 0.0 if self.mode == "average" else -torch.inf
            self.acc = outputs.new_full(shape, fill)
            self.count = outputs.new_zeros(shape[1:])
        else:
            dtype = np.result_type(outputs.dtype, np.float32)
            self.acc = np.full(shape, 0.0 if self.mode == "average" else -np.inf, dtype=dtype)
            self.count = np.zeros(shape[1:], dtype=dtype)

    def add(self, outputs, boxes: Sequence[tuple[int, int, int, int]]) -> None:
        """Add a batch of patch outputs.

        Parameters
        ----------
        outputs : (N, C, p, p) array or tensor
            One output per box; parts outside the accumulator's rows/columns are dropped.
        boxes : sequence of N (y0, x0, y1, x1)
            Patch boxes in image coordinates.
        """
        if outputs.ndim != 4 or outputs.shape[0] != len(boxes):
            raise ValueError(f"outputs must be (N, C, p, p) with N = len(boxes) = {len(boxes)}, "
                             f"got shape {tuple(outputs.shape)}")
        if self.acc is None:
            self._allocate(outputs)
        elif outputs.shape[1] != self.acc.shape[0]:
            raise ValueError(f"outputs have {outputs.shape[1]} channels, earlier batches {self.acc.shape[0]}")
        for out, (y0, x0, y1, x1) in zip(outputs, boxes):
            if (y1 - y0, x1 - x0) != tuple(out.shape[1:]):
                raise ValueError(f"box {(y0, x0, y1, x1)} does not match output size {tuple(out.shape[1:])}")
            ya, yb = max(y0 - self.row_offset, 0), min(y1 - self.row_offset, self.height)
            xa, xb = max(x0, 0), min(x1, self.width)
            if ya >= yb or xa >= xb:
                continue
            piece = out[:, ya + self.row_offset - y0: yb + self.row_offset - y0, xa - x0: xb - x0]
            if self.mode == "average":
                self.acc[:, ya:yb, xa:xb] += piece
            elif _is_torch(piece):
                import torch
                self.acc[:, ya:yb, xa:xb] = torch.maximum(self.acc[:, ya:yb, xa:xb], piece)
            else:
                np.maximum(self.acc[:, ya:yb, xa:xb], piece, out=self.acc[:, ya:yb, xa:xb])
            self.count[ya:yb, xa:xb] += 1

    def covered(self):
        """(H, W) bool: pixels that received at least one patch."""
        if self.count is None:
            return np.zeros((self.height, self.width), dtype=bool)
        return self.count > 0

    def result(self, rows: int | None = None):
        """(C, H, W) combined output; pixels no patch covered are 0.

        Parameters
        ----------
        rows : int, optional
            Only the first ``rows`` rows: (C, rows, W).

        Raises
        ------
        ValueError
            If nothing was added.
        """
        if self.acc is None:
            raise ValueError("no patch outputs were added; call add(outputs, boxes) first")
        n = self.height if rows is None else max(0, min(int(rows), self.height))
        acc, count = self.acc[:, :n], self.count[:n]
        if self.mode == "average":
            return acc / count.clip(min=1)[None]
        covered = count > 0
        if _is_torch(acc):
            import torch
            return torch.where(covered[None], acc, torch.zeros_like(acc))
        return np.where(covered[None], acc, 0)


def stitch(patch_outputs, boxes: Sequence[tuple[int, int, int, int]], height: int, width: int, *,
           mode: str = "average"):
    """Stitch patch outputs back into a whole-image output.

    Parameters
    ----------
    patch_outputs : (N, C, p, p) array or tensor
        Output of each patch (e.g. class scores).
    boxes : sequence of N (y0, x0, y1, x1)
        The patch boxes (:func:`patch_grid`); parts past the image are dropped.
    height, width : int
        Size of the whole image.
    mode : {"average", "max"}
        Combination of overlapping values.

    Returns
    -------
    out : (C, H, W)
        Same type as ``patch_outputs`` (float); uncovered pixels are 0.

    Examples
    --------
    >>> img = np.arange(35.0).reshape(1, 5, 7)
    >>> boxes = patch_grid(5, 7, 4, overlap=1)
    >>> np.array_equal(stitch(extract_patches(img, boxes, channel_axis=0), boxes, 5, 7), img)
    True
    """
    stitcher = Stitcher(height, width, mode=mode)
    stitcher.add(patch_outputs, boxes)
    return stitcher.result()


class RowStitcher:
    """Stitch patches that arrive in row order, keeping only one band of rows in memory.

    For images processed patch-row by patch-row (the row-major order of
    :func:`patch_grid`): the accumulator covers rows ``[top, top + band)`` only.  Call
    :meth:`pop_until` with the first row of the next patch row; it returns the rows above
    it, which no later patch can touch, and slides the band down.  Memory is
    ``C x band x W`` instead of ``C x H x W``.

    Parameters
    ----------
    height, width : int
        Size of the whole image.
    band : int
        Rows kept (the patch height).
    mode : {"average", "max"}
        As in :class:`Stitcher`.
    """

    def __init__(self, height: int, width: int, band: int, *, mode: str = "average") -> None:
        if band < 1:
            raise ValueError(f"band must be a positive number of rows, got {band}")
        self.height, self.width, self.band, self.mode = int(height), int(width), int(band), mode
        self.top = 0
        self._current = Stitcher(min(self.band, self.height), self.width, mode=mode)

    def add(self, outputs, boxes: Sequence[tuple[int, int, int, int]]) -> None:
        """Add a batch of patch outputs (boxes must start within the current band)."""
        for y0, x0, y1, x1 in boxes:
            if y0 < self.top or min(y1, self.height) > self.top + self.band:
                raise ValueError(f"box {(y0, x0, y1, x1)} falls outside the current band "
                                 f"[{self.top}, {self.top + self.band}); add patches in row order")
        self._current.add(outputs, boxes)

    def pop_until(self, row: int):
        """Finish rows ``[top, row)`` and return their (C, row - top, W) output.

        ``row`` may be at most ``top + band``; pass ``height`` at the end.  Returns ``None``
        when ``row <= top``.  The band's buffers are reused: the rows still open move to
        its top in place, so sliding the band allocates only the returned rows.
        """
        row = min(int(row), self.height)
        if row <= self.top:
            return None
        if row > self.top + self.band:
            raise ValueError(f"row {row} is beyond the band [{self.top}, {self.top + self.band}); "
                             "pop rows before adding patches further down")
        cur = self._current
        n = row - self.top
        done = cur.result(n)
        new_top = row
        new_height = min(self.band, self.height - new_top)
        if new_height < 1:                              # everything is finished
            self._current, self.top = Stitcher(1, self.width, mode=self.mode, row_offset=new_top), new_top
            return done
        keep = min(cur.height - n, new_height)
        fill = 0.0 if self.mode == "average" else -np.inf
        kept_acc, kept_count = cur.acc[:, n:n + keep], cur.count[n:n + keep]
        kept_acc = kept_acc.clone() if _is_torch(kept_acc) else kept_acc.copy()
        kept_count = kept_count.clone() if _is_torch(kept_count) else kept_count.copy()
        acc, count = cur.acc[:, :new_height], cur.count[:new_height]
        acc[:, :keep] = kept_acc
        acc[:, keep:] = fill
        count[:keep] = kept_count
        count[keep:] = 0
        cur.acc, cur.count, cur.height, cur.row_offset = acc, count, new_height, new_top
        self.top = new_top
        return done
