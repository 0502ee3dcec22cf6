"""What the three methods share: training (fit, devices, seeds, resumable checkpoints, losses,
inference of probabilities and CAMs) and metrics (confusion matrices, IoU, label-map change)."""
