"""Typed parameters of the flows: every threshold and choice of METHOD.md is one field here,
so Prefect shows and records it with each flow run and MLflow logs it with each round."""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class FeatureConfig(BaseModel):
    """Per-image features, computed once per image content and parameter set (step 2, B)."""

    model_config = ConfigDict(extra="forbid")

    superpixel_method: Literal["slico", "slic", "mslic", "skimage_slic", "felzenszwalb"] = "slico"
    region_size: int = Field(16, ge=4, description="superpixel side in pixels")
    ruler: float = 10.0
    edge_sigma: float = 1.0
    edge_tau: float = Field(0.5, description="tau of the weighted vote F = sum w_k X_k - (1 + tau)")
    proposal_min_size: float = Field(0.002, description="smallest proposal, share of the image")
    proposal_diversify: bool = False
    deep_features: Literal["lite0", "lite1", "lite2", "none"] = Field("lite0", description=(
        "superpixel (and so proposal) features from an ImageNet-pretrained EfficientNet-Lite's stride-8/16/32 "
        "maps, beside the colour and texture ones: what the superpixel MIL and the proposal classifier learn "
        "from; 'none' = the hand-made features alone (tasks.deep_features; README, Pretrained encoders)"))


class ClassifierConfig(BaseModel):
    """The image classifier whose CAMs are round 0's preliminary result (step 4)."""

    model_config = ConfigDict(extra="forbid")

    encoder: Literal["lite0", "lite1", "lite2", "small"] = Field("lite0", description=(
        "the classifier's encoder: an EfficientNet-Lite with ImageNet weights from its pinned package "
        "(lite0; lite1 and lite2 need their own packages), or 'small', trained from scratch (width, "
        "stride 8 and epochs 40 were its settings); see README, Pretrained encoders"))
    epochs: int = Field(8, ge=1, description="training epochs over the tagged images (a pretrained encoder "
                                              "needs few; 'small' wants about 40)")
    size: int = 224
    scale: tuple[float, float] = Field((0.8, 1.6), description=(
        "random rescaling range of the training crops. Measured on msrc21 train (CAM mIoU at cam_scales "
        "1.0 / 1.5): (0.6, 1.1) 0.386 / 0.402, (0.8, 1.6) 0.396 / 0.416"))
    width: int = Field(16, description="encoder 'small' only: channels of its first stage")
    stride: int = Field(16, description="CAM stride in pixels: 16, or 8 (dilated later stages: finer maps, "
                                        "about twice the cost)")
    batch_size: int = 16
    lr: float = Field(2e-3, description="learning rate of the class map; a pretrained encoder learns at a "
                                        "tenth of it (models.lite_nets.ENCODER_LR)")
    max_seconds: float | None = None
    cam_scales: tuple[float, ...] = Field((1.5,), description=(
        "image scales whose CAMs are averaged; the stride-8 map is coarse on 320-pixel photos, so "
        "1.5 beats 1.0 (see scale) and (0.75, 1.0, 1.25) (0.386)"))
    cam_mode: Literal["auto", "centered", "normalized"] = Field("auto", description=(
        "centered: class maps minus their image mean, softmax over the tags; normalized: ReLU CAMs "
        "divided by their maximum; auto: centered without an implicit background class"))
    cam_temperature: float = Field(1.0, gt=0, description="softmax temperature of centered class maps")
    background_threshold: float = Field(0.35, description="CAM score of the implicit background class")


class ProposalConfig(BaseModel):
    """Proposal classifier (step 3, cross-entropy), filtering (5), fusion (6), seeding (7)."""

    model_config = ConfigDict(extra="forbid")

    hidden: int = 256
    epochs: int = Field(10, ge=1, description=(
        "measured on msrc21 train, round 0: 0.501 mIoU with 10 epochs, 0.504 with 30 at three times the "
        "time (about 30 s against 90 s a round on 2 cores)"))
    lr: float = 1e-3
    negatives: bool = Field(True, description=(
        "train over every class (an untagged class is a negative for the image's proposals), not only the "
        "tags; prediction is restricted to the tags either way. Measured on msrc21 train (runs of "
        "2026-12-01, same classifier): rounds 0 / 1 / 2 0.622 / 0.657 / 0.674 with, 0.622 / 0.645 / 0.661 "
        "over the tags only: the gain comes in the rounds whose preliminary result is the segmenter's"))
    target_sharpen: float = 2.0
    mil_iterations: int = Field(0, ge=0, description="retrain the proposal classifier on the combined evidence")
    evidence: Literal["prelim", "combined"] = Field(
        "prelim", description="map used as the preliminary mask for IoU filtering: the preliminary result, or "
                                "its geometric mixture with the proposal classifier's superpixel scores [ours]")
    evidence_weight: float = Field(0.5, ge=0, le=1, description="weight of the preliminary result in the mixture")
    max_samples: int = Field(1_000_000, ge=1, description=(
        "most proposals the classifier's training holds in memory at once (about 1 KB each): a corpus "
        "with fewer trains in memory, a larger one streams its proposals from a temporary folder "
        "(TMPDIR) each epoch, in chunks of at most this many (README, Large corpora: Memory)"))
    t1: float = Field(0.0, ge=0, le=1, description=(
        "IoU filtering (METHOD.md step 5): a positive proposal overlaps the preliminary mask by at least t1. "
        "0 with p1 0 = every proposal positive: measured on msrc21 train, 3 rounds, 0.591 with t1 0.3 / "
        "p1 0.5 (the earlier default), 0.621 with 0 / 0"))
    p1: float = Field(0.0, ge=0, le=1, description="IoU filtering: ... and has class probability at "
                                                   "least p1")
    t2: float = Field(0.1, ge=0, le=1)
    p2: float = Field(0.2, ge=0, le=1)
    fusion: Literal["topk", "threshold"] = Field("threshold", description=(
        "per-class fusion of the positive proposals (METHOD.md step 6): every proposal with probability >= "
        "threshold, or the k most probable. Measured on msrc21 train against top-k 5: round 0 +0.020 and "
        "+0.010 mIoU (two runs), round 2 +0.019"))
    k: int = 5
    threshold: float = 0.5
    clustering: Literal["kmeans", "quantile", "threshold"] = "kmeans"
    clustering_lo: float = Field(0.3, description="quantile/threshold clustering: lower cut")
    clustering_hi: float = Field(0.7, description="quantile/threshold clustering: upper cut")
    seeding: Literal["random_walker", "grabcut", "none"] = Field("grabcut", description=(
        "seeded segmentation of the ambiguous area (METHOD.md step 7). Measured on msrc21 train against the "
        "random walker: round 0 0.580 -> 0.609, rounds 1 / 2 0.622 / 0.637 -> 0.648 / 0.658 and 0.651 / 0.649 "
        "(two runs), WSSS model on val 0.265 -> 0.270 and 0.253 (gated; the model varies more between runs "
        "than this), for about 0.12 s more per image (one worker)"))
    grabcut_iters: int = Field(3, ge=1, description=(
        "cv2.grabCut iterations per label; round 0 on msrc21 train: 1 0.606, 2 0.608, 3 0.609"))
    beta: float = 130.0
    seed_prior_weight: float = Field(0.5, ge=0, le=1, description=(
        "weight of the preliminary evidence beside the seeded segmentation's probabilities in the "
        "ambiguous area [ours]; 0 = colour and seeds alone, as METHOD.md step 7"))
    downscale: int = 2
    min_confidence: float = 0.0


class MILConfig(BaseModel):
    """Superpixel multiple-instance refinement of the preliminary result [ours]: a corpus-wide
    superpixel classifier, labels restricted to the tags, reassigned ``iterations`` times."""

    model_config = ConfigDict(extra="forbid")

    iterations: int = Field(6, ge=0, description="0 = off: the preliminary result goes to step 3 as it is")
    prior_weight: float = Field(0.3, ge=0, le=1, description="weight of the preliminary result in each mixture")
    hidden: int = Field(0, ge=0, description=(
        "0 = multinomial logistic regression; > 0 = two-hidden-layer MLP. Measured on msrc21 train from "
        "a 0.387 CAM, 6 iterations: linear 0.429 in 10 s, MLP 256 0.417 in 116 s"))
    min_share: float = Field(0.15, ge=0, lt=1, description=(
        "each tagged class claims at least this share of its image's area in the MIL targets (where its "
        "evidence is relatively highest); 0 = plain argmax. Measured on msrc21 train from the 0.416 CAM: "
        "0.487 without, 0.501 with 0.15 (aeroplane 0.002 -> 0.159)"))
    negatives: Literal["first_round", "all_rounds", "off"] = Field("first_round", description=(
        "softmax over every class in training: a superpixel of an image is a negative for every class the "
        "image is not tagged with (the negative bags of MIL), so each class learns against its look-alikes "
        "across the corpus, not only against the classes it shares images with. off = softmax over the "
        "tags only. first_round: round 0 only, whose preliminary result (the CAMs) is made image by image; "
        "later rounds start from a segmenter that already weighed every class against every other. "
        "Measured on msrc21 train, MIL evidence alone, 6 iterations: from the 0.416 CAM 0.501 off, 0.579 "
        "with negatives; from round 1's preliminary result 0.614 off, 0.602 with (aeroplane 0.51 -> 0.31)"))
    epochs: int = 10
    lr: float = 3e-3
    max_samples: int = Field(1_000_000, ge=1, description=(
        "most superpixels the MIL holds in memory at once (about 1 KB each): a corpus with fewer "
        "trains in memory, a larger one streams its superpixels from a temporary folder (TMPDIR) each "
        "epoch, in chunks of at most this many (README, Large corpora: Memory)"))

    def negatives_in(self, round_index: int) -> bool:
        """Whether round ``round_index``'s MIL trains with negatives (see ``negatives``)."""
        return self.negatives == "all_rounds" or (self.negatives == "first_round" and round_index == 0)


class SegmentationConfig(BaseModel):
    """The segmentation model trained on the pseudo-labels (step 8)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field("lite", description=(
        "registry name: lite (EfficientNet-Lite encoder with ImageNet weights and a light decoder), small "
        "(trained from scratch), fusion, global_local"))
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="builder options of the model, e.g. {'variant': 'lite1'} for lite, "
                                                "{'width': 16} for small, {'width': 0.25} for fusion")
    backbone_weights: dict[str, str] = Field(default_factory=dict,
                                             description="fusion: {'resnet50': path, 'mobilenet_v2': path} "
                                                         "torchvision ImageNet checkpoints")
    epochs: int = Field(3, ge=1, description=(
        "training epochs of a round's segmenter (the final model gets epochs x rounds, final_model); the pretrained lite network needs few, 'small' was run with 6"))
    batch_size: int = 8
    lr: float = 2e-3
    crop: int = 192
    max_seconds: float | None = None
    patience: int = 4
    min_steps: int = Field(0, ge=0, description="raise the epochs so that small corpora still get this many steps")
    class_balance: float = Field(0.5, ge=0, le=1, description=(
        "cross-entropy class weights (pixel share of the class in the labels) ** -class_balance, mean 1 "
        "over the classes present; 0 = unweighted. Without it the network learns to drop small classes "
        "that co-occur with large ones (msrc21 round 0: car 0.35 IoU in the pseudo-labels, 0.003 in "
        "the model's output)"))
    use_edges: bool = Field(True, description="feed the feature-region map as a 4th input channel")
    finetune: bool = Field(True, description="start round r from model r-1")
    final_model: Literal["full_budget", "finetune"] = Field("full_budget", description=(
        "how the last round (max_rounds reached, or converged) trains its model, the run's final model: "
        "'full_budget' starts it like round 0 (encoder_init) and trains it for epochs x rounds run on the "
        "final labels, the recipe of bench quality's supervised reference, so the two differ only in their "
        "labels; 'finetune' fine-tunes the round before for `epochs`, like the other rounds. Measured on "
        "msrc21 val, gated, two runs' final labels: 0.289 / 0.280 against 0.276 / 0.253 fine-tuned"))
    encoder_init: Literal["classifier", "none"] = Field("classifier", description=(
        "where the segmenter's encoder starts when it does not fine-tune an earlier round's model "
        "(round 0, the final model, the supervised reference): 'classifier' copies the run's image "
        "classifier's encoder (same kind: lite with lite, small with small), trained on the same tags; "
        "'none' the network's own start (ImageNet for lite, random for small). Other networks (fusion, "
        "global_local) start as their builder makes them either way; see README, Pretrained encoders"))
    num_workers: int = 1
    coarse_loss: float = Field(0.0, ge=0, description=(
        "global_local built with coarse_head: weight of a loss on each crop's coarse whole image against "
        "its pseudo-label's class fractions (tasks.highres.soft_cross_entropy), beside the crop's own "
        "loss; 0 = none"))

    @model_validator(mode="after")
    def _options_fit_the_model(self) -> "SegmentationConfig":
        # at load time, not after the classifier's hours: {'width': 16} was small's option, not lite's
        import models

        models.check_options(self.model, self.options)
        return self


class InferenceConfig(BaseModel):
    """How a trained segmenter labels images without tags (the eval split, new images). Changes
    no round's content, so a run directory accepts a change here."""

    model_config = ConfigDict(extra="forbid")

    gate: bool = Field(True, description=(
        "weight each class's segmentation probability by the image classifier's probability that the "
        "image shows the class (the classifier is trained on the same tags; it runs at classifier.cam_scales). "
        "Measured on msrc21 val, round-2 model of the same run / supervised reference: 0.206 / 0.275 "
        "ungated, 0.265 / 0.324 gated"))


class ForegroundConfig(BaseModel):
    """Class-agnostic foreground evidence for implicit-background corpora whose tags carry no
    contrast (a class tagged on every image), where the image classifier has nothing to learn
    (:mod:`tasks.foreground`)."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["auto", "on", "off"] = Field("auto", description=(
        "auto: on when the corpus has an implicit background class and some object class is tagged on every "
        "training image; on / off: always / never. When on, round 0's preliminary result of the object "
        "classes is the image's boundary-connectivity saliency (the border is mostly background) instead of "
        "the CAMs' constant-threshold background, shared among the image's object tags by their CAMs"))
    grabcut: bool = Field(True, description=(
        "when the path is on, every round's pseudo-label is GrabCut of the whole image started from the mean "
        "foreground probability of the preliminary result, the MIL evidence and the proposal scores "
        "(tasks.foreground.foreground_label) instead of fusion, 3-way clustering and seeding of the ambiguous "
        "area. Measured on the msrc21 one-class corpus (69 train images, round 0): object IoU 0.723 against "
        "0.645 for fusion and seeding and 0.616 for box GrabCut"))
    grabcut_sure: float = Field(0.85, gt=0.5, le=1, description=(
        "foreground probability above which a pixel starts as sure foreground (above 0.5: probable)"))
    grabcut_border: float = Field(0.02, ge=0, lt=0.5, description=(
        "width of the border strip that starts as sure background, as a share of the shorter side"))
    grabcut_iters: int = Field(3, ge=1, description="GrabCut iterations")


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
        "rounds >= 1: weight of round 0's CAM in the preliminary result, a geometric mixture with the "
        "model r-1 output [ours]; 0 = the model alone, as METHOD.md step 1. With the pretrained defaults "
        "on msrc21 train (the same round 0, 0.709): round 1's preliminary result 0.615 alone, 0.674 at "
        "0.3, 0.666 at 0.5; round 1's pseudo-labels 0.681 at 0, 0.714 at 0.3, 0.727 at 0.5, where the "
        "segmenter alone forgets objects the CAM had (chair 0.60 -> 0.38). From scratch (small networks) "
        "the mixture did not help: model 0.496, mixture 0.5 0.432"))
    max_rounds: int = Field(3, ge=1)
    epsilon: float = Field(0.02, description="converged when the changed-pixel share falls below this")
    stopping: Literal["auto", "oscillation", "budget"] = Field("auto", description=(
        "auto: from round 1, a round ends the rounds, and the round before is final (its labels, and the "
        "final model trained on them), when it oscillates (at least half of the pixels it changed go back to "
        "their label of two rounds before, the CAM labels for round 1) or, on a corpus without an implicit "
        "background, when its labels give the tagged classes less room than the round before's (tag coverage: "
        "the mean over the tagged classes of the mean log label share on their images; tasks.stopping). Needs "
        "no mask. Measured: the bundled demo's round 2 (0.536 -> 0.502 mIoU) lowers the coverage and round 1 "
        "is final; msrc21 train's round 2 (0.656 -> 0.672) raises it and is final (the budget). oscillation: "
        "the first rule alone. budget: the last round run is final"))
    split: str = "train"
    shard_size: int = Field(64, ge=1, description=(
        "images per shard task (the unit of work on a Dask worker); grown for a large corpus so that a "
        "stage has at most max_shards tasks (shard_size_for). A task costs about 0.2 s of wall time on "
        "top of its images (Prefect's task run, Dask's round trip; measured at 1000 and 4000 images), "
        "2-3 percent of a shard of 64 and 10-16 percent of one of 16; lower it for a corpus of fewer "
        "images than 64 x workers. Results do not depend on it"))
    max_shards: int = Field(2000, ge=1, description=(
        "most shard tasks (Prefect task runs) per stage: a corpus above shard_size * max_shards images "
        "(128,000 by default) gets shards of ceil(images / max_shards), 500 images each at 10^6. A task's "
        "overhead, measured under load, is at most about 0.5 core-s (README, Large corpora: Existing Dask "
        "cluster), so 2000 of them add minutes to a stage of hours; results do not depend on the shards"))
    seed: int = 0
    device: str = "auto"
    pretrained: dict[str, str] = Field(default_factory=dict, description=(
        "sha256 of each ImageNet weight file the run's encoders start from, by encoder name; filled in when a "
        "run starts (tasks.encoders.with_weight_digests), so a run directory started with one file is not "
        "resumed with another; not set by hand"))


def shard_size_for(n_images: int, shard_size: int, max_shards: int = 2000) -> int:
    """Images per shard of a stage over ``n_images``: ``shard_size``, grown to
    ``ceil(n_images / max_shards)`` so that the stage has at most ``max_shards`` shard tasks.

    >>> shard_size_for(1000, 16), shard_size_for(1_000_000, 16), shard_size_for(1_000_001, 16)
    (16, 500, 501)
    """
    return max(shard_size, -(-n_images // max_shards))


# How many rounds to run, how the trained model labels untagged images and how the images are cut
# into shard tasks change no round's content: a run may be taken further (or stopped earlier), or
# run with other shards, on the same directory, and its finished rounds are reused.
NOT_IN_ROUNDS = ("max_rounds", "inference", "shard_size", "max_shards")


def config_difference(previous: dict | None, current: WSSSConfig) -> list[str]:
    """The top-level fields in which ``current`` differs from the configuration a run directory
    was started with (``previous``, as JSON), leaving out :data:`NOT_IN_ROUNDS`."""
    if previous is None:
        return []
    now = current.model_dump(mode="json")
    return sorted(k for k in set(previous) | set(now) if previous.get(k) != now.get(k) and k not in NOT_IN_ROUNDS)
