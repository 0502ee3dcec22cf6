"""wsseg installs as one package: the built wheel puts ``wsseg`` (and its dist-info) into
site-packages and nothing else, so a user's own ``models/`` or ``tasks.py`` neither shadows ours
nor is shadowed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_packaging_lists_every_package_folder():
    """pyproject.toml names the packages one by one (the folders are mapped under wsseg): a new
    package folder left out of the list would be missing from the wheel."""
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {"wsseg." + ".".join(p.parent.relative_to(ROOT).parts) if p.parent.name != "wsseg" else "wsseg"
               for top in ("wsseg", "flows", "tasks", "models") for p in (ROOT / top).rglob("__init__.py")}
    assert set(conf["packages"]) == folders
    assert conf["package-dir"] == {"wsseg": "wsseg", "wsseg.flows": "flows", "wsseg.tasks": "tasks",
                                   "wsseg.models": "models"}


def test_the_wheel_in_a_fresh_venv_beside_a_users_own_models_and_tasks(tmp_path):
    """Build the wheel, install it (without dependencies) into a new venv that borrows the project
    venv's dependencies through a path file, and use it from a folder that has its own ``models/``
    package and ``tasks.py``: ``wsseg --version``, the Python API and the user's imports all work,
    each from its own place."""
    src, wheels = tmp_path / "src", tmp_path / "wheels"  # built from a copy: setuptools writes build/ beside it
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("wsseg", "flows", "tasks", "models"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                          "-w", str(wheels), str(src)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = wheels.glob("wsseg-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    out = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--quiet", "--no-deps",
                          str(wheel)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    top = sorted(p.name for p in site.iterdir() if p.name != "__pycache__")
    assert [n for n in top if not re.fullmatch(r"wsseg-[\w.]+\.dist-info", n)] == ["wsseg"], top
    assert sorted(p.name for p in (site / "wsseg").iterdir() if p.is_dir() and p.name != "__pycache__") == \
        ["flows", "models", "tasks"]
    assert (site / "wsseg" / "flows" / "sample" / "msrc21" / "labels.csv").is_file()  # the demo's sample
    # the dependencies (torch, prefect, ...) from the project's venv, after the fresh venv's own
    # site-packages: its .pth files are not read, so the project's editable wsseg stays out
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")

    user = tmp_path / "user"
    (user / "models").mkdir(parents=True)
    (user / "models" / "__init__.py").write_text("WHO = 'the user'\n")
    (user / "tasks.py").write_text("WHO = 'the user'\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    out = subprocess.run([str(venv / "bin" / "wsseg"), "--version"], cwd=user, capture_output=True, text=True,
                         env=env)
    assert out.returncode == 0 and out.stdout.startswith("wsseg "), out.stdout + out.stderr
    probe = ("import models, tasks, wsseg, wsseg.models, wsseg.tasks.store; "
             "from wsseg import ingest, train, refresh, segment, export, review, status, check; "
             "print(models.WHO, tasks.WHO, wsseg.__version__, wsseg.models.__file__, wsseg.__file__, sep='|')")
    out = subprocess.run([str(py), "-c", probe], cwd=user, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    users_models, users_tasks, version, ours, pkg = out.stdout.strip().split("|")
    assert users_models == users_tasks == "the user" and version
    assert Path(ours).is_relative_to(site) and Path(pkg).is_relative_to(site)
