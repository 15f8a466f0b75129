"""A fixed number of compiler processes, each lent to one compilation at a time.

A compilation that overruns its time limit, or kills its process, is refused (CompileError: a
pathological spec is the client's problem) and its process replaced in the background, so the
pool heals itself and a bad spec costs at most one slot for one time limit. Processes come
from a forkserver that has imported xgrammar once, so a replacement starts in a fraction of the
first start's time.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
from multiprocessing.context import BaseContext

from services.grammar.compiler_process import (
    Compiled,
    CompileError,
    CompilerProcess,
    CompilerUnavailable,
)
from services.grammar.grammar_spec import CompileJob

log = logging.getLogger(__name__)

RESPAWN_DELAY_S = 1.0


def forkserver_context() -> BaseContext:
    """Children forked from a clean, single-threaded server that preloaded xgrammar (forking
    the service itself, with its event loop and threads, is not safe)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["xgrammar", "services.grammar.compiler_process"])
    return ctx


class CompilerPool:
    def __init__(
        self,
        tokenizer_info: str,
        *,
        size: int = 2,
        max_threads: int = 1,
        memory_limit_mb: int = 2048,
        ctx: BaseContext | None = None,
    ) -> None:
        self._ctx = ctx or forkserver_context()
        self._procs = [
            CompilerProcess(
                self._ctx, tokenizer_info, max_threads=max_threads, memory_limit_mb=memory_limit_mb
            )
            for _ in range(max(1, size))
        ]
        self._idle: asyncio.Queue[CompilerProcess] = asyncio.Queue()
        self._respawns: set[asyncio.Task[None]] = set()
        self.replacements = 0

    @property
    def size(self) -> int:
        return len(self._procs)

    @property
    def num_idle(self) -> int:
        return self._idle.qsize()

    async def start(self) -> None:
        await asyncio.gather(*(p.start() for p in self._procs))
        for proc in self._procs:
            self._idle.put_nowait(proc)

    async def compile(self, job: CompileJob, timeout_s: float) -> Compiled:
        """Compile on the next free process. CompileError for a spec that fails, overruns
        `timeout_s`, or crashes the compiler."""
        proc = await self._idle.get()
        healthy = False
        try:
            if not proc.alive:  # died while idle (killed from outside)
                await proc.start()
            result = await proc.compile(job, timeout_s)
            healthy = True
            return result
        except CompileError:
            healthy = True
            raise
        except CompilerUnavailable as exc:
            log.warning("grammar compilation failed: %s; replacing its process", exc)
            raise CompileError(f"the grammar could not be compiled: {exc}") from None
        finally:
            if healthy:
                self._idle.put_nowait(proc)
            else:  # timeout, crash or cancellation: the process state is unknown
                proc.kill()
                self._respawn(proc)

    def _respawn(self, proc: CompilerProcess) -> None:
        task = asyncio.create_task(self._replace(proc), name="grammar-compiler-respawn")
        self._respawns.add(task)
        task.add_done_callback(self._respawns.discard)

    async def _replace(self, proc: CompilerProcess) -> None:
        while True:
            try:
                await proc.start()
                break
            except Exception:
                log.exception("restarting a grammar compiler process failed; retrying")
                await asyncio.sleep(RESPAWN_DELAY_S)
        self.replacements += 1
        self._idle.put_nowait(proc)

    async def close(self) -> None:
        for task in list(self._respawns):
            task.cancel()
        await asyncio.gather(*self._respawns, return_exceptions=True)
        for proc in self._procs:
            await asyncio.to_thread(proc.kill)
