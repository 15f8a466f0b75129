"""The legacy builder (Debian's docker.io, no buildx) reads only /.dockerignore; BuildKit reads
infra/Dockerfile.dockerignore first. Both must send the same context, or one builder would ship
the venv (GBs) or miss the build extras."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _patterns(path: Path) -> list[str]:
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_root_dockerignore_matches_the_dockerfile_one() -> None:
    root = _patterns(REPO / ".dockerignore")
    assert root == _patterns(REPO / "infra" / "Dockerfile.dockerignore")
    assert root[0] == "**"  # everything excluded unless named
    assert "!.venv/**" not in root and "!.build-extras/**" in root
