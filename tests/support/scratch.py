"""Temporary directories of test processes (Mesh logs, Redis work dirs), removed once their
owner is garbage-collected or the process exits; MESHLLM_KEEP_TEST_DIRS=1 keeps them to read
after a run."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from pathlib import Path


def scratch_dir(owner: object, prefix: str) -> Path:
    """A new directory under the system temp dir, removed with `owner` (not before: a restarted
    Redis reuses its work dir, a Mesh's logs are read until it is dropped)."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    if not os.environ.get("MESHLLM_KEEP_TEST_DIRS"):
        weakref.finalize(owner, shutil.rmtree, path, ignore_errors=True)
    return path
