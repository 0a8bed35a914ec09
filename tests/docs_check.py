"""Checks the built documentation site in a real headless browser (a CI step, .ci/run):

    python -m tests.docs_check out/ci/docs

- no page loads a script from the network (math is rendered by the MathJax the build ships);
- the API page, rendered by Chromium with its scripts run, lists every name in
  `jax_fusedloss.__all__` and `torch_ref.__all__`, and its math is typeset (no raw TeX left);
- the guides' `$...$` math is typeset too.

Chromium is found as $CHROMIUM, `chromium`, `chromium-browser` or `google-chrome`; without one
this exits with status 2 and says so (CI installs Debian's `chromium`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REMOTE_SCRIPT = re.compile(r"<script[^>]*\ssrc=\"(?:https?:)?//", re.I)
RAW_MATH = re.compile(r'class="math[^"]*">\s*(\\\(|\\\[|\$)')
RENDERED_PAGES = ("api.html", "guide_cross_entropy.html", "guide_distillation.html")


def browser() -> str | None:
    for name in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def rendered_dom(exe: str, page: Path) -> str:
    """The page's DOM after its scripts ran (MathJax included), from headless Chromium."""
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--allow-file-access-from-files", "--virtual-time-budget=15000", "--dump-dom",
           page.resolve().as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or "</html>" not in proc.stdout:
        raise RuntimeError(f"{exe} could not render {page}: {proc.stderr[-2000:]}")
    return proc.stdout


def check(site: Path, exe: str) -> list[str]:
    import jax_fusedloss
    import torch_ref

    problems = []
    pages = sorted(site.rglob("*.html"))
    if not pages:
        return [f"no HTML pages under {site}"]
    for page in pages:
        if REMOTE_SCRIPT.search(page.read_text(errors="replace")):
            problems.append(f"{page.relative_to(site)} loads a script from the network")
    for name in RENDERED_PAGES:
        dom = rendered_dom(exe, site / name)
        if "mjx-container" not in dom:
            problems.append(f"{name}: no math typeset by MathJax")
        if RAW_MATH.search(dom):
            problems.append(f"{name}: raw TeX left in the rendered page")
        if name != "api.html":
            continue
        ids = set(re.findall(r'\sid="([\w.]+)"', dom))
        for module in (jax_fusedloss, torch_ref):
            missing = [n for n in module.__all__ if f"{module.__name__}.{n}" not in ids]
            if missing:
                problems.append(f"api.html lacks {module.__name__}.{', '.join(missing)}")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    exe = browser()
    if exe is None:
        print("docs_check: no Chromium found (set $CHROMIUM or install chromium)")
        return 2
    problems = check(Path(argv[0]), exe)
    for p in problems:
        print(f"docs_check: {p}")
    if not problems:
        print(f"docs_check: {argv[0]} ok in {exe}")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
