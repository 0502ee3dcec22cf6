"""A run directory whose corpus is a finished run's repeated K times (ids <id>_<k>), each copy's
image linked (a symbolic link) to the original's array and its final-round labels written again
(one pack a copy of the corpus, whichever layout the original has): for measuring how
`wsseg export` grows with the number of images (docs/benchmarks.md#review-queue-and-corrections).

    python tools/replicate_run.py RUN OUT K
"""
import json, os, shutil, sys
from pathlib import Path
import pyarrow.parquet as pq, pyarrow as pa
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from wsseg.tasks.store import Store  # noqa: E402
src, dst, k = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
shutil.rmtree(dst, ignore_errors=True)
(dst / "corpus").mkdir(parents=True)
summary = json.loads((src / "summary.json").read_text())
r = summary["final_round"]
for f in ("summary.json", "config.json"):
    shutil.copy(src / f, dst / f)
shutil.copy(src / "corpus" / "classes.json", dst / "corpus")
t = pq.read_table(src / "corpus" / "manifest.parquet")
rows = t.to_pylist()
out = []
for j in range(k):
    for row in rows:
        out.append(dict(row, image_id=f"{row['image_id']}_{j}"))
pq.write_table(pa.Table.from_pylist(out, schema=t.schema), dst / "corpus" / "manifest.parquet")
rd = dst / "rounds" / f"r{r:03d}"
rd.mkdir(parents=True)
shutil.copy(src / "rounds" / f"r{r:03d}" / "round.json", rd)
(dst / "corpus" / "images.zarr").mkdir()
shutil.copy(src / "corpus" / "images.zarr" / "zarr.json", dst / "corpus" / "images.zarr" / "zarr.json")
source, target = Store(src), Store(dst)
for j in range(k):
    with target.packing(f"copy{j}"):
        for row in rows:
            i = row["image_id"]
            os.symlink(src / "corpus" / "images.zarr" / i, dst / "corpus" / "images.zarr" / f"{i}_{j}")
            label = source.pseudo(r, i)
            if label is not None:
                target.write_pseudo(r, f"{i}_{j}", label)
print(dst, len(out), "images")
