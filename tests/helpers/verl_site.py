"""verl for the tests that drive trainer3d through it: the pinned packages of verl_requirements.txt, installed once
with pip --no-deps into the checkout's .cache/verl-site (a key of the pins names it, so a new pin installs anew),
written into a temporary folder and renamed into place (an interrupted install leaves nothing half-made). Ranks put
it first on sys.path: it holds only the pinned packages (never torch or transformers), and its pins must win where
the environment holds another version (hydra needs antlr4 4.9)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REQUIREMENTS = os.path.join(HERE, "verl_requirements.txt")


def verl_site() -> str:
    """The folder that holds verl (installed here the first time); the test fails with pip's reason if it cannot."""
    pins = open(REQUIREMENTS).read()
    key = hashlib.sha256(pins.encode()).hexdigest()[:12]
    cache = os.path.join(os.path.dirname(os.path.dirname(HERE)), ".cache")
    site = os.path.join(cache, f"verl-site-{key}")
    if os.path.isdir(site):
        return site
    os.makedirs(cache, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="verl-site.", dir=cache)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
           "--target", tmp, "-r", REQUIREMENTS]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.fail(f"verl could not be installed into {site} (pip --no-deps -r {REQUIREMENTS}): {p.stderr[-2000:]}")
    try:
        os.rename(tmp, site)
    except OSError:  # another process renamed its own first: use that one
        shutil.rmtree(tmp, ignore_errors=True)
    return site
