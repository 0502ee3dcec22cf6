"""What one request costs on an S3-compatible server (moto's, on 127.0.0.1, as in the tests), and
the store's packs over it: the per-file figures of the scale table in docs/large-corpora.md.

    python tools/bench_object_store.py [--n 200] [--out FILE.json]

Starts `python -m moto.server` on a free port, makes a bucket, and times with s3fs (the store's
filesystem): a put and a get of a 20 KB object (a label map's size), a ranged get of 20 KB out
of a 1.3 MB object (a pack of 64 labels), a listing of a folder of 1000 objects (one page), and
through the store a shard of 64 labels written as one pack and random labels read back from a
new process's index. Prints ms per operation (and writes them to ``--out`` as JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(fn, n: int) -> float:
    t = time.perf_counter()
    for i in range(n):
        fn(i)
    return 1000 * (time.perf_counter() - t) / n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200, help="repetitions of each operation (default 200)")
    ap.add_argument("--out", default="", help="a JSON file for the figures (default: none)")
    args = ap.parse_args(argv)
    import fsspec

    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        log = open(Path(tmp) / "moto.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT)
        try:
            os.environ.update({"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1",
                               "WSSEG_STORAGE_OPTIONS": json.dumps({"endpoint_url": endpoint}),
                               "WSSEG_STATE_HOME": str(Path(tmp) / "state")})
            fs = fsspec.filesystem("s3", endpoint_url=endpoint, use_listings_cache=False, skip_instance_cache=True)
            for _ in range(120):
                try:
                    fs.mkdir("bench")
                    break
                except Exception:  # noqa: BLE001 (the server is starting)
                    time.sleep(0.5)
            small = os.urandom(20_000)
            big = os.urandom(64 * 20_000)
            n = args.n
            res = {"put_20kb_ms": timed(lambda i: fs.pipe_file(f"bench/small/{i}", small), n),
                   "get_20kb_ms": timed(lambda i: fs.cat_file(f"bench/small/{i}"), n),
                   "head_ms": timed(lambda i: fs.info(f"bench/small/{i}"), n)}
            fs.pipe_file("bench/big", big)
            res["ranged_get_20kb_ms"] = timed(lambda i: fs.cat_file("bench/big", start=(i % 64) * 20_000,
                                                                   end=(i % 64 + 1) * 20_000), n)
            for i in range(1000 - n):
                fs.pipe_file(f"bench/small/x{i}", b"1")
            res["list_1000_ms"] = timed(lambda i: fs.ls("bench/small", detail=True, refresh=True), 10)

            from wsseg.tasks.store import Store, packs

            store = Store("s3://bench/run")
            labels = [np.random.default_rng(i).integers(0, 21, (213, 320)).astype(np.uint8) for i in range(64)]

            def shard(k):
                with store.packing(f"s{k}"):
                    for i, lab in enumerate(labels):
                        store.write_pseudo(0, f"k{k}-{i}", lab)

            res["pack_of_64_labels_ms"] = timed(shard, 10)
            packs.forget()
            fresh = Store("s3://bench/run")
            t = time.perf_counter()
            fresh.pseudo(0, "k0-0")
            res["first_read_ms_10_packs"] = 1000 * (time.perf_counter() - t)
            rng = np.random.default_rng(0)
            res["label_read_ms"] = timed(lambda i: fresh.pseudo(0, f"k{rng.integers(10)}-{rng.integers(64)}"), n)
        finally:
            proc.terminate()
            proc.wait(10)
    for k, v in res.items():
        print(f"{k:<36} {v:8.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
