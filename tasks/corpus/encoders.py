"""Which ImageNet weight files a run's networks start from, and their digests: part of the run's
configuration (``WSSSConfig.pretrained``), hence of its MLflow parameters and of every resume key
(the classifier's inputs, each round's inputs), so a run directory started with one weight file is
never resumed with another."""
from __future__ import annotations

from wsseg.models.efficientnet_lite import VARIANTS, weights_digest
from wsseg.tasks.config import WSSSConfig
from wsseg.tasks.store.checkpoints import imagenet_variant


def pretrained_encoders(config: WSSSConfig) -> list[str]:
    """The EfficientNet-Lite variants the configuration's networks load ImageNet weights into."""
    out = []
    if config.classifier.encoder in VARIANTS:  # the superpixel features' maps too (features.deep_features)
        out.append(config.classifier.encoder)
    segmenter = imagenet_variant(config.segmentation.model, config.segmentation.options)
    return sorted(set(out + ([segmenter] if segmenter else [])))


def with_weight_digests(config: WSSSConfig) -> WSSSConfig:
    """``config`` with ``pretrained`` set to ``{variant: sha256 of its weight file}`` for every
    encoder it uses (whatever the caller put there is replaced). A missing package or weight
    file is :class:`models.efficientnet_lite.PretrainedWeightsError`, one line."""
    return config.model_copy(update={"pretrained": {v: weights_digest(v) for v in pretrained_encoders(config)}})
