"""The README's Python snippets run as pasted, on a CPU, each in a fresh process (the
multi-GPU one sets XLA_FLAGS before it imports jax). CI also runs the "## API" block on the
installed wheel with jax alone (.ci/run)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks() -> dict[str, str]:
    """The first ```python block under each "## " heading, by heading."""
    out = {}
    for section in README.read_text().split("\n## ")[1:]:
        title, _, body = section.partition("\n")
        code = re.search(r"```python\n(.*?)```", body, re.S)
        if code:
            out[title.strip()] = code.group(1)
    return out


def test_readme_has_the_snippets():
    titles = set(_blocks())
    assert {"API", "Multi-GPU", "Quickstart: a Flax NNX train step"} <= titles, titles
    assert any(t.startswith("The LM head") for t in titles), titles


@pytest.mark.parametrize("group", ["single-device", "Multi-GPU"])
def test_readme_snippets_run_as_pasted(group):
    blocks = _blocks()
    if group == "Multi-GPU":
        code = blocks["Multi-GPU"]
    else:
        code = "\n".join(c for t, c in blocks.items() if t != "Multi-GPU")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, cwd=README.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
