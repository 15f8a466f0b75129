"""services/worker/kernel_cache.py: the worker's entry point puts Triton's compiled kernels in
the model-cache volume, which outlives containers, unless TRITON_CACHE_DIR already says where.
Each case starts the worker's `main()` in its own interpreter (up to where it would serve) and
asks Triton's own cache manager where it writes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[3])

WHERE_TRITON_WRITES = textwrap.dedent(
    """
    import services.worker.__main__ as entry
    def serve(service):  # where the worker would start serving: ask Triton instead
        from triton.runtime.cache import get_cache_manager
        manager = get_cache_manager("0" * 64)
        manager.put(b"kernel", "probe.bin")
        print(manager.cache_dir)
    entry.run_service = serve
    import services.worker.service
    services.worker.service.WorkerService = lambda settings: None
    entry.main()
    """
)


def cache_dir_used(tmp_path: Path, preset: dict[str, str]) -> Path:
    env = {
        "PYTHONPATH": ROOT,
        "PATH": os.environ.get("PATH", ""),
        "HOME": str(tmp_path / "home"),
        "MESHLLM_MODEL_CACHE_DIR": str(tmp_path / "volume"),
        **preset,
    }
    out = subprocess.run(
        [sys.executable, "-c", WHERE_TRITON_WRITES],
        capture_output=True, text=True, check=True, env=env, timeout=120,
    )  # fmt: skip
    used = Path(out.stdout.split()[-1])
    assert (used / "probe.bin").read_bytes() == b"kernel"
    return used


def test_worker_puts_triton_kernels_in_the_model_cache_volume(tmp_path: Path) -> None:
    used = cache_dir_used(tmp_path, {})
    assert used.parent == tmp_path / "volume" / "triton"
    assert not (tmp_path / "home" / ".triton" / "cache").exists()


def test_a_triton_cache_dir_in_the_environment_wins(tmp_path: Path) -> None:
    used = cache_dir_used(tmp_path, {"TRITON_CACHE_DIR": str(tmp_path / "own")})
    assert used.parent == tmp_path / "own"
