"""Triton JIT compiles seen by this process.

A Triton kernel compiles once per specialization (its constexprs, and its integer arguments'
divisibility by 16): a compile met while serving holds the step that hit it, and every step
queued behind it, for ~0.3-2 s on a machine without a warm Triton cache. The worker installs a
`CompileWatch` before its warm-up and marks the warm-up's end: every compile after that is a
stall a user saw, counted and logged with the kernel and what was specialized, so that the
warm-up can be made to cover it.

Triton calls `knobs.runtime.jit_cache_hook` before a compile and `jit_post_compile_hook`
after it (Triton 3.3+; older releases: `JITFunction.cache_hook` / `compiled_hook`). Both are
process-wide single slots: a hook already installed by someone else is chained, not replaced.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Compile:
    kernel: str
    seconds: float
    after_warmup: bool
    specialization: str  # the constexprs and the specialized argument attributes, shortened


def _hook_slots() -> tuple[Any, str, str] | None:
    """(object holding the hooks, pre-compile attribute, post-compile attribute)."""
    try:
        from triton import knobs

        if hasattr(knobs.runtime, "jit_post_compile_hook"):
            return knobs.runtime, "jit_cache_hook", "jit_post_compile_hook"
    except ImportError:
        pass
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    if hasattr(JITFunction, "compiled_hook"):
        return JITFunction, "cache_hook", "compiled_hook"
    return None


def _specialization(compile_info: dict[str, Any], limit: int = 300) -> str:
    constants = compile_info.get("constants") or {}
    named = {k[-1] if isinstance(k, tuple) else k: v for k, v in dict(constants).items()}
    text = f"constexprs {named} configs {compile_info.get('configs')}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CompileWatch:
    """Counts and times this process's Triton compiles; `on_compile` is called with each."""

    def __init__(self, on_compile: Callable[[Compile], None] | None = None) -> None:
        self.on_compile = on_compile
        self.compiles: list[Compile] = []
        self.warm = False
        self._started: dict[int, float] = {}
        self._lock = threading.Lock()
        self._slots = _hook_slots()
        self._chained: tuple[Any, Any] = (None, None)

    @property
    def installed(self) -> bool:
        return self._slots is not None

    def install(self) -> CompileWatch:
        if self._slots is None:
            log.info("this Triton has no compile hooks: compiles are not watched")
            return self
        holder, pre, post = self._slots
        self._chained = (getattr(holder, pre), getattr(holder, post))
        setattr(holder, pre, self._before)
        setattr(holder, post, self._after)
        return self

    def uninstall(self) -> None:
        if self._slots is None:
            return
        holder, pre, post = self._slots
        setattr(holder, pre, self._chained[0])
        setattr(holder, post, self._chained[1])

    def mark_warm(self) -> None:
        """From now on a compile is a serving stall."""
        self.warm = True

    def after_warmup(self) -> list[Compile]:
        return [c for c in self.compiles if c.after_warmup]

    def _before(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self._started[threading.get_ident()] = time.perf_counter()
        chained = self._chained[0]
        # a true answer from a pre-compile hook tells Triton to skip the compile: only a
        # chained hook may say so
        return chained(*args, **kwargs) if chained is not None else False

    def _after(self, *args: Any, **kwargs: Any) -> Any:
        now = time.perf_counter()
        with self._lock:
            started = self._started.pop(threading.get_ident(), now)
        fn = kwargs.get("fn")
        name = getattr(fn, "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        event = Compile(
            kernel=name,
            seconds=now - started,
            after_warmup=self.warm,
            specialization=_specialization(kwargs.get("compile") or {}),
        )
        self.compiles.append(event)
        if self.on_compile is not None:
            self.on_compile(event)
        chained = self._chained[1]
        return chained(*args, **kwargs) if chained is not None else None
