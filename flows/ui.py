"""``wsseg ui``: the Prefect dashboard and the MLflow UI of one run directory, on 127.0.0.1.

Both servers read the run directory's own state: Prefect its ``RUN/.prefect`` database (the
one the run's flows wrote through their local API server), MLflow ``RUN/mlflow.db`` with the
artifacts under ``RUN/mlartifacts``. Each runs in a process group of its own, with its output
in ``RUN/.ui/<name>.log`` (the terminal shows only the two URLs); Ctrl-C or SIGTERM stops both
groups (SIGTERM, then SIGKILL after a grace period).
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HOST = "127.0.0.1"


class _Stop(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM/SIGHUP handler."""


@dataclass
class Server:
    name: str
    title: str
    argv: list[str]
    url: str          # printed once it answers
    probe: list[str]  # URLs that must answer 200 before it counts as up
    log: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, env: dict) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def answers(self) -> bool:
        for url in self.probe:
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status != 200:
                        return False
            except (urllib.error.URLError, OSError):
                return False
        return True

    def log_tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        """End the server's whole process group (workers included)."""
        p = self.proc
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
                # the leader is gone; make sure no member of its group outlives it
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            except subprocess.TimeoutExpired:
                continue
            break


def port_free(port: int, host: str = HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def servers(run: Path, prefect_port: int, mlflow_port: int) -> list[Server]:
    logs = run / ".ui"
    prefect = f"http://{HOST}:{prefect_port}"
    mlflow = f"http://{HOST}:{mlflow_port}"
    return [
        Server("prefect", "Prefect", [sys.executable, "-m", "prefect", "server", "start", "--host", HOST,
                           "--port", str(prefect_port)],
               prefect, [f"{prefect}/api/health", f"{prefect}/"], logs / "prefect.log"),
        Server("mlflow", "MLflow", [sys.executable, "-m", "mlflow", "server", "--host", HOST, "--port", str(mlflow_port),
                          "--workers", "1", "--backend-store-uri", f"sqlite:///{run / 'mlflow.db'}",
                          # runs logged by tasks.runtime.tracking keep their artifacts under RUN/mlartifacts
                          # (a local path the server reads); new ones through the server land there too
                          "--artifacts-destination", str(run / "mlartifacts")],
               mlflow, [f"{mlflow}/health", f"{mlflow}/"], logs / "mlflow.log"),
    ]


def server_env(run: Path, prefect_port: int) -> dict:
    env = dict(os.environ)
    # flows.runtime.prepare switched the UI off for the commands' own API servers: on here
    env.pop("PREFECT_API_URL", None)
    env.update({
        "PREFECT_HOME": str(run / ".prefect"),
        "PREFECT_UI_ENABLED": "true",
        "PREFECT_UI_API_URL": f"http://{HOST}:{prefect_port}/api",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        "DO_NOT_TRACK": "1",
    })
    return env


def serve(run_dir: str | os.PathLike, prefect_port: int = 4200, mlflow_port: int = 5000, *,
          timeout: float = 300.0, stream=sys.stdout) -> int:
    """Start both servers, print their URLs once they answer, and run until Ctrl-C or SIGTERM;
    then stop both. Returns the exit status (0 on a requested stop, 1 when a server failed)."""
    from wsseg.tasks.store.remote import state_dir_for

    run = state_dir_for(run_dir)  # the run directory itself, or a URL's local state folder
    if not (run / ".prefect").exists() and not (run / "mlflow.db").exists():
        print(f"wsseg ui: {run} holds no Prefect or MLflow state yet; the UIs will be empty "
              "until a command runs there", file=sys.stderr)
    busy = [p for p in (prefect_port, mlflow_port) if not port_free(p)]
    if busy:
        raise ValueError(f"port {', '.join(map(str, busy))} on {HOST} is in use; choose another with "
                         "--prefect-port / --mlflow-port")
    todo = servers(run, prefect_port, mlflow_port)
    env = server_env(run, prefect_port)

    def on_signal(signum, frame):
        raise _Stop(signal.Signals(signum).name)

    # SIGINT too: a shell starts background jobs with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt for it
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    status = 0
    try:
        for s in todo:
            s.start(env)
        pending, deadline = list(todo), time.monotonic() + timeout
        while pending:
            for s in list(pending):
                if s.proc.poll() is not None:
                    raise RuntimeError(f"the {s.name} server exited with status {s.proc.returncode} "
                                       f"(log {s.log}):\n{s.log_tail()}")
                if s.answers():
                    pending.remove(s)
                    print(f"{s.title + ' UI:':12} {s.url}", file=stream, flush=True)
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"no answer from {', '.join(s.name for s in pending)} after {timeout:.0f}s "
                                   f"(logs in {run / '.ui'})")
            time.sleep(0.5)
        print(f"run dir: {run}   (Ctrl-C stops both)", file=stream, flush=True)
        while True:
            for s in todo:
                if s.proc.poll() is not None:
                    raise RuntimeError(f"the {s.name} server exited with status {s.proc.returncode} "
                                       f"(log {s.log}):\n{s.log_tail()}")
            time.sleep(1.0)
    except (KeyboardInterrupt, _Stop):
        pass
    except RuntimeError as e:
        print(f"wsseg ui: error: {e}", file=sys.stderr)
        status = 1
    finally:
        # a second signal while stopping must not leave a server behind
        for s in previous:
            signal.signal(s, signal.SIG_IGN)
        for s in todo:
            s.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)
    print("stopped the Prefect and MLflow servers", file=sys.stderr)
    return status
