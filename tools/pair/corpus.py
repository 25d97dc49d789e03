"""Stage 1: build the Python-code corpus.

Sources are pinned wheels of permissively licensed pure-Python packages from PyPI plus the
standard library of the running interpreter. Files are deduplicated by content hash and split
into train / validation by a stable hash of the file's path, so the split never changes when
the package list grows.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import sysconfig
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

log = logging.getLogger("recipe.corpus")

# (package, version, license). Every one is pure Python (py3-none-any wheel).
PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("requests", "2.32.3", "Apache-2.0"),
    ("urllib3", "2.2.2", "MIT"),
    ("idna", "3.7", "BSD-3-Clause"),
    ("flask", "3.0.3", "BSD-3-Clause"),
    ("werkzeug", "3.0.3", "BSD-3-Clause"),
    ("jinja2", "3.1.4", "BSD-3-Clause"),
    ("click", "8.1.7", "BSD-3-Clause"),
    ("django", "5.0.6", "BSD-3-Clause"),
    ("attrs", "23.2.0", "MIT"),
    ("six", "1.16.0", "MIT"),
    ("pyparsing", "3.1.2", "MIT"),
    ("packaging", "24.1", "Apache-2.0 OR BSD-2-Clause"),
    ("rich", "13.7.1", "MIT"),
    ("pygments", "2.18.0", "BSD-2-Clause"),
    ("networkx", "3.3", "BSD-3-Clause"),
    ("pytest", "8.2.2", "MIT"),
    ("httpx", "0.27.0", "BSD-3-Clause"),
    ("starlette", "0.37.2", "BSD-3-Clause"),
    ("fastapi", "0.111.0", "MIT"),
    ("tornado", "6.4.1", "Apache-2.0"),
    ("sympy", "1.12.1", "BSD-3-Clause"),
    ("docutils", "0.21.2", "BSD-2-Clause / public domain"),
    ("markdown", "3.6", "BSD-3-Clause"),
    ("toolz", "0.12.1", "BSD-3-Clause"),
    ("more-itertools", "10.3.0", "MIT"),
    ("boltons", "24.0.0", "BSD-3-Clause"),
)

MAX_FILE_BYTES = 200_000  # skip generated giants (unicode tables, test data)
VAL_FRACTION = 0.02


@dataclass(frozen=True)
class SourceFile:
    origin: str  # "package==version" or "stdlib-3.11"
    path: str  # path inside the origin
    text: str


def is_validation(origin: str, path: str) -> bool:
    """Stable split: hash of origin/path, independent of corpus contents."""
    digest = hashlib.sha256(f"{origin}/{path}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < VAL_FRACTION


def _download(wheel_dir: Path) -> list[Path]:
    wheel_dir.mkdir(parents=True, exist_ok=True)
    specs = [f"{name}=={version}" for name, version, _ in PACKAGES]
    cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
           "--only-binary=:all:", "--python-version", "3.11", "-d", str(wheel_dir), *specs]
    log.info("downloading %d pinned wheels", len(specs))
    subprocess.run(cmd, check=True)
    return sorted(wheel_dir.glob("*.whl"))


def _read_wheels(wheels: list[Path]) -> list[SourceFile]:
    out: list[SourceFile] = []
    for wheel in wheels:
        name, version = wheel.name.split("-")[:2]
        origin = f"{name.lower()}=={version}"
        with zipfile.ZipFile(wheel) as zf:
            for info in zf.infolist():
                if info.filename.endswith(".py") and info.file_size <= MAX_FILE_BYTES:
                    text = zf.read(info).decode("utf-8", errors="replace")
                    out.append(SourceFile(origin, info.filename, text))
    return out


def _read_stdlib() -> list[SourceFile]:
    root = Path(sysconfig.get_paths()["stdlib"])
    origin = f"stdlib-{sys.version_info.major}.{sys.version_info.minor}"
    out: list[SourceFile] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.startswith(("site-packages/", "test/", "idlelib/idle_test/", "lib2to3/tests/")):
            continue
        if path.stat().st_size > MAX_FILE_BYTES:
            continue
        out.append(SourceFile(origin, rel, path.read_text("utf-8", errors="replace")))
    return out


def build_corpus(work: Path) -> dict:
    """Writes work/corpus/{train,val}.jsonl and manifest.json; returns the manifest."""
    out_dir = work / "corpus"
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists():
        log.info("corpus already built: %s", out_dir)
        return json.loads(manifest_path.read_text())
    files = _read_wheels(_download(work / "wheels")) + _read_stdlib()
    seen: set[str] = set()
    splits: dict[str, list[SourceFile]] = {"train": [], "val": []}
    duplicates = 0
    for f in tqdm(files, desc="dedup+split", unit="file"):
        key = hashlib.sha256(f.text.strip().encode()).hexdigest()
        if key in seen or not f.text.strip():
            duplicates += 1
            continue
        seen.add(key)
        splits["val" if is_validation(f.origin, f.path) else "train"].append(f)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, items in splits.items():
        with open(out_dir / f"{split}.jsonl", "w") as fh:
            for f in items:
                fh.write(json.dumps({"origin": f.origin, "path": f.path, "text": f.text}) + "\n")
    per_origin: dict[str, dict] = {}
    for items in splits.values():
        for f in items:
            entry = per_origin.setdefault(f.origin, {"files": 0, "bytes": 0})
            entry["files"] += 1
            entry["bytes"] += len(f.text.encode())
    licenses = {f"{n.lower()}=={v}": lic for n, v, lic in PACKAGES}
    for origin, entry in per_origin.items():
        entry["license"] = licenses.get(origin.replace("_", "-"), licenses.get(origin, "PSF-2.0"))
    manifest = {
        "packages": [{"name": n, "version": v, "license": lic} for n, v, lic in PACKAGES],
        "stdlib": f"CPython {sys.version.split()[0]} (PSF-2.0)",
        "duplicates_dropped": duplicates,
        "files": {s: len(v) for s, v in splits.items()},
        "bytes": {s: sum(len(f.text.encode()) for f in v) for s, v in splits.items()},
        "per_origin": per_origin,
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))
    log.info("corpus: %s files, %s bytes", manifest["files"], manifest["bytes"])
    return manifest
