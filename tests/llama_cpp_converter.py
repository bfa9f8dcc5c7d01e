"""llama.cpp's own HF -> GGUF converter (``convert_hf_to_gguf.py``), from the package registry.

The converter ships inside the source distribution of ``llama-cpp-python`` (under
``vendor/llama.cpp``: the script, its ``conversion`` package and the ``gguf-py`` it imports).
``converter()`` fetches that sdist once with ``pip download --no-deps --no-binary :all:``,
checks its SHA-256 and keeps the three parts in ``~/.cache/strata-jax/llama.cpp-<version>``
(``STRATA_MODEL_CACHE``'s parent overrides, as for ``real_model.py``).  Tests convert random
transformers models with it, so the GGUF files they load are written by llama.cpp, not by a
restatement of its converter.  Run it as ``python <script> <folder> --outfile F --outtype f32``;
it needs ``torch``, ``transformers`` and ``sentencepiece`` (the test extra).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from real_model import FETCH_TIMEOUT_S, FetchError, cache_dir

VERSION = "0.3.36"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def _target() -> Path:
    return cache_dir().parent / f"llama.cpp-{VERSION}"


def converter() -> Path:
    """The cached ``convert_hf_to_gguf.py``, fetching llama-cpp-python's sdist first if needed."""
    target = _target()
    script = target / "convert_hf_to_gguf.py"
    if script.is_file() and (target / "conversion").is_dir() and (target / "gguf-py").is_dir():
        return script
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="strata-llama-cpp-", dir=target.parent) as tmp:
        package = f"llama-cpp-python=={VERSION}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q", package, "-d", tmp]
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"`pip download {package}` failed: {exc}") from exc
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if done.returncode != 0 or not sdists:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise FetchError(f"`pip download {package}` failed (is the package registry reachable?): {tail[0]}")
        digest = hashlib.sha256(sdists[0].read_bytes()).hexdigest()
        if digest != SDIST_SHA256:  # not a skip: the registry served something else under this version
            raise RuntimeError(f"{sdists[0].name} does not have the expected SHA-256 ({digest})")
        staging = Path(tmp) / "out"
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdists[0]) as archive:
            for member in archive.getmembers():
                inner = member.name[len(prefix) :] if member.name.startswith(prefix) else None
                if inner and any(inner == part or inner.startswith(part) for part in _PARTS) and member.isfile():
                    member.name = inner
                    archive.extract(member, staging, filter="data")
        staging.replace(target)  # atomic: a half-extracted converter is never seen
    return script


if __name__ == "__main__":
    print(converter())
