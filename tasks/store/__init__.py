"""The store: the one package that knows paths and formats (Zarr, Parquet, JSON, checkpoints).

Everything else asks it: ``store.image(id)``, ``store.write_pseudo(round, id, label)``,
``store.read_model("segmenter", round)``, ``store.train_state("classifier")``.

* :mod:`tasks.store.run`: :class:`Store`, one run directory (corpus, feature cache, rounds,
  checkpoints, configuration, summaries).
* :mod:`tasks.store.remote`: a run directory on object storage (an fsspec URL such as
  ``s3://bucket/run``), its storage options and its local state folder.
* :mod:`tasks.store.check`: ``wsseg check``, every file of a run directory read and verified
  (:mod:`tasks.store.damage`: the error a reader raises for a damaged file).
* :mod:`tasks.store.checkpoints`: every torch file, written atomically and read with
  ``torch.load(weights_only=True)`` (checkpoints, the ImageNet and torchvision weight files);
  networks built (:func:`build_network`: the ``pretrained`` option read into weights) and
  rebuilt from the registry by name.
"""
from wsseg.tasks.store.damage import DamagedFileError
from wsseg.tasks.store.lock import RunLock, RunLockedError
from wsseg.tasks.store.remote import RemoteStoreError
from wsseg.tasks.store.run import (MANIFEST_SCHEMA, ClassSpec, ImageRecord, Store, arrays_to_sparse, corpus_hash,
                             params_key, records_by_id, shard_records, sha256_file, sparse_to_arrays,
                             valid_id)

__all__ = ["Store", "RunLock", "RunLockedError", "RemoteStoreError", "DamagedFileError", "ClassSpec", "ImageRecord",
           "StateFile", "CheckpointError", "load_model", "save_model", "build_network", "imagenet_weights",
           "load_classifier", "save_classifier", "read_file", "MANIFEST_SCHEMA", "arrays_to_sparse", "sparse_to_arrays",
           "params_key", "records_by_id", "shard_records", "sha256_file", "valid_id", "corpus_hash"]
from wsseg.tasks.store import files  # noqa: E402,F401  (user files: images, masks, label PNGs, run lookup)

#: the names of :mod:`tasks.store.checkpoints`, imported on first use: that module loads torch
#: (1.3 s here), which `wsseg status`, `--help` and the library's light calls never need
_CHECKPOINT_NAMES = frozenset({"CheckpointError", "StateFile", "build_network", "imagenet_weights", "load_classifier",
                               "load_model", "read_file", "save_classifier", "save_model"})


def __getattr__(name: str):
    if name in _CHECKPOINT_NAMES:
        from wsseg.tasks.store import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
