"""How the tags of a corpus are spread over its images, and when they carry no contrast.

The image classifier learns where a class is by contrasting the images that carry its tag with
those that do not. When a class is tagged on every image (one product, one species, one defect
type: an implicit-background corpus of one class), or every image carries the same tag set,
there is nothing to contrast: the classifier's loss falls to nearly 0 and its class maps cover
the whole image. :func:`tag_statistics` finds such classes and :func:`contrast_warnings` says so
in words a user can act on (at ingest, and when a run starts); the class-agnostic foreground path
that serves such corpora is :mod:`tasks.wsss.foreground`.
"""
from __future__ import annotations

from typing import Iterable, Sequence

__all__ = ["tag_statistics", "contrast_warnings"]


def tag_statistics(tag_sets: Iterable[Sequence[str]], class_names: Sequence[str],
                   background: int | None = None) -> dict:
    """How the tags of a corpus are spread over its images.

    Parameters
    ----------
    tag_sets : the tags of each image, read once (images without a tag are left out: they are untagged
        images, e.g. an evaluation split, not negatives)
    class_names : the corpus's classes, in order
    background : index of the implicit background class, if any (never a tag)

    Returns
    -------
    dict
        ``images`` (tagged images counted), ``counts`` {class: images tagged with it, for every
        tagged class}, ``on_every_image`` (classes tagged on every counted image, in class
        order), ``same_tag_set`` (every counted image carries the same tags, with at least two
        images), ``one_tag_share`` (the share of counted images with exactly one tag: near 1 on a
        corpus of one object a photo, msrc21's object classes 0.96, coco128's scenes 0.22),
        ``implicit_background`` (the background class's name or None).

    Examples
    --------
    >>> s = tag_statistics([["cow", "grass"], ["grass"]], ["cow", "grass"])
    >>> s["on_every_image"], s["same_tag_set"]
    (['grass'], False)
    """
    images, counts, first, same, single = 0, {}, None, True, 0  # one pass: tag_sets may be streamed (a split's rows)
    for tags in tag_sets:
        if not len(tags):
            continue
        t = tuple(sorted(set(tags)))
        images += 1
        single += len(t) == 1
        first = t if first is None else first
        same = same and t == first
        for c in t:
            counts[c] = counts.get(c, 0) + 1
    order = {c: i for i, c in enumerate(class_names)}
    every = sorted((c for c, n in counts.items() if n == images), key=lambda c: order.get(c, len(order)))
    return {"images": images, "counts": dict(sorted(counts.items(), key=lambda kv: order.get(kv[0], 0))),
            "on_every_image": every if images >= 2 else [],
            "same_tag_set": images >= 2 and same,
            "one_tag_share": single / images if images else 0.0,
            "implicit_background": None if background is None else class_names[background]}


def contrast_warnings(stats: dict, where: str = "the corpus", foreground: bool | None = None) -> list[str]:
    """One warning per kind of missing contrast in :func:`tag_statistics`'s ``stats``, naming the
    classes and what to do about it; empty when every class has images without it.

    ``foreground``: whether the class-agnostic foreground path is on for this run (None: not
    known yet, e.g. at ingest); the advice names it either way."""
    every = stats["on_every_image"]
    if not every:
        return []
    names = ", ".join(repr(c) for c in every)
    n = stats["images"]
    if stats["same_tag_set"]:
        what = (f"every one of the {n} tagged images of {where} carries the same tags ({names}): the tags carry no "
                f"contrast, so the image classifier has nothing to learn where {'it is' if len(every) == 1 else 'they are'}")
    else:
        what = (f"{'class' if len(every) == 1 else 'classes'} {names} {'is' if len(every) == 1 else 'are'} tagged on "
                f"every one of the {n} tagged images of {where}: the image classifier cannot learn where "
                f"{'it is' if len(every) == 1 else 'they are'} from tags that never say {'it is' if len(every) == 1 else 'they are'} absent")
    if stats["implicit_background"] is None:
        fix = (f"add images without {names}, or give the corpus an implicit background class (a first class named "
               f"'background' that no image is tagged with) so that the class-agnostic foreground path can "
               f"separate the objects from it")
    else:
        state = ("; it is on for this run" if foreground else "; it is off for this run" if foreground is False
                 else "; `wsseg train` turns it on by itself for such a corpus")
        fix = (f"add images without {names} (the background alone, or other classes), or use the class-agnostic "
               f"foreground path (--set foreground.mode=on{state})")
    return [f"no tag contrast: {what}. What to do: {fix}."]
