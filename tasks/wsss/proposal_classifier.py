"""Proposal classification (METHOD.md A step 3, claim 4).

A small MLP on proposal appearance features, trained with cross-entropy across the whole
corpus. Its targets come from the round's preliminary result: the (sharpened) mean
preliminary class probabilities inside each proposal, restricted to the image's tags. Because
the classifier sees every image at once, what it learns about a class where the preliminary
result is right (grass alone in a field) corrects the images where it is wrong (grass beside
a cow). Softmax is always restricted to the image's tags: only tagged classes can be present.
"""
from __future__ import annotations

import numpy as np
import scipy.sparse as sp
import torch
import torch.nn.functional as F

from wsseg.models.proposal_mlp import ProposalMLP
from wsseg.tasks.config import ProposalConfig
from wsseg.tasks.runtime.progress import Progress
from wsseg.tasks.store import ImageRecord, Store
from wsseg.tasks.wsss import superpixels as spx
from wsseg.tasks.wsss.feature_cache import ImageFeatures, load_features, proposal_inputs
from wsseg.tasks.wsss.streaming import RowBudget, RowBuffer, mean_std, split_images


def proposal_targets(membership: sp.csr_matrix, sp_prob: np.ndarray, sp_areas: np.ndarray,
                     tags: np.ndarray, *, sharpen: float = 2.0) -> np.ndarray:
    """(P, K) soft targets: area-weighted mean of the per-superpixel preliminary probabilities
    inside each proposal, restricted to ``tags``, raised to ``sharpen`` and renormalised.

    Parameters
    ----------
    membership : (P, S) sparse bool
    sp_prob : (S, K) float, preliminary class probabilities averaged per superpixel
    sp_areas : (S,) pixel counts
    tags : (K,) bool, the classes that may be present (object tags + implicit background)
    """
    if sp_prob.shape[0] != membership.shape[1] or sp_areas.shape[0] != membership.shape[1]:
        raise ValueError(f"membership has {membership.shape[1]} superpixels but sp_prob has "
                         f"{sp_prob.shape[0]} and sp_areas {sp_areas.shape[0]}")
    m = sp.csr_matrix(membership, dtype=np.float64)
    weighted = m @ (sp_prob.astype(np.float64) * sp_areas[:, None])
    t = weighted / np.maximum(m @ sp_areas.astype(np.float64), 1e-9)[:, None]
    t = np.where(tags[None, :], np.maximum(t, 0.0), 0.0) ** sharpen
    s = t.sum(1, keepdims=True)
    uniform = tags[None, :] / max(int(tags.sum()), 1)
    return np.where(s > 1e-12, t / np.maximum(s, 1e-12), uniform).astype(np.float32)


def train_proposal_classifier(features: list[np.ndarray], targets: list[np.ndarray], tags: list[np.ndarray], *,
                              hidden: int = 256, epochs: int = 30, lr: float = 1e-3, batch_size: int = 1024,
                              seed: int = 0, weights: list[np.ndarray] | None = None,
                              negatives: bool = False) -> tuple[ProposalMLP, list[float]]:
    """Train the proposal classifier with soft cross-entropy over the tagged classes.

    With ``negatives`` the softmax of training runs over every class, not only the image's tags:
    an untagged class is a known negative for everything in the image (the negative bags of
    multiple-instance learning), so each class is trained against its look-alikes across the
    whole corpus, not only against the classes it shares images with. Prediction still
    restricts to the tags (:func:`predict_proposals`).

    Parameters
    ----------
    features : per image (P_i, D) float
    targets : per image (P_i, K) soft targets (rows sum to 1 over the tagged classes)
    tags : per image (K,) bool
    negatives : softmax over all classes in training (untagged classes pushed down), not only the tags

    Returns
    -------
    model, per-epoch mean losses
    """
    if not (len(features) == len(targets) == len(tags)) or not features:
        raise ValueError("features, targets and tags must be non-empty lists of equal length")
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    x = torch.from_numpy(np.concatenate(features).astype(np.float32))
    y = torch.from_numpy(np.concatenate(targets).astype(np.float32))
    mask = torch.from_numpy(np.concatenate([np.repeat(t[None], len(f), 0) for t, f in zip(tags, features)]))
    wt = torch.ones(len(x)) if weights is None else torch.from_numpy(np.concatenate(weights).astype(np.float32))
    wt = wt / wt.mean().clamp_min(1e-12)
    model = ProposalMLP(x.shape[1], y.shape[1], hidden)
    model.mean.copy_(x.mean(0))
    model.std.copy_(x.std(0).clamp_min(1e-4))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    n = len(x)
    steps = max(1, (n + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=epochs * steps)
    losses = []
    model.train()
    for _ in range(epochs):
        perm = torch.randperm(n, generator=g)
        total = 0.0
        for i in range(steps):
            total += _step(model, opt, sched, x, y, mask, wt, perm[i * batch_size:(i + 1) * batch_size], negatives)
        losses.append(total / n)
    model.eval()
    return model, losses


def _step(model: ProposalMLP, opt, sched, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor, wt: torch.Tensor,
          idx: torch.Tensor, negatives: bool) -> float:
    """One optimiser step on rows ``idx``; returns the batch's loss times its size."""
    logits = model(x[idx])
    if not negatives:
        logits = logits.masked_fill(~mask[idx], -1e4)
    loss = (-(y[idx] * F.log_softmax(logits, 1)).sum(1) * wt[idx]).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach()) * len(idx)


def train_streamed(rows: RowBuffer, *, x: str = "x", y: str = "y", weight: str | None = None, hidden: int = 256,
                   epochs: int = 30, lr: float = 1e-3, batch_size: int = 1024, seed: int = 0, negatives: bool = False,
                   moments: dict | None = None) -> tuple[ProposalMLP, list[float]]:
    """:func:`train_proposal_classifier` on rows that are on disk (a :class:`~tasks.wsss.streaming.RowBuffer`
    past its cap), in memory bounded by the buffer's ``max_rows``.

    The same model, loss, optimiser and one-cycle schedule; the features are standardised by
    their mean and standard deviation over every row (computed in float64, one piece at a
    time) and the weights divided by their mean. Each epoch visits the pieces in a seeded
    shuffle, packed into chunks of at most ``max_rows`` rows; a chunk's rows are shuffled and cut
    into minibatches (the last one of a chunk may be smaller). Every row is seen once an epoch,
    as in memory; only the minibatches differ, since a minibatch mixes rows of one chunk.

    Parameters
    ----------
    rows : RowBuffer, not ``resident``; per-image field ``tags`` (K,) bool
    x, y, weight : names of the row fields of the (N, D) features, (N, K) soft targets and the
        optional (N,) weights
    moments : ``{x: (n, sum, sum of squares), weight: ...}`` of :meth:`RowBuffer.moments`, when
        the caller has them already (the MIL trains on the same features every iteration)

    Returns
    -------
    model, per-epoch mean losses
    """
    if rows.resident or not rows.pieces:
        raise ValueError("train_streamed needs rows on disk; train_proposal_classifier takes rows in memory")
    moments = dict(moments or {})
    for name in (x,) + ((weight,) if weight else ()):
        if name not in moments:
            moments[name] = rows.moments(name)
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    mean, std = mean_std(*moments[x])
    w_mean = max(float(moments[weight][1]) / max(rows.n_rows, 1), 1e-12) if weight else 1.0
    model = ProposalMLP(len(mean), rows.shapes["tags"][0], hidden)
    model.mean.copy_(torch.from_numpy(mean.astype(np.float32)))
    model.std.copy_(torch.from_numpy(std.astype(np.float32)).clamp_min(1e-4))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    plans = [rows.plan(torch.randperm(len(rows.pieces), generator=g).tolist()) for _ in range(epochs)]
    steps = sum(-(-sum(rows.pieces[i].rows for i in c) // batch_size) for plan in plans for c in plan)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    losses = []
    model.train()
    for plan in plans:
        total = sum(_stream_chunk(model, opt, sched, rows, c, x, y, weight, w_mean, batch_size, g, negatives)
                    for c in plan)
        losses.append(total / rows.n_rows)
    model.eval()
    return model, losses


def _stream_chunk(model: ProposalMLP, opt, sched, rows: RowBuffer, pieces: list[int], x: str, y: str,
                  weight: str | None, w_mean: float, batch_size: int, g: torch.Generator, negatives: bool) -> float:
    """One chunk of an epoch of :func:`train_streamed`: load, shuffle, step; its arrays go on return."""
    with rows.chunk(pieces, [x, y, "tags"] + ([weight] if weight else [])) as c:
        xs = torch.from_numpy(c[x].astype(np.float32, copy=False))
        ys = torch.from_numpy(c[y].astype(np.float32, copy=False))
        mask = torch.from_numpy(np.repeat(c["tags"], c["counts"], 0))
        wt = (torch.ones(len(xs)) if weight is None
              else torch.from_numpy(c[weight].astype(np.float32)) / np.float32(w_mean))
        n = len(xs)
        perm = torch.randperm(n, generator=g)
        return sum(_step(model, opt, sched, xs, ys, mask, wt, perm[i:i + batch_size], negatives)
                   for i in range(0, n, batch_size))


@torch.no_grad()
def predict_proposals(model: ProposalMLP, features: np.ndarray, tags: np.ndarray) -> np.ndarray:
    """(P, K) class probabilities of each proposal; zero outside ``tags``."""
    logits = model(torch.from_numpy(features.astype(np.float32)))
    logits = logits.masked_fill(~torch.from_numpy(tags)[None], -1e4)
    return logits.softmax(1).numpy().astype(np.float32)


def superpixel_scores(prob: np.ndarray, membership: sp.csr_matrix) -> np.ndarray:
    """(S, K) class scores of each superpixel: the average of the probabilities of every proposal
    that contains it, weighted by each proposal's confidence (its largest probability).

    Multi-scale proposals vote: a superpixel whose small and large enclosing regions agree gets a
    confident score; one on a border between objects gets a mixed one.
    """
    m = sp.csr_matrix(membership, dtype=np.float64)
    if prob.shape[0] != m.shape[0]:
        raise ValueError(f"prob has {prob.shape[0]} rows but membership has {m.shape[0]} proposals")
    w = prob.max(1).astype(np.float64)
    num = m.T @ (prob.astype(np.float64) * w[:, None])
    den = m.T @ w
    return (num / np.maximum(den, 1e-12)[:, None]).astype(np.float32)


def combine_evidence(sp_prelim: np.ndarray, sp_clf: np.ndarray, allowed: np.ndarray, *,
                     weight: float = 0.5, eps: float = 1e-4) -> np.ndarray:
    """(S, K) normalised geometric mixture ``prelim**weight * clf**(1 - weight)`` over the allowed
    classes: where the localisation cue (CAM / model) and the appearance classifier agree the
    result is confident, where they disagree it is not."""
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    c = (np.maximum(sp_prelim, 0) + eps) ** weight * (np.maximum(sp_clf, 0) + eps) ** (1.0 - weight)
    c = np.where(allowed[None, :], c, 0.0)
    return (c / np.maximum(c.sum(1, keepdims=True), 1e-12)).astype(np.float32)


def evidence(model: ProposalMLP | None, features: np.ndarray, prelim: np.ndarray, allowed: np.ndarray,
             prior_weight: float) -> np.ndarray:
    """(S, K) refined evidence of one image: the normalised geometric mixture
    ``prediction ** (1 - w) * prelim ** w`` over the allowed classes (the preliminary result itself,
    renormalised, without a model)."""
    if model is None or len(features) == 0:
        return combine_evidence(prelim, prelim, allowed, weight=1.0)
    return combine_evidence(prelim, predict_proposals(model, features, allowed), allowed, weight=prior_weight)


def sp_evidence(feat: ImageFeatures, prelim: np.ndarray, allowed: np.ndarray, mil_model: ProposalMLP | None,
                prior_weight: float) -> np.ndarray:
    """(S, K) per-superpixel evidence of one image: the preliminary result pooled per superpixel,
    refined by the round's MIL classifier (:func:`evidence`) when there is one."""
    sp_prelim = spx.pool(prelim, feat.superpixels, n=len(feat.sp_areas), channel_axis=0)
    if mil_model is None:
        return sp_prelim
    return evidence(mil_model, feat.sp_features, sp_prelim, allowed, prior_weight)


def round_mil_model(store: Store, r: int) -> ProposalMLP | None:
    """Round ``r``'s superpixel MIL classifier, or None when the round has none (MIL off)."""
    return store.read_classifier("mil", r)["model"] if store.has_checkpoint("mil", r) else None


def train_round(store: Store, r: int, records: list[ImageRecord], feature_key: str, cfg: ProposalConfig, *,
                mil_prior_weight: float, seed: int, budget: RowBudget | None = None) -> None:
    """METHOD.md A step 3: round ``r``'s proposal classifier, trained on the whole corpus and
    saved as the round's ``proposal_classifier`` checkpoint. Its targets come from the
    preliminary result, refined by the round's MIL classifier when there is one
    (``mil_prior_weight``: the preliminary result's weight in that mixture).

    At most ``cfg.max_samples`` proposals are held at once (:class:`~tasks.wsss.streaming.RowBuffer`):
    a corpus with fewer trains in memory as it always did, a larger one streams its proposals
    from a temporary folder each epoch (:func:`train_streamed`). ``budget`` counts the rows held
    (a test's or benchmark's own, to read its ``peak``)."""
    if store.usable_checkpoint("proposal_classifier", r):
        return
    classes = store.classes()
    mil_model = round_mil_model(store, r)
    corrected = store.corrections().keys()  # trusted: their targets are their corrections'
    prog = Progress("proposal-classifier", len(records))
    with RowBuffer(cfg.max_samples, budget=budget) as rows:
        for i, rec in enumerate(records):
            f = load_features(store, rec, feature_key)
            allowed = classes.tag_vector(rec.tags)
            sp_prob = sp_evidence(f, store.prelim(r, rec.image_id, classes.n), allowed,
                                  None if rec.image_id in corrected else mil_model, mil_prior_weight)
            rows.add({"x": proposal_inputs(f),
                      "y": proposal_targets(f.membership, sp_prob, f.sp_areas, allowed, sharpen=cfg.target_sharpen)},
                     {"tags": allowed})
            if (i + 1) % max(1, len(records) // 4) == 0:
                prog.advance(max(1, len(records) // 4), "features gathered")
        rows.finish()
        if not rows.resident:
            prog.message(f"{rows.n_rows} proposals, more than max_samples = {cfg.max_samples}: streamed each epoch "
                         f"from {len(rows.pieces)} pieces in {rows.folder}")
        targets = rows.lists("y") if rows.resident else None
        model, losses = _fit(rows, targets, cfg, seed + r)
        prog.message(f"trained on {rows.n_rows} proposals, loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    store.write_classifier("proposal_classifier", r, model, losses=[float(v) for v in losses])


def _fit(rows: RowBuffer, targets: list[np.ndarray] | None, cfg: ProposalConfig,
         seed: int) -> tuple[ProposalMLP, list[float]]:
    """The proposal classifier on ``rows``: in memory on ``targets`` (resident rows), else streamed
    on the row field ``y``."""
    # over every class: an untagged class is a negative for the image's proposals (prediction is
    # restricted to the tags either way); the later rounds gained, see docs/benchmarks.md#refresh-round-parts
    kw = dict(hidden=cfg.hidden, epochs=cfg.epochs, lr=cfg.lr, seed=seed, negatives=True)
    if rows.resident:
        return train_proposal_classifier(rows.lists("x"), targets, rows.lists("tags"), **kw)
    return train_streamed(rows, **kw)

