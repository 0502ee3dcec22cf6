"""Every server wsseg starts listens on 127.0.0.1 only (unless the user asks for another address)."""
from __future__ import annotations

import psutil


def _listening(proc: psutil.Process) -> set[str]:
    out = set()
    for p in [proc, *proc.children(recursive=True)]:
        try:
            out |= {c.laddr.ip for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}
        except psutil.NoSuchProcess:
            pass
    return out


def test_local_cluster_and_dashboard_listen_on_loopback_only(tmp_path, prefect_harness):
    from distributed import Client

    from wsseg.flows.runtime import dask_cluster

    with dask_cluster(None, 1, tmp_path) as address:
        with Client(address) as client:
            dashboard = client.dashboard_link
        ips = _listening(psutil.Process())
    assert address.startswith("tcp://127.0.0.1:")
    assert dashboard.startswith("http://127.0.0.1:")
    assert ips and ips <= {"127.0.0.1"}, f"listening on {ips}"
