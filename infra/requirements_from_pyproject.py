"""Print the runtime requirements of pyproject.toml, one per line, for `pip install -r`.

The Dockerfile installs dependencies before copying the code so the dependency layer is cached
across code changes; pyproject.toml stays the only place they are listed. Stdlib only: it runs
in a bare python image.
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path


def requirements(pyproject: Path, extras: list[str]) -> list[str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    reqs = list(project.get("dependencies", []))
    optional = project.get("optional-dependencies", {})
    for extra in extras:
        if extra not in optional:
            raise SystemExit(f"unknown extra {extra!r}; known: {', '.join(sorted(optional))}")
        reqs += optional[extra]
    return reqs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("pyproject", type=Path)
    parser.add_argument("--extra", action="append", default=[])
    args = parser.parse_args(argv)
    sys.stdout.write("".join(f"{r}\n" for r in requirements(args.pyproject, args.extra)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
