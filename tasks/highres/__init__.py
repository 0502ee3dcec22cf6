"""Method C (METHOD.md C) and the inference of large images: train (patches + coarse global
image: data, training, scoring of ``wsseg bench highres``), segment (``wsseg segment``: a trained
model over new images, whole or in stitched patches), fov (the circular field of view of fundus
photographs). The network is models/global_local.py."""
