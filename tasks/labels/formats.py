"""The export formats and what each writes (light: the command line's help reads it without
loading numpy or the store)."""

FORMATS: dict[str, str] = {
    "png": "the PASCAL VOC layout under OUT/VOCdevkit/VOC2012 (palette PNGs of class indices, 255 = ignore)",
    "coco": "OUT/labels.json, one COCO-stuff RLE mask per class present in each image",
    "labelstudio": "OUT/tasks.json, Label Studio tasks with the labels as brush predictions, and the project's "
                   "OUT/labeling_config.xml",
}
