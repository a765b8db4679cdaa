"""mtpkit as users install it: package data covers every file the C++ sources include, and a wheel built from the
repo, installed (not editable) into a fresh venv, builds and runs the CPU kernels from outside the repo."""

import os
import re
import shutil
import site
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

from mtpkit.kernels import thin_matmul

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mtpkit"


def _shipped() -> set[Path]:
    """The package files that pyproject.toml's package-data puts in a wheel beside the modules."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["mtpkit"]
    return {p for pattern in patterns for p in PACKAGE.glob(pattern)}


def _included(source: Path) -> set[Path]:
    """The local files `source` includes (`#include "..."`), and theirs."""
    found = set()
    for name in re.findall(r'^\s*#include\s+"([^"]+)"', source.read_text(), flags=re.M):
        header = (source.parent / name).resolve()
        found |= {header} | _included(header)
    return found


def test_package_data_covers_the_kernel_sources_and_their_includes():
    sources = {(thin_matmul.CSRC / name).resolve() for name in thin_matmul.SOURCES}
    needed = sources | {h for s in sources for h in _included(s)}
    assert any(p.suffix == ".h" for p in needed)  # power: the headers are found
    assert needed <= {p.resolve() for p in _shipped()}


@pytest.mark.slow
@pytest.mark.skipif(not thin_matmul.supported(), reason="the CPU kernels need an x86-64 CPU with AVX2")
def test_a_wheel_installed_in_a_fresh_venv_builds_and_runs_the_kernels(tmp_path):
    # the wheel is built from a copy: an in-tree build would leave build/ in the repo, whose stale files a later
    # wheel would ship
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "mtpkit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    # built from the installed sources, anew
    env["TORCH_EXTENSIONS_DIR"] = str(tmp_path / "torch_extensions")

    def run(*cmd, cwd=tmp_path) -> str:
        done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, cwd=cwd, timeout=600)
        assert done.returncode == 0, f"{cmd[:4]} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout.strip()

    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp_path / "dist", src)
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    python = venv / "bin" / "python"
    # the venv sees this environment's packages (torch, ...) after its own, so nothing is downloaded; a plain
    # path line does not run this environment's .pth files (an editable mtpkit's finder among them)
    venv_site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"))
    (venv_site / "host_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    wheel = next((tmp_path / "dist").glob("mtpkit-*.whl"))
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel)
    check = textwrap.dedent(f"""
        import torch, mtpkit
        from mtpkit.kernels import thin_matmul
        assert mtpkit.__file__.startswith({str(venv)!r}), mtpkit.__file__
        assert thin_matmul.available()
        x, w = torch.randn(3, 40), torch.randn(7, 40)
        torch.testing.assert_close(thin_matmul.thin_linear(x, w, 2), x @ w.T, rtol=1e-5, atol=1e-4)
        print("ok")
    """)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    assert run(python, "-W", "error", "-c", check, cwd=outside) == "ok"
