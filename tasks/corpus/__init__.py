"""A user's data in, and what a run's results are computed from: ingest (labels.csv or VOC
folders, validated, into the store), resume (the inputs each stored result records, so that one
computed from other inputs is recomputed), encoders (the ImageNet weight files and their digests)."""
