"""The corpus classifiers' network (METHOD.md A step 3 and the superpixel MIL): standardised
appearance features -> an MLP -> class logits. Trained by :mod:`tasks.wsss.proposal_classifier` and
:mod:`tasks.wsss.mil`; saved and rebuilt by :mod:`tasks.store.checkpoints`."""
from __future__ import annotations

import torch
from torch import nn


class ProposalMLP(nn.Module):
    """Standardised features -> two hidden layers -> class logits; ``hidden=0``: one linear
    layer (multinomial logistic regression)."""

    def __init__(self, in_features: int, num_classes: int, hidden: int = 256):
        super().__init__()
        self.register_buffer("mean", torch.zeros(in_features))
        self.register_buffer("std", torch.ones(in_features))
        if hidden < 0:
            raise ValueError(f"hidden must be >= 0 (0 = linear), got {hidden}")
        self.num_classes, self.hidden = num_classes, hidden
        self.net = nn.Linear(in_features, num_classes) if hidden == 0 else nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(inplace=True), nn.Dropout(0.2),
            nn.Linear(hidden, hidden), nn.ReLU(inplace=True), nn.Dropout(0.2),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net((x - self.mean) / self.std)
