"""Nanny preload for the workers of an existing Dask cluster (``--dask-address``)::

    dask worker tcp://scheduler:8786 --nthreads 1 --preload-nanny wsseg.flows.nanny

gives each worker process the environment of the commands' own local cluster
(:func:`flows.runtime.worker_environ`: one BLAS/OpenMP thread, no ``MALLOC_TRIM_THRESHOLD_``,
whose setting made every shard stage about 1.85x slower here). A nanny imports this module
before it reads ``distributed.nanny.pre-spawn-environ``; importing it sets that for this process.
"""
import dask

from wsseg.flows.runtime import worker_environ

dask.config.set({"distributed.nanny.pre-spawn-environ": worker_environ()})
