"""Memory of a worker running round 0's CAM pass over images of many sizes, with oneDNN's default
kernel cache and with the one wsseg gives its workers (``flows.runtime.ONEDNN_KERNELS``).

torch's CPU convolutions compile a oneDNN kernel per layer and input shape and keep up to
``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` of them (1024 by default). Each setting runs in a new
process, as a worker does: the CAM pass of the run's image classifier
(``tasks.wsss.pipeline.round0_cam``) over ``--images`` images cycled from the run's corpus, each
rescaled by a random 0.6-1.0 ("many sizes") or not at all ("the corpus's sizes"); the script
prints the process's memory (RSS) every 50 images, its peak and its CPU seconds.

    python tools/bench_worker_memory.py --run-dir runs/default --images 300
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def measure(run: str, images: int, many: bool) -> None:
    """One setting, in this process: prints one line of figures."""
    import cv2
    import numpy as np
    import torch

    from wsseg.tasks.config import WSSSConfig, without_removed
    from wsseg.tasks.store import Store
    from wsseg.tasks.wsss import pipeline as pl

    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    store = Store(run)
    config = WSSSConfig.model_validate(without_removed(store.read_config()))
    classes = store.classes()
    model, state = store.read_model("classifier")
    recs = list(store.split_rows(config.split))[:40]
    corpus = [(store.image(r.image_id), classes.tag_vector(r.tags)) for r in recs]
    rng = np.random.default_rng(0)
    readings = []
    t0 = time.process_time()
    for i in range(images):
        image, allowed = corpus[i % len(corpus)]
        if many:
            s = rng.uniform(0.6, 1.0)
            image = cv2.resize(image, (max(32, int(image.shape[1] * s)), max(32, int(image.shape[0] * s))),
                               interpolation=cv2.INTER_AREA)
        h, w = image.shape[:2]
        grid = ((np.arange(h)[:, None] // 16) * ((w + 15) // 16) + np.arange(w)[None] // 16).astype(np.int32)
        pl.round0_cam(model, state, image, allowed, classes, config, lambda: grid)
        if (i + 1) % 50 == 0:
            readings.append(round(rss_mb()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"RSS MB every 50 images {readings}, peak {peak:.0f} MB, {time.process_time() - t0:.1f} CPU s", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="runs/default", help="a `wsseg train` run with an image classifier "
                    "(default runs/default, which `make demo` leaves)")
    ap.add_argument("--images", type=int, default=300, help="CAM passes per setting (default 300)")
    ap.add_argument("--measure", choices=["many", "few"], help=argparse.SUPPRESS)  # one setting, in a child
    args = ap.parse_args(argv)
    if args.measure:
        measure(args.run_dir, args.images, args.measure == "many")
        return 0
    if not (Path(args.run_dir) / "classifier.pt").is_file():
        print(f"{args.run_dir}: no image classifier; run `make demo` or pass --run-dir", file=sys.stderr)
        return 2
    from wsseg.flows.runtime import ONEDNN_KERNELS

    base = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}
    for sizes, label in (("many", "many sizes"), ("few", "the corpus's sizes")):
        for name, extra in (("oneDNN default (1024)", {}),
                            (f"wsseg's workers ({ONEDNN_KERNELS})",
                             {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": str(ONEDNN_KERNELS)})):
            print(f"{label:>18}, {name:>22}: ", end="", flush=True)
            subprocess.run([sys.executable, __file__, "--run-dir", args.run_dir, "--images", str(args.images),
                            "--measure", sizes], env=base | extra | {"OMP_NUM_THREADS": "1"}, check=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
