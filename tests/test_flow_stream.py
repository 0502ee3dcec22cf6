"""Flow memory independent of the corpus size (issue 54): a split's manifest rows streamed by
shard give exactly the shards of the whole manifest, the trainers' sample drawn from streamed
rows is the in-memory one, and ``run_shards`` keeps a bounded number of shard tasks in flight."""
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from wsseg.tasks.store import MANIFEST_SCHEMA, ClassSpec, ImageRecord, Store

SPLITS = ("train", "val", "test")


def corpus(tmp_path, n: int = 1000, footer: bool = True, row_group: int | None = None) -> Store:
    """A run directory whose manifest has ``n`` rows of three interleaved splits (no image: the
    manifest alone), half of them with a mask; without ``footer`` as an older wsseg wrote it (one
    row group); ``row_group``: its rows a Parquet row group (the store's default otherwise)."""
    rng = random.Random(7)
    records = [ImageRecord(f"im{i:05d}", 8, 8, tuple(rng.sample(["cow", "grass", "sky"], rng.randint(0, 2))),
                           f"{i:064x}", rng.choice(SPLITS), f"im{i:05d}.jpg", rng.random() < 0.5)
               for i in range(n)]
    store = Store(tmp_path / "run")
    if row_group is not None:
        store.ROW_GROUP = row_group
    store.write_corpus(records, ClassSpec(("cow", "grass", "sky")))
    if not footer:
        pq.write_table(pa.Table.from_pylist([r.__dict__ | {"tags": list(r.tags)} for r in records],
                                            schema=MANIFEST_SCHEMA), store.corpus_dir / "manifest.parquet")
        assert store.corpus_summary() is None
    return store


def ids(shards) -> list[list[str]]:
    return [[r.image_id for r in s] for s in shards]


@pytest.mark.parametrize("footer,row_group", [(True, None), (True, 100), (False, None)])
def test_streamed_shards_are_the_shards_of_the_manifest(tmp_path, footer, row_group):
    """For every split, shard size and bound on shards (those below make max_shards grow the
    shards), the streamed shards hold the same images in the same order as ``shards_of`` cuts the
    whole manifest's rows, also those of a filter; the split's count and corpus hash are the
    manifest's, read from the footer or, for an older manifest, counted. A manifest is written in
    row groups of the store's size (a streamed read holds one) and read the same in batches that
    do not line up with them."""
    from wsseg.flows.wsss import shards_of, stream_shards
    from wsseg.tasks.config import shard_size_for
    from wsseg.tasks.corpus.resume import corpus_entry

    store = corpus(tmp_path, footer=footer, row_group=row_group)
    groups = pq.ParquetFile(store.corpus_dir / "manifest.parquet").metadata.num_row_groups
    assert groups == (1 if not footer else -(-1000 // (row_group or Store.ROW_GROUP)))
    whole = store.manifest()
    assert [r.image_id for r in whole] == [f"im{i:05d}" for i in range(1000)]
    store.RECORD_SLICE = 7  # records made a few rows at a time, across the batches' ends
    assert list(store.manifest_records()) == whole
    store.MANIFEST_BATCH = 64  # several Parquet batches per split
    assert list(store.manifest_records()) == whole
    for split in SPLITS + ("none",):
        rows = store.manifest(split)
        assert list(store.manifest_records(split)) == rows
        assert store.split_images(split) == len(rows) and store.split_entry(split) == corpus_entry(rows)
        for size, max_shards in ((16, 2000), (5, 10), (1, 7), (400, 3)):
            shards = store.manifest_shards(split, lambda n: shard_size_for(n, size, max_shards))
            assert ids(shards) == shards_of(rows, size, max_shards) == list(shards.ids()), (split, size, max_shards)
            assert shards.images == len(rows) and len(shards) == len(shards_of(rows, size, max_shards))
            masked = [r for r in rows if r.has_mask]
            streamed = stream_shards(store.split_rows(split), size, max_shards, keep=lambda r: r.has_mask)
            assert ids(streamed) == shards_of(masked, size, max_shards)
            assert list(streamed.kept_rows()) == masked and len(streamed.kept_rows()) == len(masked)
            some = streamed.only([0, 2])
            assert ids(some) == [s for i, s in enumerate(shards_of(masked, size, max_shards)) if i in (0, 2)] \
                == list(some.ids())
            assert some.images == sum(len(s) for s in ids(some))
    assert [s for s in (len(shards_of(store.manifest(x), 1, 7)) for x in SPLITS)] == [7, 7, 7]  # max_shards hit


def sorted_sample(records, limit, seed, keep=()):
    """The trainers' sample by its definition: the whole list sorted by the keyed hash of
    (seed, id), the ``limit`` lowest with every image of ``keep``, in the list's order."""
    import hashlib

    if limit is None or len(records) <= limit:
        return list(records)
    keep, salt = set(keep), str(seed).encode()
    rest = sorted((r for r in records if r.image_id not in keep),
                  key=lambda r: hashlib.blake2b(r.image_id.encode(), digest_size=8, key=salt[:64]).digest())
    chosen = (keep & {r.image_id for r in records}) | {r.image_id for r in rest[:max(0, limit - len(keep))]}
    return [r for r in records if r.image_id in chosen]


def test_streamed_sample_is_the_sorted_one(tmp_path):
    """The trainers' sample drawn from streamed rows (a heap of the lowest ranks) is the one of
    its definition (:func:`sorted_sample`, the whole list sorted), with and without corrected
    images to keep (present or not), for limits below, at and above the split's size."""
    from wsseg.tasks.wsss.pipeline import training_sample

    store = corpus(tmp_path, 600)
    for split in SPLITS:
        rows = store.manifest(split)
        for limit in (None, 0, 1, 17, len(rows) - 1, len(rows), 5000):
            for keep in (set(), {rows[3].image_id, rows[-1].image_id, "not-there"}, {r.image_id for r in rows[:40]}):
                for seed in (0, 5):
                    assert training_sample(store.split_rows(split), limit, seed, keep) == \
                        sorted_sample(rows, limit, seed, keep), (split, limit, len(keep), seed)


def test_run_shards_keeps_a_bounded_number_of_tasks_in_flight(tmp_path, prefect_harness, cluster):
    """On a Dask cluster ``run_shards`` submits at most ``in_flight`` shard tasks before one has
    finished (each task writes its file as it ends: submitted minus files written bounds the tasks
    in flight from above), takes its shards from a generator, and returns every shard's result;
    the scheduler keeps none of the tasks' messages; a flow's first stage keeps two tasks a worker
    thread in flight."""
    from prefect import flow, task

    from wsseg.flows.runtime import on_cluster
    from wsseg.flows.wsss import SHARD_TASK, WAVE_ROWS, run_shards, wave_size

    done = tmp_path / "done"
    done.mkdir()

    @task(name="slow-shard", **SHARD_TASK)
    def slow_shard(ids: list[str], done_dir: str) -> list[str]:
        import pathlib
        import time

        time.sleep(0.3)
        pathlib.Path(done_dir, ids[0]).write_text("")
        return ids

    @flow(name="waves")
    def waves(done_dir: str, in_flight: int) -> tuple[list, list]:
        seen = []

        def per_shard(shard):  # called in the flow as the shard is submitted
            import os

            seen.append(len(seen) + 1 - len(os.listdir(done_dir)))
            return {}

        shards = ([f"s{k:02d}-{i}" for i in range(3)] for k in range(10))
        return run_shards(slow_shard, shards, "waves", per_shard=per_shard, in_flight=in_flight,
                          done_dir=done_dir), seen

    results, in_flight = on_cluster(waves, cluster)(str(done), 3)
    assert sorted(results) == [[f"s{k:02d}-{i}" for i in range(3)] for k in range(10)]
    assert len(in_flight) == 10 and max(in_flight) <= 3, in_flight
    assert len(list(done.iterdir())) == 10

    @flow(name="first-wave")
    def first_wave() -> int:  # before the flow has submitted anything
        return wave_size(WAVE_ROWS)  # shards so large that the rows allow one in flight

    from distributed import Client

    with Client(cluster, timeout=60, set_as_default=False) as client:
        threads = sum(client.nthreads().values())
        # the scheduler kept none of its messages to the workers (each carries a task's arguments)
        kept = client.run_on_scheduler(lambda dask_scheduler: sum(
            len(stream.recent_message_log) for stream in dask_scheduler.stream_comms.values()))
        assert kept == 0
    # at least two tasks a worker thread, from the first stage on (the runner's client is made at first use)
    assert on_cluster(first_wave, cluster)() == 2 * threads


def test_every_flow_that_submits_shard_tasks_pickles_its_function_by_reference():
    """Each shard task carries its flow run's context, the flow among it: every flow of a module
    that submits shard tasks finds its function by name (``module.<flow>.fn``), so plain pickle
    takes it by reference, the copy ``on_cluster`` makes of a flow too (cloudpickle otherwise
    copied the function by value, with every global it names, into each shard task's payload)."""
    import importlib
    import pickle
    import pkgutil

    import cloudpickle
    from prefect.flows import Flow

    import wsseg.flows as package
    from wsseg.flows.runtime import on_cluster

    flows = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"wsseg.flows.{info.name}")
        source = Path(module.__file__).read_text()
        if "run_shards(" not in source and ".submit(" not in source:
            continue
        flows |= {f"{module.__name__}.{name}": obj for name, obj in vars(module).items()
                  if isinstance(obj, Flow) and obj.fn.__module__ == module.__name__}
    assert {"wsseg.flows.wsss.ingest", "wsseg.flows.wsss.refresh_round", "wsseg.flows.wsss.train_wsss",
            "wsseg.flows.bench_quality.bench_quality"} <= set(flows)
    for name, f in flows.items():
        assert pickle.loads(pickle.dumps(f.fn)) is f.fn, name
        copy = on_cluster(f, "tcp://127.0.0.1:1")  # a copy with a Dask task runner (nothing connects)
        assert pickle.loads(pickle.dumps(copy.fn)) is f.fn, name
        assert len(cloudpickle.dumps(f.fn)) < 200, name  # a reference, not the code and its globals


@pytest.mark.parametrize("chosen", [None, "mimalloc"])
def test_a_command_takes_arrow_buffers_from_the_system_allocator_unless_the_user_chose(tmp_path, chosen):
    """A command's set-up (``flows.runtime.prepare``) gives pyarrow the C library's allocator in its
    own process, which imported pyarrow already, and in the processes it starts; a pool the user
    named in ARROW_DEFAULT_MEMORY_POOL is kept."""
    import os
    import subprocess
    import sys

    code = ("import os, sys, pyarrow as pa; from wsseg.flows.runtime import prepare; prepare(sys.argv[1]); "
            "print(pa.default_memory_pool().backend_name, os.environ['ARROW_DEFAULT_MEMORY_POOL'])")
    env = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    if chosen:
        env["ARROW_DEFAULT_MEMORY_POOL"] = chosen
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run")], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == ([chosen, chosen] if chosen else ["system", "system"])


def test_a_manifest_written_a_shard_at_a_time_is_the_manifest_of_the_list(tmp_path):
    """Records handed to the manifest writer in shards that finish out of order (put back in order
    by InOrder, as the ingest flow does) give the manifest write_corpus writes of the whole list:
    the same rows in row groups of the store's size, the same footer (each split's count and
    corpus hash), read without a row. Until published, the manifest in place stays as it was and
    drop_staged removes the new one."""
    from wsseg.tasks.store import corpus_hash
    from wsseg.tasks.store.stream import InOrder

    whole = corpus(tmp_path / "a", n=1000, row_group=100)
    records = whole.manifest()
    store = Store(tmp_path / "b" / "run")
    store.ROW_GROUP = 100
    store.write_corpus(records[:3], ClassSpec(("cow", "grass", "sky")))  # the corpus before
    shards = [records[i:i + 32] for i in range(0, len(records), 32)]
    order = list(range(len(shards)))
    random.Random(3).shuffle(order)
    writer = store.manifest_writer()
    in_order = InOrder(writer.add)
    for position in order:  # dicts with tags as lists: what ingest_shard returns
        in_order.put(position, [r.__dict__ | {"tags": list(r.tags)} for r in shards[position]])
        assert len(in_order.waiting) <= len(shards)
    assert not in_order.waiting and in_order.next == len(shards)
    with pytest.raises(ValueError, match="given twice"):
        in_order.put(0, [])
    summary = writer.close()
    assert [r.image_id for r in store.manifest()] == [r.image_id for r in records[:3]]  # not yet published
    store.publish_manifest(ClassSpec(("cow", "grass", "sky")))
    assert store.manifest() == records
    assert pq.ParquetFile(store.corpus_dir / "manifest.parquet").metadata.num_row_groups == 10
    expected = {"images": 1000, "splits": {s: {"images": len(whole.manifest(s)), "hash": corpus_hash(whole.manifest(s))}
                                           for s in dict.fromkeys(r.split for r in records)}}
    assert summary == store.corpus_summary() == whole.corpus_summary() == expected
    assert not (store.corpus_dir / Store.STAGING).exists()
    # a new manifest that is not published (a refused ingest) goes with the staging area
    writer = store.manifest_writer()
    writer.add(records[:5])
    writer.close()
    store.drop_staged()
    assert store.manifest() == records and not (store.corpus_dir / Store.STAGING).exists()
