"""The wheel is self-contained: built from the checkout as ``pip install .`` builds it (in pip's
isolated build environment, no ``--no-build-isolation``), installed into a fresh venv outside
it with its dependencies resolved by pip, ``hvd_zoadam`` and ``hvd_zoadam.native`` (shipped
from the top-level ``native/`` folder, as setup.cfg maps it) import from that venv and work,
and Horovod and mpi4py are optional: the venv has neither, and the quick start of
``hvd_zoadam.distributed`` runs there under torchrun, one kernel thread per rank on 2 cores.
With mpi4py added (the ``mpi`` extra) the MPI quick start runs under mpirun.

The build environment's setuptools and wheel come from the package index, and so does what
the venv's own older setuptools lacks for torch; nothing else is downloaded: the fresh venv
reaches torch, numba and numpy through a ``.pth`` file naming a folder of links to the packages
of the interpreter running the tests, every one of them except Horovod, mpi4py (and the
checkout's editable install), so pip finds them installed, and the test checks that mpi4py
is still absent after the install. A path line in a
``.pth`` only joins ``sys.path``; the ``.pth`` files inside that folder are not processed, so
the checkout stays out of reach, and the test checks that before installing the wheel.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# What the fresh venv runs, from a directory outside the checkout. Prints one JSON line.
PROBE_BEFORE_INSTALL = r"""
import importlib.util, json, sys
import numba, numpy, torch
found = importlib.util.find_spec("hvd_zoadam")
print(json.dumps({
    "prefix": sys.prefix,
    "hvd_zoadam": found.origin if found is not None else None,
    "editable_finders": [type(f).__module__ for f in sys.meta_path if "editable" in type(f).__module__.lower()],
    "editable_modules": [m for m in sys.modules if m.startswith("__editable__")],
    "deps": [torch.__file__, numba.__file__, numpy.__file__],
}))
"""

PROBE_AFTER_INSTALL = r"""
import json
import torch
import hvd_zoadam, hvd_zoadam.native, hvd_zoadam.native.reference, hvd_zoadam.native.cpu
packed = hvd_zoadam.native.reference.pack_signs(torch.tensor([1., -1., 0., -0., 1., 1., -1., -1.]))
print(json.dumps({
    "files": {m.__name__: m.__file__ for m in (hvd_zoadam, hvd_zoadam.native, hvd_zoadam.native.reference,
                                                hvd_zoadam.native.cpu)},
    "padded_numel_5_2": hvd_zoadam.padded_numel(5, 2),
    "packed": packed.tolist(),
    "packed_dtype": str(packed.dtype),
}))
"""


def _inside(path: str | Path, folder: Path) -> bool:
    return Path(path).resolve().is_relative_to(folder.resolve())


def _run(cmd: list, cwd: Path, env: dict, timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc


def _probe(python: Path, code: str, cwd: Path, env: dict) -> dict:
    out = _run([python, "-c", code], cwd, env, timeout=240).stdout
    return json.loads(out.strip().splitlines()[-1])


LEFT_OUT = ("horovod", "mpi4py", "__editable__", "hvd_zoadam")


def _dependency_dirs(farm: Path, left_out=LEFT_OUT) -> list[str]:
    """``[farm]``: a folder of links to every package in the site-packages of this interpreter's
    torch, numba and numpy, except those whose names start with ``left_out`` (by default Horovod,
    mpi4py and editable installs: a venv without Horovod or mpi4py)."""
    import numba
    import numpy
    import torch
    farm.mkdir(exist_ok=True)
    for mod in (torch, numba, numpy):
        for entry in Path(mod.__file__).resolve().parent.parent.iterdir():
            low = entry.name.lower()
            if low.startswith(left_out) or low.endswith(".pth"):
                continue
            if not (farm / entry.name).exists():
                (farm / entry.name).symlink_to(entry)
    return [str(farm)]


def _source_modules() -> set[str]:
    """The .py files the wheel must ship, named as inside the wheel."""
    want = {f"hvd_zoadam/{p.relative_to(ROOT / 'hvd_zoadam').as_posix()}" for p in (ROOT / "hvd_zoadam").rglob("*.py")}
    want |= {f"hvd_zoadam/native/{p.relative_to(ROOT / 'native').as_posix()}" for p in (ROOT / "native").rglob("*.py")}
    return want


@pytest.mark.timeout(600)
def test_wheel_installs_into_a_fresh_venv_and_imports_outside_the_checkout():
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP") and not k.startswith("PIP_")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    with tempfile.TemporaryDirectory(prefix="hvd_zoadam_wheel_") as tmp:
        tmp = Path(tmp).resolve()
        assert not _inside(tmp, ROOT), f"the temporary directory {tmp} must lie outside the checkout {ROOT}"
        dist, venv, work = tmp / "dist", tmp / "venv", tmp / "work"
        work.mkdir()

        # Build the wheel from the checkout. setuptools' in-tree outputs (build/, *.egg-info) go to the
        # temporary directory, so nothing is written into the checkout and no stale build/lib of an
        # earlier layout can leak into the wheel.
        extra_cfg = tmp / "setuptools-dirs.cfg"
        (tmp / "egg").mkdir()
        extra_cfg.write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp / 'egg'}\n"
                             f"[bdist_wheel]\nbdist_dir = {tmp / 'bdist'}\n")
        _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", dist, ROOT], work,
             {**env, "DIST_EXTRA_CONFIG": str(extra_cfg)}, timeout=300)
        wheels = sorted(dist.glob("hvd_zoadam-*.whl"))
        assert len(wheels) == 1, list(dist.iterdir())
        with zipfile.ZipFile(wheels[0]) as zf:
            shipped = {n for n in zf.namelist() if n.endswith(".py")}
        assert shipped == _source_modules(), (sorted(shipped ^ _source_modules()))

        # A fresh venv whose only way to torch/numba is a .pth naming their directories.
        _run([sys.executable, "-m", "venv", venv], work, env, timeout=300)
        python = venv / "bin" / "python"
        purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], work, env,
                       timeout=120).stdout.strip()
        assert _inside(purelib, venv), purelib
        dep_dirs = _dependency_dirs(tmp / "site")
        (Path(purelib) / "zz_host_dependencies.pth").write_text("".join(d + "\n" for d in dep_dirs))

        before = _probe(python, PROBE_BEFORE_INSTALL, work, env)
        assert _inside(before["prefix"], venv), before
        assert all(any(f.startswith(d + "/") for d in dep_dirs) for f in before["deps"]), before  # through the links
        # the checkout's editable install is not activated through the added directory
        assert before["editable_finders"] == [] and before["editable_modules"] == [], before
        assert before["hvd_zoadam"] is None or not _inside(before["hvd_zoadam"], ROOT), before

        _run([python, "-m", "pip", "install", wheels[0]], work, env, timeout=300)

        after = _probe(python, PROBE_AFTER_INSTALL, work, env)
        for name, file in after["files"].items():
            assert _inside(file, venv), (name, file)
            assert not _inside(file, ROOT), (name, file)
        assert after["padded_numel_5_2"] == 16
        # MSB first, +1 -> bit 1, ±0 -> +1: 1,0,1,1,1,1,0,0 = 0b10111100
        assert after["packed"] == [188] and after["packed_dtype"] == "torch.uint8", after

        # Horovod and mpi4py are optional: neither is in this venv, and the torchrun quick start runs there
        # with one kernel thread per rank on 2 cores (NUMBA_NUM_THREADS unset: the launcher's 2 ranks share them).
        for optional in ("horovod", "mpi4py"):
            assert _run([python, "-c", f"import importlib.util; print(importlib.util.find_spec('{optional}'))"], work,
                        env, timeout=120).stdout.strip() == "None", optional
        script = work / "quickstart_distributed.py"
        script.write_text((ROOT / "examples" / "quickstart_distributed.py").read_text())
        tdist_env = {k: v for k, v in env.items() if k != "NUMBA_NUM_THREADS"}
        proc = _run([python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", script], work,
                    {**tdist_env, "OMP_NUM_THREADS": "1"}, timeout=300)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("loss ")]
        assert line and "over torch.distributed (gloo)" in line[0], proc.stdout + proc.stderr
        first, last = (float(v) for v in line[0].split(";")[0][5:].split(" -> "))
        assert last < 0.1 * first, line[0]
        threads = max(1, (os.cpu_count() or 1) // 2)
        assert f"{threads} kernel thread(s) per rank" in line[0], line[0]
        info = _run([python, "-m", "hvd_zoadam.info", "--json"], work, env, timeout=120).stdout
        front_ends = json.loads(info)["front_ends"]
        assert front_ends["hvd_zoadam.distributed (torchrun)"] is None, front_ends
        assert "pip install 'hvd_zoadam[mpi]'" in front_ends["hvd_zoadam.mpi (mpirun, srun)"], front_ends
        # with the mpi extra's mpi4py, the quick start over MPI alone, under mpirun
        _dependency_dirs(tmp / "site", left_out=tuple(name for name in LEFT_OUT if name != "mpi4py"))
        script = work / "quickstart_mpi.py"
        script.write_text((ROOT / "examples" / "quickstart_mpi.py").read_text())
        proc = _run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", python, script], work,
                    {**env, "OMP_NUM_THREADS": "1"}, timeout=300)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("loss ")]
        assert line and "over mpi (mpi4py)" in line[0], proc.stdout + proc.stderr
        first, last = (float(v) for v in line[0].split(";")[0][5:].split(" -> "))
        assert last < 0.1 * first, line[0]
