"""The labels out of a run: export (a round's pseudo-labels as the files other tools train on or
show: VOC-style palette PNGs, a COCO JSON of RLE masks)."""
