"""Container healthcheck: exit 0 iff this container's service answers 200 on `/ready`.

Used by docker-compose.yml (`python -m infra.healthcheck`); the port is the service's own
`MESHLLM_PORT`, so one command serves every service. Stdlib only, so it starts fast.
"""

from __future__ import annotations

import os
import sys
import urllib.error
import urllib.request


def main() -> int:
    port = os.environ.get("MESHLLM_PORT", "")
    if not port.isdigit():
        print(f"MESHLLM_PORT must be set to the service's port, got {port!r}", file=sys.stderr)
        return 2
    url = f"http://127.0.0.1:{port}/ready"
    try:
        with urllib.request.urlopen(url, timeout=3) as response:
            return 0 if response.status == 200 else 1
    except urllib.error.HTTPError as exc:
        print(f"{url}: {exc.code} {exc.read(500).decode(errors='replace')}", file=sys.stderr)
    except OSError as exc:
        print(f"{url}: {exc}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
