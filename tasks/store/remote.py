"""Run directories on object storage: fsspec URLs (``s3://bucket/run``, ``gs://...``) as paths.

A remote run directory is a :class:`upath.UPath` (a pathlib API over fsspec), so that the store's
``root / "corpus" / "manifest.parquet"`` code reads the same for both; a local one stays a
:class:`pathlib.Path` with today's behaviour (atomic renames, symbolic links, ``flock``). The few
operations that differ go through the helpers here.

Configuration of the object store, read in every process that opens it (the Dask workers of a
local cluster inherit it from the command; workers of an existing cluster need the same
environment):

* the standard variables of the filesystem package: for S3 ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL`` (an S3-compatible
  server), ``AWS_PROFILE``; fsspec's ``FSSPEC_S3_ENDPOINT_URL`` and the like
  (``FSSPEC_<SCHEME>_<OPTION>``);
* ``WSSEG_STORAGE_OPTIONS``: a JSON object of further options passed to the filesystem (what
  ``wsseg --storage-option KEY=VALUE`` sets).

What cannot live on object storage lies in a local *state folder* (:func:`state_dir_for`):
``WSSEG_STATE_DIR`` when set (``--state-dir``), else ``$WSSEG_STATE_HOME/<scheme>/<bucket>/<path>``
with ``WSSEG_STATE_HOME`` defaulting to ``~/.cache/wsseg/runs``.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path, PurePath
from typing import Any, Iterator

#: environment variables of the configuration above
OPTIONS_ENV = "WSSEG_STORAGE_OPTIONS"
STATE_DIR_ENV = "WSSEG_STATE_DIR"
STATE_HOME_ENV = "WSSEG_STATE_HOME"

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


class RemoteStoreError(ValueError):
    """A run directory URL that cannot be used (scheme without its package, store unreachable);
    the message is one line naming the URL and the problem."""


def scheme_of(location: str | os.PathLike) -> str | None:
    """The URL scheme of ``location`` (``"s3"``), None for a plain path."""
    if isinstance(location, PurePath):
        return None
    m = _SCHEME_RE.match(str(location))
    return m.group(1).lower() if m else None


def is_remote_url(location: Any) -> bool:
    """Whether ``location`` names a run directory on a filesystem other than the local one
    (a URL whose scheme is not ``file``; a :class:`upath.UPath` of one)."""
    if isinstance(location, PurePath):
        return False
    if hasattr(location, "protocol") and hasattr(location, "fs"):
        return location.protocol not in ("", "file", "local")
    return scheme_of(location) not in (None, "file", "local")


def is_local(path: Any) -> bool:
    """Whether ``path`` is a local :class:`pathlib.Path` (everything else is a remote UPath)."""
    return isinstance(path, PurePath)


def local_path(location: str | os.PathLike) -> Path:
    """A local location as a path: ``file:///x/y`` -> ``/x/y``, a plain path unchanged."""
    s = os.fspath(location)
    if scheme_of(s) in ("file", "local"):
        s = s.split("://", 1)[1]
    return Path(s)


def storage_options(protocol: str) -> dict:
    """Options for the filesystem of ``protocol``: ours, then ``WSSEG_STORAGE_OPTIONS``'s (fsspec
    adds its own configuration, ``FSSPEC_<SCHEME>_<OPTION>``, and the package its variables)."""
    opts: dict[str, Any] = {}
    if protocol in ("s3", "s3a", "gs", "gcs", "az", "abfs", "adl"):
        # other processes (the workers) write the same prefixes: a cached listing would hide their
        # files from this one (a finished shard's marker, say)
        opts["use_listings_cache"] = False
    raw = os.environ.get(OPTIONS_ENV)
    if raw:
        try:
            extra = json.loads(raw)
        except ValueError as e:
            raise RemoteStoreError(f"{OPTIONS_ENV}: not a JSON object of storage options ({e})") from None
        if not isinstance(extra, dict):
            raise RemoteStoreError(f"{OPTIONS_ENV}: must be a JSON object of storage options, got {raw[:80]!r}")
        opts.update(extra)
    return opts


def parse_storage_options(items: list[str]) -> dict:
    """``["endpoint_url=http://127.0.0.1:9000", "anon=false"]`` -> a dict; values are JSON when
    they parse as JSON (numbers, true/false, objects), else strings. Dotted keys nest
    (``client_kwargs.region_name=eu-west-1``)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--storage-option expects KEY=VALUE, got {item!r}")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = parsed
    return out


def check_scheme(url: str) -> str:
    """The scheme of ``url`` after checking that its filesystem package is installed.

    Raises
    ------
    RemoteStoreError
        ``gs://b/run: the run directory's scheme gs needs the package gcsfs (pip install gcsfs)``,
        or for a scheme fsspec does not know, a line saying so.
    """
    import fsspec
    from fsspec.registry import known_implementations

    protocol = scheme_of(url) or "file"
    try:
        fsspec.get_filesystem_class(protocol)
    except ImportError:
        spec = known_implementations.get(protocol, {})
        package = str(spec.get("class", protocol)).split(".")[0]
        raise RemoteStoreError(f"{url}: the run directory's scheme {protocol} needs the package {package} "
                               f"(pip install {package})") from None
    except ValueError:
        raise RemoteStoreError(f"{url}: unknown storage scheme {protocol!r}; give a local path or an fsspec URL "
                               "such as s3://bucket/run") from None
    return protocol


def remote_root(url: str):
    """The :class:`upath.UPath` of a remote run directory (the scheme checked, options applied)."""
    from upath import UPath

    protocol = check_scheme(url)
    return UPath(str(url).rstrip("/"), **storage_options(protocol))


def as_path(path: Any) -> Path:
    """A local path as :class:`pathlib.Path`; a remote UPath (or an fsspec URL) as a UPath."""
    if is_local(path) or hasattr(path, "fs"):
        return path
    return remote_root(str(path)) if is_remote_url(path) else Path(path)


def probe(root) -> None:
    """Check that a remote run directory's store answers (its bucket exists), in one request.

    Raises
    ------
    RemoteStoreError
        One line naming the URL and what failed (unreachable endpoint, missing bucket, refused
        credentials)."""
    fs, path = root.fs, root.path
    bucket = path.split("/", 1)[0]
    try:
        fs.info(bucket)  # S3: a HEAD of the bucket
    except FileNotFoundError:
        raise RemoteStoreError(f"{root}: the bucket {bucket!r} does not exist (or is not visible with these "
                               "credentials); create it first") from None
    except Exception as e:  # botocore, aiohttp and credential errors: one line, not a traceback
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise RemoteStoreError(f"{root}: the object store does not answer ({type(e).__name__}: {first[:300]}); "
                               "check the endpoint (AWS_ENDPOINT_URL or --storage-option endpoint_url=...) and "
                               "the credentials") from None


def state_dir_for(location: str | os.PathLike) -> Path:
    """The local state folder of a run directory: the directory itself when it is local; for a
    URL, ``WSSEG_STATE_DIR`` when set, else ``$WSSEG_STATE_HOME/<scheme>/<bucket>/<path>``
    (``WSSEG_STATE_HOME`` defaults to ``~/.cache/wsseg/runs``)."""
    if not is_remote_url(location):
        return local_path(location).resolve()
    if os.environ.get(STATE_DIR_ENV):
        return Path(os.environ[STATE_DIR_ENV]).expanduser().resolve()
    home = Path(os.environ.get(STATE_HOME_ENV) or Path.home() / ".cache" / "wsseg" / "runs").expanduser()
    url = str(location)
    protocol, rest = url.split("://", 1)
    parts = [p for p in rest.split("/") if p not in ("", ".", "..")]
    return (home / protocol.lower()).joinpath(*parts).resolve()


# ---------------------------------------------------------------------------- operations that differ
def listdir(path) -> list[str]:
    """Names in folder ``path`` ([] when there is none)."""
    if is_local(path):
        try:
            return os.listdir(path)
        except (FileNotFoundError, NotADirectoryError):
            return []
    try:
        return [p.rstrip("/").rsplit("/", 1)[-1] for p in path.fs.ls(path.path, detail=False)
                if p.rstrip("/") != path.path.rstrip("/")]
    except FileNotFoundError:
        return []


def rmtree(path) -> None:
    """Remove folder ``path`` and everything under it (nothing there: nothing done)."""
    if is_local(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    try:
        path.fs.rm(path.path, recursive=True)
    except FileNotFoundError:
        pass


def replace(src, dst) -> None:
    """Move file ``src`` to ``dst`` (a rename locally; a copy and a delete on object storage)."""
    if is_local(src):
        os.replace(src, dst)
    else:
        src.fs.mv(src.path, dst.path)


def du(path) -> int:
    """Bytes under ``path`` (links not followed)."""
    if is_local(path):
        total = 0
        for dirpath, _, names in os.walk(path):
            for n in names:
                try:
                    total += os.lstat(os.path.join(dirpath, n)).st_size
                except OSError:
                    pass
        return total
    try:
        return int(path.fs.du(path.path))
    except FileNotFoundError:
        return 0


def entries(path) -> list[tuple[str, bool, int]]:
    """``(name, is_folder, bytes)`` of what is directly in folder ``path`` (one listing; links
    not followed; [] when there is none)."""
    if is_local(path):
        try:
            with os.scandir(path) as it:
                return [(e.name, e.is_dir(follow_symlinks=False), e.stat(follow_symlinks=False).st_size) for e in it]
        except (FileNotFoundError, NotADirectoryError):
            return []
    try:
        listing = path.fs.ls(path.path, detail=True)
    except FileNotFoundError:
        return []
    return [(e["name"].rstrip("/").rsplit("/", 1)[-1], e.get("type") == "directory", int(e.get("size") or 0))
            for e in listing if e["name"].rstrip("/") != path.path.rstrip("/")]


def copytree(src, dst) -> None:
    """Copy folder or file ``src`` to ``dst`` on the same object store (server-side copies)."""
    src.fs.copy(src.path, dst.path, recursive=src.is_dir())


@contextlib.contextmanager
def local_copy(path) -> Iterator[Path]:
    """A local file with ``path``'s content, for code that needs a file name (MLflow's
    ``log_artifact``): ``path`` itself when local, else a temporary copy of the same name."""
    if not hasattr(path, "fs"):
        yield Path(path)
        return
    with tempfile.TemporaryDirectory(prefix="wsseg-") as tmp:
        target = Path(tmp) / path.name
        path.fs.get(path.path, str(target))
        yield target
