"""Create (or remove) the Docker secrets the Swarm stack reads (infra/swarm/stack.yml).

    python -m infra.swarm.secrets create     # on a manager node, before the first deploy
    python -m infra.swarm.secrets remove     # after `docker stack rm`, to start over

Secrets made:
- meshllm_redis_password_<user>: one per service ACL user and the healthcheck user;
- meshllm_redis_acl: Redis' ACL file, rendered from those same passwords (SHA-256 hashes
  only, infra/redis/render_acl.py), so Redis and the services cannot disagree;
- meshllm_admin_token, meshllm_api_keys: the admin Bearer token and the API keys.

A value set in the environment under its usual name is used (MESHLLM_REDIS_PASSWORD_<USER>,
MESHLLM_ADMIN_TOKEN, MESHLLM_API_KEYS); any other is generated. Generated admin token and API
key are printed once (stdout): Docker never shows a secret again. All are created together or
none: a new password needs a new ACL file, so existing meshllm secrets are an error (remove
them first; a running stack holds its secrets until `docker stack rm`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys
from collections.abc import Callable, Mapping

from infra.redis.render_acl import HEALTHCHECK, SERVICE_USERS, render_acl

ACL_SECRET = "meshllm_redis_acl"
ADMIN_TOKEN_SECRET = "meshllm_admin_token"
API_KEYS_SECRET = "meshllm_api_keys"
ACL_USERS = (*SERVICE_USERS, HEALTHCHECK)


def password_secret(user: str) -> str:
    return f"meshllm_redis_password_{user}"


SECRET_NAMES = (
    *(password_secret(u.name) for u in ACL_USERS),
    ACL_SECRET,
    ADMIN_TOKEN_SECRET,
    API_KEYS_SECRET,
)


def plan_secrets(
    env: Mapping[str, str], token: Callable[[], str] = lambda: secrets.token_urlsafe(32)
) -> tuple[dict[str, str], list[str]]:
    """(secret name -> value, names whose value was generated). Pure: no Docker."""
    values: dict[str, str] = {}
    generated: list[str] = []

    def pick(name: str, env_name: str, make: Callable[[], str]) -> str:
        value = env.get(env_name) or ""
        if not value:
            value = make()
            generated.append(name)
        values[name] = value
        return value

    passwords = {}
    for user in ACL_USERS:
        passwords[user.password_env] = pick(password_secret(user.name), user.password_env, token)
    admin_password = env.get("MESHLLM_REDIS_PASSWORD_ADMIN")  # optional operator user
    if admin_password:
        passwords["MESHLLM_REDIS_PASSWORD_ADMIN"] = admin_password
    values[ACL_SECRET] = render_acl(passwords)
    pick(ADMIN_TOKEN_SECRET, "MESHLLM_ADMIN_TOKEN", token)
    pick(API_KEYS_SECRET, "MESHLLM_API_KEYS", lambda: f"sk-meshllm-{token()}")
    return values, generated


def _docker(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["docker", *args], input=stdin, capture_output=True, text=True, timeout=60
    )


def existing_secrets() -> set[str]:
    result = _docker("secret", "ls", "--format", "{{.Name}}")
    if result.returncode != 0:
        raise SystemExit(f"docker secret ls failed (a swarm manager?): {result.stderr.strip()}")
    return set(result.stdout.split()) & set(SECRET_NAMES)


def create(env: Mapping[str, str]) -> int:
    present = existing_secrets()
    if present:
        print(
            f"secrets exist already: {', '.join(sorted(present))}\n"
            "remove them first (python -m infra.swarm.secrets remove, after docker stack rm)",
            file=sys.stderr,
        )
        return 1
    values, generated = plan_secrets(env)
    for name, value in values.items():
        result = _docker("secret", "create", "--label", "meshllm=1", name, "-", stdin=value)
        if result.returncode != 0:
            print(f"docker secret create {name}: {result.stderr.strip()}", file=sys.stderr)
            return 1
    print(f"created {len(values)} secrets", file=sys.stderr)
    for name in (ADMIN_TOKEN_SECRET, API_KEYS_SECRET):
        if name in generated:  # shown once: Docker never reveals a secret's value again
            print(f"{name}={values[name]}")
    return 0


def remove() -> int:
    present = sorted(existing_secrets())
    if present:
        result = _docker("secret", "rm", *present)
        if result.returncode != 0:
            print(f"docker secret rm: {result.stderr.strip()}", file=sys.stderr)
            return 1
    print(f"removed {len(present)} secrets", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("action", choices=("create", "remove"))
    args = parser.parse_args(argv)
    return create(os.environ) if args.action == "create" else remove()


if __name__ == "__main__":
    raise SystemExit(main())
