"""Method A (METHOD.md A): weakly-supervised segmentation in refresh rounds, one module per step.

superpixels (1), features / feature_cache (2: the per-image features, cached), deep_features (2: the
superpixel features pooled from round 0's CAM pass),
proposals (2: candidate regions), classifier (4: the image classifier on the tags, round 0's CAMs),
proposal_classifier and mil (3: proposal and superpixel classification; streaming holds their rows
under a memory cap), filtering (5), fusion (6-7: fusion, zones, seeded segmentation), segmenter (8),
stopping (9: when the rounds stop), foreground (one-class corpora), crf (the dense-CRF baseline),
pipeline (the per-image steps composed with the store, as shard tasks), summary (what a round
reports), refresh (labelling new images with a finished round). docs/method.md maps each step to
its function.
"""
