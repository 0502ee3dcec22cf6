"""Typed parameters of the flows: every threshold and choice of METHOD.md is one field here,
so Prefect shows and records it with each flow run and MLflow logs it with each round."""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class FeatureConfig(BaseModel):
    """Per-image features, computed once per image content and parameter set (step 2, B)."""

    model_config = ConfigDict(extra="forbid")

    superpixel_method: Literal["slico", "slic", "felzenszwalb"] = Field("slico", description=(
        "superpixel algorithm (tasks.wsss.superpixels); slico adapts its compactness per superpixel, and the others "
        "did no better, see docs/benchmarks.md#ablations"))
    region_size: int = Field(16, ge=4, description="superpixel side in pixels")
    superpixel_iterations: int = Field(5, ge=1, description=(
        "clustering iterations of the superpixels (OpenCV's SLIC iterate); 5 since 2026-12-07 (10 before: half "
        "the superpixels' time, the same labels within noise; more for superpixels that follow edges a little "
        "closer), see docs/benchmarks.md#a-rounds-cost-per-image"))
    ruler: float = Field(10.0, description="superpixel compactness (OpenCV ruler, scikit-image compactness); "
                                           "slico ignores it")
    edge_sigma: float = Field(1.0, description="Gaussian filter before the edge operators, standard deviation in "
                                               "pixels (METHOD.md B1); 0 = none")
    edge_tau: float = Field(0.5, description="tau of the weighted vote F = sum w_k X_k - (1 + tau)")
    proposal_min_size: float = Field(0.002, description="smallest proposal, share of the image")
    proposal_diversify: bool = Field(False, description=(
        "union of several superpixel-merging strategies (two colour spaces, and none), as selective search's "
        "'fast' mode: more proposals per image"))
    deep_features: Literal["classifier", "none"] = Field("classifier", description=(
        "superpixel (and so proposal) features from the image classifier's encoder maps (deep_strides), beside the "
        "colour and texture ones, pooled from round 0's CAM pass (the first of classifier.cam_scales), so no "
        "image goes through an encoder twice; 'none' = the hand-made features alone, for a classifier without "
        "an EfficientNet-Lite encoder (classifier.encoder small). The classifier's maps, fine-tuned on the tags, "
        "beat ImageNet's Lite2 maps at 1x (the choice until 2026-12-07) and cost no second pass, see "
        "docs/benchmarks.md#superpixel-features-from-the-classifier"))
    deep_strides: tuple[int, ...] = Field((8, 16), min_length=1, description=(
        "the encoder maps pooled over each superpixel, by stride (8, 16, 32); 8 and 16: the stride-32 map "
        "sees so much around a superpixel that the weakly trained classifiers learn the CAM's co-occurrence "
        "from it (water beside a bird labelled bird), see docs/benchmarks.md#superpixel-features-without-context"))

    @field_validator("deep_strides")
    @classmethod
    def _known_strides(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not set(v) <= {8, 16, 32} or len(set(v)) != len(v):
            raise ValueError(f"strides must be distinct values of 8, 16 and 32, got {list(v)}")
        return tuple(sorted(v))


class ClassifierConfig(BaseModel):
    """The image classifier whose CAMs are round 0's preliminary result (step 4)."""

    model_config = ConfigDict(extra="forbid")

    encoder: Literal["lite0", "lite1", "lite2", "small"] = Field("lite2", description=(
        "the classifier's encoder: an EfficientNet-Lite with ImageNet weights from its pinned package (lite2, "
        "or the smaller lite1 and lite0), or 'small', trained from scratch (width, stride 8 and epochs 40 "
        "were its settings); pretrained for its much better CAMs, Lite2 for better CAMs and labels than Lite0's "
        "at 1.5-1.9x its training time, see docs/benchmarks.md#the-larger-encoder-for-the-labels"))
    epochs: int = Field(8, ge=1, description="training epochs over the tagged images; few, as a pretrained "
                                              "encoder needs few ('small' wants about 40)")
    size: int = Field(224, description="side of the square training crops, in pixels")
    scale: tuple[float, float] = Field((0.8, 1.6), description=(
        "random rescaling range (factors) of the training crops; this range gave the best CAMs, see "
        "docs/benchmarks.md#defaults-and-why"))
    width: int = Field(16, description="encoder 'small' only: channels of its first stage")
    stride: int = Field(16, description="CAM stride in pixels: 16, or 8 (dilated later stages: finer maps, "
                                        "about twice the cost)")
    batch_size: int = Field(16, description="images per training step")
    lr: float = Field(2e-3, description="learning rate of the class map; a pretrained encoder learns at a "
                                        "tenth of it (models.lite_nets.ENCODER_LR)")
    max_seconds: float | None = Field(None, description="wall-time budget of the training, in seconds; None = "
                                                        "no budget")
    cam_scales: tuple[float, ...] = Field((1.5,), description=(
        "image scales (factors) whose CAMs are averaged; 1.5, as the map is coarse on small photos and 1.5 "
        "beat 1.0 and (0.75, 1.0, 1.25), see docs/benchmarks.md#defaults-and-why"))
    background_threshold: float = Field(0.35, description=(
        "with an implicit background (whose CAMs are ReLU maps divided by their maximum; without one, each "
        "class map minus its image mean, softmax over the tags): its CAM score on an image with one object "
        "tag; with n object tags background_threshold ** (1 / n), as a pixel's strongest of n maps grows with "
        "n (tasks.wsss.pipeline.background_score)"))


class ProposalConfig(BaseModel):
    """Proposal classifier (step 3, cross-entropy), filtering (5), fusion (6), seeding (7)."""

    model_config = ConfigDict(extra="forbid")

    hidden: int = Field(256, description="hidden units of the proposal classifier's MLP (0 = logistic regression)")
    epochs: int = Field(10, ge=1, description=(
        "training epochs of the proposal classifier each round; 10, as 30 gained no more than noise at three "
        "times the time, see docs/benchmarks.md#defaults-and-why"))
    lr: float = Field(1e-3, description="learning rate of the proposal classifier")
    target_sharpen: float = Field(2.0, description=(
        "exponent of the proposals' soft targets (area-weighted preliminary probabilities, restricted to the "
        "tags) before they are renormalised; higher = closer to one-hot"))
    max_samples: int = Field(1_000_000, ge=1, description=(
        "most proposals (rows, about 1 KB each) the classifier's training holds in memory at once; a larger "
        "corpus streams them from TMPDIR each epoch in chunks of this many, see docs/large-corpora.md#memory"))
    t1: float = Field(0.0, ge=0, le=1, description=(
        "IoU filtering (METHOD.md step 5): a positive proposal overlaps the preliminary mask by at least t1 "
        "(IoU); 0 with p1 0 = every proposal positive, which beat 0.3 / 0.5, see "
        "docs/benchmarks.md#refresh-round-parts"))
    p1: float = Field(0.0, ge=0, le=1, description="IoU filtering: ... and has class probability at "
                                                   "least p1")
    t2: float = Field(0.1, ge=0, le=1, description="IoU filtering: a negative proposal overlaps the preliminary "
                                                  "mask by at most t2 (IoU) ...")
    p2: float = Field(0.2, ge=0, le=1, description="IoU filtering: ... and has class probability at most p2")
    fusion: Literal["topk", "threshold"] = Field("threshold", description=(
        "per-class fusion of the positive proposals (METHOD.md step 6): every proposal with probability >= "
        "threshold, or the k most probable; threshold beat top-k 5, see docs/benchmarks.md#defaults-and-why"))
    k: int = Field(5, description="fusion 'topk': proposals fused per class")
    threshold: float = Field(0.5, description="fusion 'threshold': least class probability of a fused proposal")
    seeding: Literal["random_walker", "grabcut", "none"] = Field("grabcut", description=(
        "seeded segmentation of the ambiguous area (METHOD.md step 7); GrabCut beat the random walker in "
        "every round at a little more time per image, see docs/benchmarks.md#defaults-and-why"))
    grabcut_iters: int = Field(3, ge=1, description=(
        "cv2.grabCut iterations per label; fewer lost a little, see docs/benchmarks.md#defaults-and-why"))
    beta: float = Field(130.0, description="random walker: edge penalty (skimage's beta)")
    seed_prior_weight: float = Field(0.5, ge=0, le=1, description=(
        "weight of the preliminary evidence beside the seeded segmentation's probabilities in the "
        "ambiguous area [ours]; 0 = colour and seeds alone, as METHOD.md step 7"))
    downscale: int = Field(3, ge=1, description=(
        "seeded segmentation solved on a grid this many times smaller (factor), then upsampled; "
        "full-resolution seeds are kept; 3 since 2026-12-07 (2 before: GrabCut took 40 of a round's 62 "
        "pseudo-label core-ms an image, 18 at 3, with the same labels within noise; 2 for the finest "
        "boundaries on small images), see docs/benchmarks.md#a-rounds-cost-per-image"))


class MILConfig(BaseModel):
    """Superpixel multiple-instance refinement of the preliminary result [ours]: a corpus-wide
    superpixel classifier, labels restricted to the tags, reassigned ``iterations`` times."""

    model_config = ConfigDict(extra="forbid")

    iterations: int = Field(6, ge=0, description="reassignment iterations of the superpixel MIL; 0 = off: the "
                                                  "preliminary result goes to step 3 as it is")
    prior_weight: float = Field(0.3, ge=0, le=1, description="weight of the preliminary result in each mixture")
    epochs: int = Field(10, description="training epochs of the superpixel classifier in each iteration")
    lr: float = Field(3e-3, description="learning rate of the superpixel classifier")
    max_samples: int = Field(1_000_000, ge=1, description=(
        "most superpixels (rows, about 1 KB each) the MIL holds in memory at once; a larger corpus streams "
        "them from TMPDIR each epoch in chunks of this many, see docs/large-corpora.md#memory"))


class SegmentationConfig(BaseModel):
    """The segmentation model trained on the pseudo-labels (step 8)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("lite", description=(
        "registry name: lite (EfficientNet-Lite encoder with ImageNet weights and a light decoder), small "
        "(trained from scratch), fusion, global_local; lite, see docs/benchmarks.md#pretrained-encoders"))
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="builder options of the model, e.g. {'variant': 'lite1'} for lite, "
                                                "{'width': 16} for small, {'width': 0.25} for fusion")
    backbone_weights: dict[str, str] = Field(default_factory=dict,
                                             description="fusion: {'resnet50': path, 'mobilenet_v2': path} "
                                                         "torchvision ImageNet checkpoints")
    epochs: int = Field(3, ge=1, description=(
        "training epochs of a round's segmenter (the final model, trained from the start, gets epochs x rounds); "
        "few, as "
        "the pretrained lite network needs few ('small' was run with 6), see docs/benchmarks.md#defaults-and-why"))
    batch_size: int = Field(8, description="images per training step")
    lr: float = Field(2e-3, description="learning rate; a pretrained encoder learns at a tenth of it "
                                        "(models.lite_nets.ENCODER_LR)")
    crop: int = Field(192, description="side of the square training crops, in pixels (global_local: "
                                       "segmentation.options.patch_size instead)")
    max_seconds: float | None = Field(None, description="wall-time budget of each training, in seconds (the final "
                                                        "model's grows with its epochs); None = no budget")
    patience: int = Field(4, description="stop a training after this many epochs without a lower loss")
    min_steps: int = Field(0, ge=0, description="raise the epochs so that small corpora still get this many steps")
    class_balance: float = Field(0.5, ge=0, le=1, description=(
        "the final model's cross-entropy class weights (pixel share of the class in the labels) ** "
        "-class_balance, mean 1 over the classes present (bench quality's supervised reference alike); 0 = "
        "unweighted; without them small classes beside large ones are learnt away on untagged images, see "
        "docs/benchmarks.md#defaults-and-why"))
    rounds_class_balance: float = Field(0.0, ge=0, le=1, description=(
        "the same for the rounds' own segmenters (all but the final model), whose output labels the next "
        "round's tagged images; 0 = unweighted: weighted, the small classes grew over what they stand on from "
        "round to round (both were 0.5 until 2026-12-05), see docs/benchmarks.md#the-segmenters-class-weights"))
    boundary_ignore: int = Field(3, ge=0, description=(
        "the final model's loss leaves out the pseudo-label pixels within this many pixels of a boundary "
        "between two labels (where a pseudo-label is least right; the network's own edges decide there); the "
        "rounds' segmenters (rounds_boundary_ignore) and bench quality's supervised reference (masks) learn every "
        "pixel; 0 = off (before 2026-12-05), see docs/benchmarks.md#the-final-models-label-boundaries"))
    rounds_boundary_ignore: int = Field(0, ge=0, description=(
        "the same band for the rounds' own segmenters (all but the final model), whose output is the next "
        "round's start; 0 = every pixel, see docs/benchmarks.md#the-final-models-label-boundaries"))
    use_edges: bool = Field(True, description="feed the feature-region map as a 4th input channel")
    finetune: bool = Field(True, description="start round r from model r-1")
    encoder_init: Literal["classifier", "none"] = Field("classifier", description=(
        "where a segmenter's encoder starts unless it fine-tunes a round before (round 0, the final model): "
        "'classifier' copies the run's image classifier's when it is the same network (trained on the same "
        "tags; by default it is not: a Lite2 classifier, a Lite0 segmenter, which then starts from ImageNet's "
        "Lite0); 'none' the network's own start (fusion, global_local: always); see "
        "docs/method.md#pretrained-encoders"))
    num_workers: int = Field(1, description="data-loader worker processes of each training")
    coarse_loss: float = Field(0.0, ge=0, description=(
        "global_local built with coarse_head: weight of a loss on each crop's coarse whole image against "
        "its pseudo-label's class fractions (tasks.common.training.soft_cross_entropy), beside the crop's own "
        "loss; 0 = none"))

    @model_validator(mode="after")
    def _options_fit_the_model(self) -> "SegmentationConfig":
        # at load time, not after the classifier's hours: {'width': 16} was small's option, not lite's
        if not self.options:  # no option to refuse: the name alone, without loading torch (`wsseg status`)
            from wsseg.models import check_name

            check_name(self.model)
            return self
        from wsseg.tasks.store.checkpoints import check_network_options

        check_network_options(self.model, self.options)
        return self


class InferenceConfig(BaseModel):
    """How a trained segmenter labels images without tags (the eval split, new images). Changes
    no round's content, so a run directory accepts a change here."""

    model_config = ConfigDict(extra="forbid")

    gate: bool = Field(True, description=(
        "weight each class's segmentation probability by the image classifier's probability that the "
        "image shows the class (run at classifier.cam_scales); on, as it lifts the mIoU of images without "
        "tags, see docs/benchmarks.md#gating-new-images"))


class ForegroundConfig(BaseModel):
    """Class-agnostic foreground evidence for implicit-background corpora whose tags carry no
    contrast (a class tagged on every image), where the image classifier has nothing to learn, or
    whose photos hold one tagged object each (:mod:`tasks.wsss.foreground`)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "on", "off"] = Field("auto", description=(
        "class-agnostic foreground path (round 0's objects from boundary-connectivity saliency, not the CAMs); "
        "auto: on with an implicit background when an object class is tagged on every training image or at "
        "least half of the images carry one tag (photos of one object each; a corpus of scenes with several "
        "tagged objects an image, such as coco128, stays off); on / off: always / never; on the path each "
        "pseudo-label is GrabCut of the whole image from the mean foreground evidence "
        "(tasks.wsss.foreground.foreground_label), not fusion and seeding, see "
        "docs/benchmarks.md#foreground-path and docs/method.md#class-agnostic-foreground-path"))
    grabcut_sure: float = Field(0.85, gt=0.5, le=1, description=(
        "foreground probability above which a pixel starts as sure foreground (above 0.5: probable)"))
    grabcut_border: float = Field(0.02, ge=0, lt=0.5, description=(
        "width of the border strip that starts as sure background, as a share of the shorter side"))
    grabcut_iters: int = Field(3, ge=1, description="GrabCut iterations of the foreground path's pseudo-label")
    cluster_weight: float = Field(0.75, ge=0, le=1, description=(
        "round 0's foreground on the path: this weight of the corpus-wide clusters' foreground (k-means, k=2, "
        "of round 0's superpixel features over the trainers' images; the cluster that touches the image "
        "borders least is the object) against 1 - weight of each image's own saliency; 0: the saliency alone "
        "(the only choice with features.deep_features=none). Lower it where the corpus's objects differ "
        "more from each other than from their scenes; see docs/method.md#class-agnostic-foreground-path"))


#: the trainers' default bound (``WSSSConfig.train_images``), chosen from the curve in
#: docs/large-corpora.md#the-trainers-sample
TRAIN_IMAGES = 10_000


class WSSSConfig(BaseModel):
    """Everything a refresh run depends on."""

    model_config = ConfigDict(extra="forbid")

    features: FeatureConfig = FeatureConfig()
    classifier: ClassifierConfig = ClassifierConfig()
    mil: MILConfig = MILConfig()
    proposals: ProposalConfig = ProposalConfig()
    segmentation: SegmentationConfig = SegmentationConfig()
    inference: InferenceConfig = InferenceConfig()
    foreground: ForegroundConfig = ForegroundConfig()
    prelim_normalize: bool = Field(True, description=(
        "rounds >= 1: divide each tagged class's probability by its maximum over the image before "
        "the preliminary result is used [ours] (a tag says the class is there)"))
    prior_weight: float = Field(0.5, ge=0, le=1, description=(
        "rounds >= 1: weight of round 0's pseudo-labels in the preliminary result, a geometric mixture with "
        "the model r-1 output [ours] (each pixel's round-0 label holds half of the prior, the image's tagged "
        "classes share the other half: they kept the rare classes a segmenter forgets, see "
        "docs/benchmarks.md#the-rounds-keep-round-0s-labels); 0 = the model alone, as METHOD.md step 1; 0.5 "
        "keeps objects an underfit segmenter forgets, see docs/benchmarks.md#msrc21-bench-quality"))
    max_rounds: int = Field(3, ge=1, description="round budget: the most refresh rounds a run computes")
    epsilon: float = Field(0.02, description="converged when the share of pseudo-label pixels changed since the "
                                             "round before (0-1) falls below this")
    stopping: Literal["oscillation", "budget"] = Field("oscillation", description=(
        "oscillation: a round that oscillates (half of its changed pixels revert) ends the rounds, the round "
        "before final (no mask needed); budget: the last round; see docs/method.md#stopping-without-masks"))
    split: str = Field("train", description="the corpus split whose images the rounds label and train on")
    shard_size: int = Field(64, ge=1, description=(
        "images per shard task (a Dask worker's unit of work), grown so a stage has at most max_shards tasks; "
        "64 keeps a task's fixed cost a few percent of its work (docs/benchmarks.md#shard-task-cost); lower "
        "it for fewer than 64 x workers images; results do not depend on it"))
    max_shards: int = Field(2000, ge=1, description=(
        "most shard tasks (Prefect task runs) per stage: a corpus above shard_size * max_shards images "
        "(128,000 by default) gets shards of ceil(images / max_shards); 2000 tasks add minutes to a stage "
        "of hours (docs/benchmarks.md#shard-task-cost); results do not depend on the shards"))
    train_images: int | None = Field(TRAIN_IMAGES, ge=1, description=(
        "the most images the corpus-wide trainers learn from (the image classifier, and each round's MIL and "
        "proposal classifiers and segmenter): above it, a seeded sample of the split, the same in every round, "
        "that keeps every image a person corrected; the shard stages still label every image, and a split of at "
        "most this many images is trained on whole, as if there were no bound. null: every image, however many "
        "(a round's training time then grows with the corpus). Why this default, and what a sample gives up: "
        "docs/large-corpora.md#the-trainers-sample"))
    seed: int = Field(0, description="random seed of the run's trainings and samplings (round r's MIL: seed + r)")
    device: str = Field("auto", description="where training runs: auto (CUDA when present, else CPU), cpu or cuda")
    pretrained: dict[str, str] = Field(default_factory=dict, description=(
        "sha256 of each ImageNet weight file the run's encoders start from, by encoder name; filled in when a "
        "run starts (tasks.corpus.encoders.with_weight_digests), so a run directory started with one file is not "
        "resumed with another; not set by hand"))

    @model_validator(mode="after")
    def _features_have_an_encoder(self) -> "WSSSConfig":
        # at load time, not after the classifier's training: the pooled maps are an EfficientNet-Lite's levels
        if self.features.deep_features == "classifier" and self.classifier.encoder == "small":
            raise ValueError("features.deep_features 'classifier' pools the maps of an EfficientNet-Lite classifier "
                             "encoder; with classifier.encoder small set features.deep_features=none")
        return self


def shard_size_for(n_images: int, shard_size: int, max_shards: int = 2000) -> int:
    """Images per shard of a stage over ``n_images``: ``shard_size``, grown to
    ``ceil(n_images / max_shards)`` so that the stage has at most ``max_shards`` shard tasks.

    >>> shard_size_for(1000, 16), shard_size_for(1_000_000, 16), shard_size_for(1_000_001, 16)
    (16, 500, 501)
    """
    return max(shard_size, -(-n_images // max_shards))


class Scope(str, Enum):
    """What a change of an option computes again in a run directory that has results (see
    :data:`OPTIONS`), from the least to the most. The image classifier, each round's
    pseudo-labels and each round's segmenter record what they were computed from (their
    checkpoint's metadata, ``rounds/rNNN/inputs.json``); a run resumed with another value keeps
    what the option's scope says it does not reach."""

    #: nothing: not recorded, not compared, not in the configuration's digest (where the work
    #: runs: a GPU's numbers may differ in the last digits, accepted)
    RUNTIME = "runtime"
    #: no round's content: recorded with the run's configuration, left out of the rounds' inputs (how far the
    #: rounds go, how untagged images are labelled, how images are cut into shard tasks)
    NO_ROUND = "no_round"
    #: the decision taken after a finished round (stop there? which round is final?), taken again
    #: from the round's record; its model is kept where the decision stands
    #: (flows.wsss.keep_round_inputs)
    DECISION = "decision"
    #: the run's final model (the last round's) alone, whose output no round starts from: every
    #: round before the last is kept whole and the final model is trained again
    FINAL_MODEL = "final_model"
    #: the rounds' segmenters, not their pseudo-labels: a round keeps its labels and trains its
    #: model again, and the later rounds go
    MODEL = "model"
    #: rounds >= 1 (round 0's preliminary result comes from the image classifier): round 0 is
    #: kept whole, model included, and round 1 on is computed again
    FROM_ROUND_1 = "from_round_1"
    #: how the image classifier's maps are read into round 0's preliminary result, not how it is
    #: trained: the trained classifier is kept (tasks.wsss.classifier.train_image_classifier) and
    #: every round is computed again
    CAM_READING = "cam_reading"
    #: everything the option feeds, from the first result that reads it (the image classifier for
    #: its own settings, the features, round 0 on): the default of every field without a row
    ALL = "all"


#: What each stored result depends on: each option or section (a dotted path of
#: :class:`WSSSConfig`) whose change does not compute everything again, with its :class:`Scope`
#: and why. The longest path that holds an option decides (``segmentation.class_balance`` is
#: FINAL_MODEL inside a MODEL section); an option under no row is :attr:`Scope.ALL`. A row may
#: name an option of :data:`REMOVED_OPTIONS`: a record of an older wsseg holds it, and another
#: value than the kept one computes again what it fed, no more. The code reads it through
#: :func:`options_with`; tests/test_config.py checks it against the configuration's fields.
OPTIONS: dict[str, tuple[Scope, str]] = {
    "device": (Scope.RUNTIME, "where training runs; a run directory moved to a GPU machine keeps its rounds"),
    "max_rounds": (Scope.NO_ROUND, "the round budget: a run may be taken further, or stopped earlier"),
    "inference": (Scope.NO_ROUND, "how a trained segmenter labels untagged images, after the rounds"),
    "shard_size": (Scope.NO_ROUND, "how the images are cut into shard tasks; results do not depend on it"),
    "max_shards": (Scope.NO_ROUND, "how the images are cut into shard tasks; results do not depend on it"),
    "epsilon": (Scope.DECISION, "the stopping rule reads a finished round's record (its changed share)"),
    "stopping": (Scope.DECISION, "the stopping rule reads a finished round's record (its changed share)"),
    "segmentation": (Scope.MODEL, "the segmenter is trained on a round's labels, after them"),
    "segmentation.class_balance": (Scope.FINAL_MODEL, "the rounds' segmenters read rounds_class_balance instead"),
    "segmentation.boundary_ignore": (Scope.FINAL_MODEL, "the rounds' segmenters read rounds_boundary_ignore "
                                                        "instead"),
    "prelim_normalize": (Scope.FROM_ROUND_1, "acts on model r-1's probabilities; round 0 has no model before it"),
    "prior_weight": (Scope.FROM_ROUND_1, "mixes round 0 into the later rounds' preliminary result"),
    "prior_source": (Scope.FROM_ROUND_1, "removed: what the later rounds kept of round 0"),
    "classifier.cam_scales": (Scope.CAM_READING, "the scales whose maps are averaged, after training (the first "
                                                 "also gives round 0's superpixel features)"),
    "classifier.background_threshold": (Scope.CAM_READING, "the implicit background's score beside the maps"),
    "classifier.cam_mode": (Scope.CAM_READING, "removed: centred or max-normalised maps"),
    "classifier.cam_temperature": (Scope.CAM_READING, "removed: the softmax temperature of centred maps"),
    "classifier.cam_centring": (Scope.CAM_READING, "removed: the share of a map's mean subtracted"),
    "classifier.background_rule": (Scope.CAM_READING, "removed: the background's score against the tag count"),
}

#: The final model's segmentation fields that the rounds' own segmenters read from a field of
#: their own (the final model's field -> the rounds' field): tasks.wsss.segmenter.round_model_config
#: puts the rounds' value in the final model's place, which is why those are :attr:`Scope.FINAL_MODEL`.
ROUND_SETTINGS = {"class_balance": "rounds_class_balance", "boundary_ignore": "rounds_boundary_ignore"}


def scope_of(path: str) -> Scope:
    """The :class:`Scope` of an option or section at dotted ``path``: that of the longest row of
    :data:`OPTIONS` that holds it, :attr:`Scope.ALL` under none.

    >>> scope_of("segmentation.epochs"), scope_of("segmentation.class_balance"), scope_of("classifier.epochs")
    (<Scope.MODEL: 'model'>, <Scope.FINAL_MODEL: 'final_model'>, <Scope.ALL: 'all'>)
    """
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        row = OPTIONS.get(".".join(parts[:n]))
        if row is not None:
            return row[0]
    return Scope.ALL


def options_with(*scopes: Scope, under: str | None = None) -> tuple[str, ...]:
    """The rows of :data:`OPTIONS` whose scope is one of ``scopes``, as dotted paths; with
    ``under``, those of one level below it, by their own name (``""``: the top-level fields,
    ``"classifier"``: the classifier's options).

    >>> options_with(Scope.RUNTIME, Scope.NO_ROUND, under="")
    ('device', 'max_rounds', 'inference', 'shard_size', 'max_shards')
    >>> options_with(Scope.FINAL_MODEL)
    ('segmentation.class_balance', 'segmentation.boundary_ignore')
    >>> options_with(Scope.CAM_READING, under="classifier")[:2]
    ('cam_scales', 'background_threshold')
    """
    rows = [path for path, (scope, _) in OPTIONS.items() if scope in scopes]
    if under is None:
        return tuple(rows)
    prefix = f"{under}." if under else ""
    return tuple(p[len(prefix):] for p in rows if p.startswith(prefix) and "." not in p[len(prefix):])


#: the top-level fields no round depends on (:attr:`Scope.RUNTIME`, :attr:`Scope.NO_ROUND`), left
#: out of the rounds' inputs and of the "what changed" lines
NOT_IN_ROUNDS = options_with(Scope.RUNTIME, Scope.NO_ROUND, under="")


_MISSING = object()

@dataclass(frozen=True)
class SameAs:
    """The value an added option had before it existed: the recorded value of ``option``, another
    option of the same section (``segmentation.rounds_class_balance`` split off ``class_balance``)."""

    option: str


#: Options added after run directories were first recorded, each with the value that does what
#: wsseg did before it existed. A recorded configuration (an older wsseg's) that lacks one of these
#: holds that value: no change while today's value is it, so upgrading wsseg does not reprocess a
#: corpus whose results would not change (``cam_centring``, ``train_images``: their defaults), and a
#: run computed before ``prior_source`` (with 'cam', the prior of then) is computed again with 'labels',
#: the prior kept. Any other option a record lacks is a change.
ADDED_OPTIONS: dict[str, Any] = {"classifier.cam_centring": 1.0, "train_images": None, "prior_source": "cam",
                                 "classifier.background_rule": "constant",
                                 "segmentation.rounds_class_balance": SameAs("class_balance"),
                                 "segmentation.boundary_ignore": 0, "segmentation.rounds_boundary_ignore": 0}

#: Options removed once their measurements were in ("keep what won"), each with the value wsseg
#: kept (its default when it went; docs/benchmarks.md#defaults-and-why says why, and which commit
#: to check out for the others). A recorded configuration that holds one with that value computed
#: what wsseg computes today: no change; another value is a change, and computes again what the
#: option fed (its scope in :data:`OPTIONS`). An option both added and removed that a record lacks
#: holds its :data:`ADDED_OPTIONS` value (``background_rule``: 'constant', a change).
REMOVED_OPTIONS: dict[str, Any] = {
    "classifier.cam_mode": "auto", "classifier.cam_temperature": 1.0, "classifier.cam_centring": 1.0,
    "classifier.background_rule": "tag_count",
    "proposals.negatives": True, "proposals.mil_iterations": 0, "proposals.evidence": "prelim",
    "proposals.evidence_weight": 0.5, "proposals.clustering": "kmeans", "proposals.clustering_lo": 0.3,
    "proposals.clustering_hi": 0.7, "proposals.min_confidence": 0.0,
    "mil.hidden": 0, "mil.min_share": 0.0, "mil.negatives": "first_round",
    "segmentation.final_model": "full_budget", "foreground.grabcut": True, "prior_source": "labels"}


#: Choices removed from options that remain, by dotted path: a record holding one loads with the
#: option's default (:func:`without_removed`), and compares as a change.
REMOVED_CHOICES: dict[str, tuple[str, ...]] = {"features.superpixel_method": ("mslic", "skimage_slic"),
                                               "features.deep_features": ("lite0", "lite1", "lite2"),
                                               "stopping": ("auto",)}


def without_removed(record: dict | None) -> dict:
    """A recorded configuration (config.json, as JSON) that :class:`WSSSConfig` can load: without
    the :data:`REMOVED_OPTIONS`, and without an option that holds a :data:`REMOVED_CHOICES` value
    (it loads with its default). What the record held is still compared where a result's inputs
    are (:func:`config_difference`): a value other than the kept one is a change.

    >>> without_removed({"prior_source": "cam", "stopping": "auto", "classifier": {"cam_mode": "auto", "epochs": 8}})
    {'classifier': {'epochs': 8}}
    """
    out = dict(record or {})
    for path in list(REMOVED_OPTIONS) + [p for p, values in REMOVED_CHOICES.items()
                                         if _held(out, p) and _value_at(out, p) in values]:
        head, _, leaf = path.rpartition(".")
        section = out.get(head) if head else out
        if isinstance(section, dict) and leaf in section:
            section = {k: v for k, v in section.items() if k != leaf}
            out = {**out, head: section} if head else section
    return out


def _value_at(record: dict, path: str) -> Any:
    node: Any = record
    for part in path.split("."):
        node = node[part]
    return node


@dataclass(frozen=True)
class Removed:
    """Today's value of a :data:`REMOVED_OPTIONS` option in a "what changed" line: the value kept.

    >>> str(Removed("labels"))
    'labels (removed)'
    """

    kept: Any

    def __str__(self) -> str:
        return f"{self.kept} (removed)"


def _before(path: str, section: dict | None) -> Any:
    """The value of added option ``path`` (:data:`ADDED_OPTIONS`) in a record that lacks it, whose
    section (the dict holding it) is ``section``; ``_MISSING`` where it has none."""
    if path not in ADDED_OPTIONS:
        return _MISSING
    value = ADDED_OPTIONS[path]
    return (section or {}).get(value.option, _MISSING) if isinstance(value, SameAs) else value


def _differs(previous: Any, current: Any, path: str, section: dict | None = None) -> bool:
    """Whether a recorded configuration value (at dotted ``path``, in the recorded ``section``)
    differs from today's; an :data:`ADDED_OPTIONS` field the record lacks holds its value from
    before the option existed, and a :data:`REMOVED_OPTIONS` field today lacks holds the value kept.

    >>> _differs({"class_balance": 0.0}, {"class_balance": 0.0, "rounds_class_balance": 0.0}, "segmentation")
    False
    >>> _differs({"class_balance": 0.5}, {"class_balance": 0.5, "rounds_class_balance": 0.0}, "segmentation")
    True
    >>> _differs({"epochs": 8, "cam_mode": "auto"}, {"epochs": 8}, "classifier")
    False
    >>> _differs({"epochs": 8, "background_rule": "constant"}, {"epochs": 8}, "classifier")
    True
    """
    if isinstance(previous, dict) and isinstance(current, dict):
        return any(_differs(previous.get(k, _MISSING), current.get(k, _MISSING), f"{path}.{k}" if path else k,
                            previous) for k in set(previous) | set(current))
    if previous is _MISSING:
        previous = _before(path, section)
    if current is _MISSING:
        current = REMOVED_OPTIONS.get(path, _MISSING)
    return previous is _MISSING or current is _MISSING or previous != current


def recorded_differs(previous: Any, current: Any, path: str) -> bool:
    """Whether a value recorded as JSON (a checkpoint's recipe, say) at dotted ``path`` of
    :class:`WSSSConfig` differs from today's, an :data:`ADDED_OPTIONS` option the record lacks
    holding its value from before it existed.

    >>> recorded_differs({"epochs": 3}, {"epochs": 3, "rounds_boundary_ignore": 0}, "segmentation")
    False
    """
    return _differs(previous, current, path)


def with_added_options(record: dict, removed: bool = False) -> dict:
    """A recorded configuration (as JSON) with every :data:`ADDED_OPTIONS` option its sections lack
    set to its value from before it existed, so that a part of it can be left out
    (:func:`tasks.corpus.resume.round_view`) without losing what another option stood for.

    With ``removed``, only the options also in :data:`REMOVED_OPTIONS`, and only in a record written
    before they went: today's configuration lacks them as well, so the value a record lacking one
    was computed with must be put in before a part of it is left out. Such a record is known by
    holding a removed option that was never added (``classifier.cam_mode``, in every record until
    the options went); a configuration of today's wsseg, or a record written by it, is returned as
    it is.

    >>> with_added_options({"segmentation": {"class_balance": 0.0}})["segmentation"]
    {'class_balance': 0.0, 'rounds_class_balance': 0.0, 'boundary_ignore': 0, 'rounds_boundary_ignore': 0}
    >>> old = {"seed": 0, "classifier": {"epochs": 8, "cam_mode": "auto"}}
    >>> with_added_options(old, removed=True)
    {'seed': 0, 'classifier': {'epochs': 8, 'cam_mode': 'auto', 'cam_centring': 1.0, 'background_rule': 'constant'}, 'prior_source': 'cam'}
    >>> with_added_options({"seed": 0, "classifier": {"epochs": 8}}, removed=True)
    {'seed': 0, 'classifier': {'epochs': 8}}
    """
    if removed and not any(_held(record, path) for path in REMOVED_OPTIONS if path not in ADDED_OPTIONS):
        return record
    out = dict(record)
    for path in ADDED_OPTIONS:
        if removed and path not in REMOVED_OPTIONS:
            continue
        head, _, leaf = path.rpartition(".")
        section = out.get(head) if head else out
        if isinstance(section, dict) and leaf not in section:
            before = _before(path, section)
            if before is not _MISSING:
                section = {**section, leaf: before}
                out = {**out, head: section} if head else section
    return out


def _held(record: dict, path: str) -> bool:
    """Whether a recorded configuration holds the option at dotted ``path``.

    >>> _held({"classifier": {"cam_mode": "auto"}}, "classifier.cam_mode"), _held({}, "prior_source")
    (True, False)
    """
    node: Any = record
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


def changed_fields(previous: dict, current: dict) -> list[str]:
    """The top-level fields (as JSON) in which ``current`` differs from ``previous``, leaving out
    :data:`NOT_IN_ROUNDS`; an :data:`ADDED_OPTIONS` option an older wsseg did not record holds
    its value from before it existed, a :data:`REMOVED_OPTIONS` option today's lacks the value kept.

    >>> changed_fields({"seed": 0, "prior_source": "labels"}, {"seed": 0})
    []
    >>> changed_fields({"seed": 0, "prior_source": "cam"}, {"seed": 0})
    ['prior_source']
    """
    return sorted(k for k in set(previous) | set(current) if k not in NOT_IN_ROUNDS
                  and _differs(previous.get(k, _MISSING), current.get(k, _MISSING), k))


def settings_changed(previous: dict, current: BaseModel, path: str, ignore: tuple[str, ...] = ()) -> bool:
    """Whether settings recorded as JSON (a checkpoint's) differ from ``current``'s, the sub-configuration
    at ``path`` of :class:`WSSSConfig` (``"classifier"``; see :data:`ADDED_OPTIONS`), leaving out the
    fields named in ``ignore`` (e.g. ``options_with(Scope.CAM_READING, under="classifier")``).

    >>> trained = ClassifierConfig().model_dump(mode="json")
    >>> reading = options_with(Scope.CAM_READING, under="classifier")
    >>> settings_changed(trained, ClassifierConfig(background_threshold=0.5), "classifier", reading)
    False
    >>> settings_changed(trained, ClassifierConfig(epochs=4), "classifier", reading)
    True
    >>> settings_changed({**trained, "cam_mode": "normalized"}, ClassifierConfig(), "classifier", reading)
    False
    """
    now = {k: v for k, v in current.model_dump(mode="json").items() if k not in ignore}
    return _differs({k: v for k, v in previous.items() if k not in ignore}, now, path)


def sampled(limit: int | None, images: int | None) -> int | None:
    """``train_images`` as the rounds depend on it: None (every image) when the split holds no
    more than ``limit`` images, so that a corpus under the bound keeps its rounds whatever the
    bound (a changed default, a larger ``--set train_images``) and a run directory of an older
    wsseg, which recorded None, is not computed again.

    >>> sampled(20000, 276), sampled(20000, 10**5), sampled(None, 10**5)
    (None, 20000, None)
    """
    return None if limit is None or images is None or images <= limit else limit


def in_effect(config: dict, implicit_background: bool) -> dict:
    """A configuration (as JSON) without what acts on nothing in a corpus with or without an
    implicit background: ``classifier.background_rule`` (removed, :data:`REMOVED_OPTIONS`; an older
    record holds it) read the implicit background's CAM score, so without one another rule changed
    no result.

    >>> in_effect({"classifier": {"epochs": 8, "background_rule": "tag_count"}}, False)
    {'classifier': {'epochs': 8}}
    """
    if implicit_background or not isinstance(config.get("classifier"), dict):
        return config
    return {**config, "classifier": {k: v for k, v in config["classifier"].items() if k != "background_rule"}}


def recorded_config(config: WSSSConfig | dict | None) -> dict | None:
    """A configuration as a run directory records it (config.json): as JSON, without where the work
    runs (:attr:`Scope.RUNTIME`); a record of an older wsseg that holds it is read so too.

    >>> recorded_config({"device": "cuda", "seed": 1})
    {'seed': 1}
    >>> "device" in recorded_config(WSSSConfig())
    False
    """
    if config is None:
        return None
    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    return {k: v for k, v in data.items() if k not in options_with(Scope.RUNTIME, under="")}


def changed_options(previous: dict, current: dict, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Each option (dotted) in which configuration ``current`` (as JSON) differs from ``previous``,
    with its value before and now (:data:`NOT_IN_ROUNDS` left out at the top; an
    :data:`ADDED_OPTIONS` option a record lacks holds its value from before it existed; a
    :data:`REMOVED_OPTIONS` option today's lacks shows the value kept, :class:`Removed`): what a
    terminal line names.

    >>> changed_options({"classifier": {"epochs": 12, "size": 160}, "seed": 0, "max_rounds": 3},
    ...                 {"classifier": {"epochs": 8, "size": 160}, "seed": 0, "max_rounds": 5})
    [('classifier.epochs', 12, 8)]
    >>> [(k, a, str(b)) for k, a, b in changed_options({"prior_source": "cam", "mil": {"hidden": 0}}, {"mil": {}})]
    [('prior_source', 'cam', 'labels (removed)')]
    """
    out = []
    for k in sorted(set(previous) | set(current)):
        path = f"{prefix}{k}"
        if not prefix and k in NOT_IN_ROUNDS:
            continue
        a, b = previous.get(k, _MISSING), current.get(k, _MISSING)
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_options(a, b, f"{path}.")
        elif _differs(a, b, path, previous):
            now = Removed(REMOVED_OPTIONS[path]) if b is _MISSING and path in REMOVED_OPTIONS else b
            out.append((path, None if a is _MISSING else a, None if now is _MISSING else now))
    return out


def config_difference(previous: dict | None, current: WSSSConfig, implicit_background: bool = True,
                      images: int | None = None) -> list[str]:
    """The top-level fields in which ``current`` differs from the configuration a run directory
    was started with (``previous``, as JSON), leaving out :data:`NOT_IN_ROUNDS` (see
    :func:`changed_fields`) and what acts on nothing in its corpus (:func:`in_effect`): with the
    split's image count ``images``, a ``train_images`` bound that does not cut it (:func:`sampled`).

    >>> every = recorded_config(WSSSConfig(train_images=None))
    >>> config_difference(every, WSSSConfig(train_images=300), images=276)
    []
    >>> config_difference(every, WSSSConfig(train_images=200), images=276)
    ['train_images']
    """
    if previous is None:
        return []
    before = in_effect(with_added_options(previous, removed=True), implicit_background)
    now = in_effect(current.model_dump(mode="json"), implicit_background)
    if images is not None:
        before, now = ({**c, "train_images": sampled(c.get("train_images"), images)} if "train_images" in c else c
                       for c in (before, now))
    return changed_fields(before, now)
