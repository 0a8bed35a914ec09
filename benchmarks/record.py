"""Provenance of a run (package versions, commit) and the CSV sink the workers append to."""
from __future__ import annotations

import csv
import importlib.metadata
import os
import subprocess
from pathlib import Path

from benchmarks import shapes

VERSION_PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "triton", "torch",
                    "jax-triton", "optax", "liger-kernel")


def versions() -> str:
    """'jax=0.11.2 jaxlib=0.11.2 ... ' for the packages installed (no commas: CSV-safe)."""
    found = []
    for name in VERSION_PACKAGES:
        try:
            found.append(f"{name}={importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return " ".join(found)


def commit() -> str:
    """BENCH_COMMIT if set, else `git rev-parse --short HEAD` (+dirty), else 'unknown'."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, check=True,
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=root, capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty.strip() else "") if head else "unknown"


class CsvSink:
    """Appends rows with exactly `shapes.COLUMNS` to a CSV (header written once)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.exists() or self.path.stat().st_size == 0:
            with self.path.open("w", newline="") as f:
                csv.writer(f).writerow(shapes.COLUMNS)
        else:
            with self.path.open(newline="") as f:
                header = tuple(next(csv.reader(f)))
            if header != shapes.COLUMNS:
                raise SystemExit(f"{self.path} has columns {header}, expected {shapes.COLUMNS}")

    def write(self, row: dict) -> None:
        """Appends one row (a dict keyed by column) and closes the file, so it is on disk."""
        with self.path.open("a", newline="") as f:
            csv.writer(f).writerow([row[c] for c in shapes.COLUMNS])
