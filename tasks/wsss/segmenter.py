"""METHOD.md A, step 8 (correction): the segmentation model trained on a round's pseudo-labels
(or on the ground-truth masks: the supervised reference of ``bench quality``), and the rules of
when the rounds stop and how the final model is trained."""
from __future__ import annotations

from typing import Callable

import numpy as np
from scipy import ndimage as ndi

from wsseg.models.small import load_encoder_from
from wsseg.tasks.common import training as tr
from wsseg.tasks.config import ROUND_SETTINGS, WSSSConfig, recorded_differs
from wsseg.tasks.corpus import resume
from wsseg.tasks.runtime.progress import Progress
from wsseg.tasks.store import ClassSpec, ImageRecord, Store, build_network, params_key
from wsseg.tasks.store.checkpoints import initial_weights
from wsseg.tasks.wsss.feature_cache import load_edges


def ignore_boundaries(label: np.ndarray, width: int) -> np.ndarray:
    """``label`` with every pixel whose square window of ``width`` pixels each way holds another
    label (ignore included) set to the ignore label: a band of ``2 * width`` pixels along every
    boundary between labels is left out of the loss.

    >>> ignore_boundaries(np.array([[0, 0, 0, 1, 1, 1]], np.uint8), 1).tolist()
    [[0, 0, 255, 255, 1, 1]]
    """
    if width <= 0:
        return label
    size = 2 * width + 1
    out = label.copy()
    near = ndi.maximum_filter(label, size=size, mode="nearest") != ndi.minimum_filter(label, size=size, mode="nearest")
    out[near] = tr.IGNORE
    return out


class LabelLoader:
    """(image, edge map, label map) with labels from a round's pseudo-labels (``round_index``) or
    the masks (``round_index=None``), the pseudo-labels' boundaries widened into an ignored band of
    ``boundary_ignore`` pixels each way (:func:`ignore_boundaries`); picklable for DataLoader workers."""

    def __init__(self, store: Store | str, records: list[ImageRecord], feature_key: str, round_index: int | None,
                 boundary_ignore: int = 0):
        self.root = str(store.root if isinstance(store, Store) else store)
        self.records, self.key, self.round = records, feature_key, round_index
        self.boundary_ignore = boundary_ignore  # pseudo-labels only: the masks are right up to the boundary

    def label(self, i: int, store: Store | None = None) -> np.ndarray:
        store = store or Store(self.root)
        rec = self.records[i]
        if self.round is None:
            return store.mask(rec.image_id)
        return ignore_boundaries(store.pseudo(self.round, rec.image_id), self.boundary_ignore)

    def class_counts(self, n_classes: int) -> np.ndarray:
        """(n_classes,) labelled pixels of each class over all records (ignore excluded)."""
        store = Store(self.root)
        counts = np.zeros(n_classes)
        for i in range(len(self.records)):
            lab = self.label(i, store)
            counts += np.bincount(lab[lab != tr.IGNORE].ravel(), minlength=n_classes)[:n_classes]
        return counts

    def __call__(self, i: int):
        store = Store(self.root)
        rec = self.records[i]
        return store.image(rec.image_id), load_edges(store, rec, self.key), self.label(i, store)


def trained_classes(records: list[ImageRecord], classes: ClassSpec) -> list[int]:
    """Indices of the classes that ``records`` are tagged with, and the implicit background: the
    classes a segmenter trained on them may answer (:func:`tasks.wsss.pipeline.trained_classes_only`)."""
    tagged = {classes.index(t) for r in records for t in r.tags}
    return sorted(tagged | ({classes.background} if classes.background is not None else set()))


def converged_at(config: WSSSConfig, r: int, changed_share: float) -> bool:
    """Whether the rounds stop after round ``r``: its labels changed less than ``epsilon``
    against the round before (round 0 has none to compare with)."""
    return r > 0 and changed_share < config.epsilon


#: Segmentation settings that only say what a round's own segmenter is trained with:
#: :func:`round_model_config` puts them in place of the final model's (``ROUND_SETTINGS``), so a
#: checkpoint's recipe records those and a change of these retrains no final or supervised model
ROUNDS_ONLY = tuple(ROUND_SETTINGS.values())


def round_model_config(config: WSSSConfig) -> WSSSConfig:
    """``config`` for a round's own segmenter (not the run's final model): its class weights are
    ``segmentation.rounds_class_balance``. Its output labels the next round's images, whose tags
    already say which classes are there; weighting the rare ones up made them grow over what they
    stand on from round to round (docs/benchmarks.md#the-segmenters-class-weights). Its labels'
    boundary band is ``segmentation.rounds_boundary_ignore`` (0: every pixel), its output being the
    next round's start."""
    seg = config.segmentation
    own = {final: getattr(seg, rounds) for final, rounds in ROUND_SETTINGS.items()}
    return config.model_copy(update={"segmentation": seg.model_copy(update=own)})


def final_model_config(config: WSSSConfig, rounds: int) -> WSSSConfig:
    """``config`` for a segmenter trained from the start (``segmentation.encoder_init``) on one
    set of labels with the whole budget of ``rounds`` rounds: ``epochs`` (and ``max_seconds``)
    times ``rounds`` when the rounds fine-tune one another, as they are. The last round's model
    and the supervised reference of ``bench quality`` are trained with it, so they differ only
    in their labels."""
    seg = config.segmentation
    factor = rounds if seg.finetune else 1
    return config.model_copy(update={"segmentation": seg.model_copy(update={
        "epochs": seg.epochs * factor,
        "max_seconds": None if seg.max_seconds is None else seg.max_seconds * factor})})


def training_recipe(store: Store, records: list[ImageRecord], classes: ClassSpec, feature_key: str,
                    config: WSSSConfig, label_round: int | None, init_round: int | None) -> dict:
    """What a segmenter checkpoint is trained from, recorded in it (``meta["trained_on"]``): the
    corpus, classes, features (the edge channel), the labels (round ``label_round``'s, identified
    by what its pseudo-labels were computed from, :func:`tasks.corpus.resume.round_view`; None: the
    masks), the round it fine-tunes, the segmentation settings it is trained with (epochs included;
    ``boundary_ignore`` only where it leaves a band out of pseudo-labels; not :data:`ROUNDS_ONLY`,
    which :func:`round_model_config` has put in their place for a round's own segmenter) and the seed."""
    labels = "masks"
    if label_round is not None:
        inputs = resume.round_view(store.round_inputs(label_round), label_round, "labels")
        labels = f"round {label_round} " + (params_key(inputs) if inputs is not None else "(not recorded)")
    seg = {k: v for k, v in config.segmentation.model_dump(mode="json").items() if k not in ROUNDS_ONLY}
    if label_round is None or not seg.get("boundary_ignore"):
        seg.pop("boundary_ignore", None)  # no band (the masks have none): a checkpoint of before the option holds
    return {"corpus": resume.corpus_hash(records), "classes": list(classes.names), "features": feature_key,
            "labels": labels, "init_round": init_round, "segmentation": seg, "seed": config.seed}


def recipe_changes(recorded: dict | None, recipe: dict) -> list[str]:
    """The parts of ``recipe`` (:func:`training_recipe`) a checkpoint's ``recorded`` one differs in
    ("recipe (not recorded)" for a checkpoint of an older wsseg); empty when it may be reused.

    >>> recipe_changes({"labels": "masks", "seed": 0}, {"labels": "masks", "seed": 1})
    ['seed']
    >>> recipe_changes(None, {"seed": 0})
    ['recipe (not recorded)']

    The segmentation settings of a checkpoint of before an option existed hold its value then
    (:data:`tasks.config.ADDED_OPTIONS`):

    >>> recipe_changes({"segmentation": {"epochs": 9}}, {"segmentation": {"epochs": 9, "boundary_ignore": 0}})
    []
    >>> recipe_changes({"segmentation": {"epochs": 9, "rounds_class_balance": 0.5}}, {"segmentation": {"epochs": 9}})
    []
    """
    if recorded is None:
        return ["recipe (not recorded)"]

    def differs(k: str) -> bool:
        if k != "segmentation":
            return recorded.get(k) != recipe[k]
        return recorded_differs({s: v for s, v in recorded.get(k, {}).items() if s not in ROUNDS_ONLY}, recipe[k], k)

    return [k for k in recipe if differs(k)]


def train_segmenter(store: Store, records: list[ImageRecord], feature_key: str, config: WSSSConfig, *, r: int,
                    label_round: int | None, kind: str = "segmenter", name: str | None = None,
                    init_round: int | None = None,
                    log: Callable[[dict, int], None] | None = None) -> tr.TrainResult | None:
    """Train the segmentation network of ``config.segmentation`` on round ``label_round``'s
    pseudo-labels (None: the masks) and save it as checkpoint ``kind`` (``segmenter`` of round
    ``r``, ``supervised``, or ``extra`` with ``name``). It starts from round ``init_round``'s
    model when given (fine-tuning), else from the image classifier's encoder
    (``segmentation.encoder_init``), else from random weights; seeded by ``config.seed + r``.
    Returns None when the checkpoint exists already."""
    where = dict(r=r if kind == "segmenter" else None, name=name)
    classes = store.classes()
    recipe = training_recipe(store, records, classes, feature_key, config, label_round, init_round)
    done = store.usable_checkpoint(kind, **where)
    if done is not None:
        differs = recipe_changes((done.get("meta") or {}).get("trained_on"), recipe)
        if kind == "segmenter" or not differs:  # a round's model: the rounds' own record decides (flows.wsss)
            return None
        path = store.checkpoint_path(kind, **where)
        Progress(kind if name is None else name, 1).message(
            f"{path.parent.name}/{path.name} was trained with other settings than today's ({', '.join(differs)}): "
            "trained again")
    s = config.segmentation
    in_ch = 4 if s.use_edges else 3
    build_options = dict(s.options)
    if s.backbone_weights:  # fusion: torchvision files, read by build_network through the store
        build_options["pretrained"] = dict(s.backbone_weights)
    tr.seed_everything(config.seed + r)  # initial weights reproducible, as fit's own seeding is
    model = build_network(s.model, classes.n, in_channels=in_ch, **build_options)
    start = initial_weights(s.model, build_options)
    if init_round is not None and s.finetune and store.has_checkpoint("segmenter", init_round):
        prev, _ = store.read_model("segmenter", init_round)
        model.load_state_dict(prev.state_dict())
        init = store.checkpoint_path("segmenter", init_round)
        start = f"fine-tuning {init.parent.name}/{init.name}"
    elif s.encoder_init == "classifier" and store.has_checkpoint("classifier"):
        clf, _ = store.read_model("classifier")
        if load_encoder_from(model, clf):
            start = "the image classifier's encoder"
    labels = LabelLoader(store, records, feature_key, label_round, s.boundary_ignore)
    if getattr(model, "needs_global_context", False):
        # global-local: crops of the network's patch size, each with its whole image's coarse view and box
        ds = tr.ContextDataset(len(records), labels, tr.Augment(crop=model.patch_size), seed=config.seed + r,
                               with_edge=s.use_edges, coarse_classes=classes.n if s.coarse_loss else None)
    else:
        ds = tr.StoreDataset(len(records), labels, tr.Augment(crop=s.crop), seed=config.seed + r,
                             with_edge=s.use_edges)
    epochs = max(s.epochs, -(-s.min_steps // max(1, len(records) // s.batch_size)))
    tcfg = tr.TrainConfig(epochs=epochs, batch_size=s.batch_size, lr=s.lr, crop=s.crop, seed=config.seed + r,
                          device=config.device, max_seconds=s.max_seconds, patience=s.patience,
                          num_workers=s.num_workers)
    prog = Progress(f"segmenter r{r}" if label_round is not None else "supervised", epochs, "epochs")
    weights = tr.balanced_class_weights(labels.class_counts(classes.n), s.class_balance) if s.class_balance else None
    # a stopped training resumes only on the same labels, corpus, classes and settings
    # (the labels by what they were computed from: a round's labels computed again are other labels)
    resume_key = {**recipe, "start": start}
    loss_fn, forward = tr.segmentation_loss(weights), None
    if s.coarse_loss:
        if not (getattr(model, "needs_global_context", False) and hasattr(model, "coarse_classifier")):
            raise ValueError("segmentation.coarse_loss needs a global_local model built with coarse_head "
                             "(segmentation.options.coarse_head=true)")
        loss_fn, forward = tr.coarse_context_loss(weights, s.coarse_loss)
    result = tr.fit(model, ds, loss_fn, tcfg, checkpoint=store.train_state(kind, **where), forward=forward,
                    resume_key=resume_key,
                    log=(lambda m, step: log({f"seg_{k}": v for k, v in m.items()}, step)) if log else None,
                    progress=lambda msg: prog.advance(1, msg.split(" ", 2)[-1]))
    store.write_model(kind, model, **where, builder=s.model, num_classes=classes.n, in_channels=in_ch,
                      options=s.options,  # load_model rebuilds it without reading weight files
                      meta={"classes": list(classes.names), "trained_classes": trained_classes(records, classes),
                            "round": r, "epochs_run": result.epochs_run, "trained_on": recipe,
                            "stopped": result.stopped, "feature_key": feature_key, "start": start,
                            # a checkpoint copied away from its run still knows its edge channel
                            **({"edges": {"sigma": config.features.edge_sigma, "tau": config.features.edge_tau}}
                               if in_ch == 4 else {})})
    prog.message(f"start: {start}; stopped after {result.epochs_run} epochs ({result.stopped}), "
                 f"{result.images_per_second:.1f} img/s, data wait {100 * result.data_wait_share:.0f}%")
    return result
