"""One grammar-compiling child process, and the parent's handle on it.

Why a process and not a thread: a pathological spec can make xgrammar compile (or serialize)
for minutes or allocate gigabytes, and a thread can be neither stopped nor bounded. A child can
be killed at the time limit, and runs under an address-space limit, so the service itself always
answers. The child holds its own GrammarCompiler over the served tokenizer (sent to it as
xgrammar's serialized TokenizerInfo) and compiles one job at a time: a CompileJob in,
("ok", serialized grammar, seconds) or ("error", message) out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import resource
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any

from services.grammar.grammar_spec import JSON_STRICT_MODE, CompileJob
from services.grammar.json_strings import json_schema_grammar

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # importing xgrammar (and torch) on a busy 2-core machine is slow
MAX_MESSAGE_CHARS = 2000


class CompileError(Exception):
    """The spec does not compile (the client's problem): the message says why."""


class CompilerUnavailable(Exception):
    """The child died or timed out; the job's outcome is unknown or was cut short."""


@dataclass(frozen=True)
class Compiled:
    serialized: str  # xgrammar CompiledGrammar.serialize_json()
    seconds: float  # compile + serialize, measured in the child


class CompilerProcess:
    """A child process that compiles one job at a time. Not safe for concurrent `compile`
    calls: the pool hands each process to one caller at a time."""

    def __init__(
        self, ctx: BaseContext, tokenizer_info: str, *, max_threads: int, memory_limit_mb: int
    ) -> None:
        self._ctx = ctx
        self._args = (tokenizer_info, max_threads, memory_limit_mb)
        self._proc: BaseProcess | None = None
        self._conn: Connection | None = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    async def start(self) -> None:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(  # type: ignore[attr-defined]
            target=child_main, args=(child, *self._args), name="grammar-compiler", daemon=True
        )
        proc.start()
        child.close()
        self._proc, self._conn = proc, parent
        reply = await asyncio.to_thread(_receive, parent, START_TIMEOUT_S)
        if reply != ("ready",):
            self.kill()
            raise CompilerUnavailable(f"compiler process failed to start: {reply!r}")

    async def compile(self, job: CompileJob, timeout_s: float) -> Compiled:
        """Compile `job` within `timeout_s` (CompileError: the spec's fault). On a timeout or
        a crash the child is killed and CompilerUnavailable raised; start a new one."""
        conn = self._conn
        if conn is None or not self.alive:
            raise CompilerUnavailable("compiler process is not running")
        reply = await asyncio.to_thread(_exchange, conn, job, timeout_s)
        if reply is None:
            self.kill()
            raise CompilerUnavailable(f"compilation took longer than {timeout_s:g} s")
        if reply == ("eof",):
            code = self._proc.exitcode if self._proc is not None else None
            self.kill()
            raise CompilerUnavailable(f"the compiler process died (exit code {code})")
        if reply[0] == "ok":
            return Compiled(reply[1], reply[2])
        raise CompileError(reply[1])

    def kill(self) -> None:
        proc, conn = self._proc, self._conn
        self._proc = self._conn = None
        if conn is not None:
            conn.close()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


def _exchange(conn: Connection, request: CompileJob, timeout_s: float) -> Any:
    try:
        conn.send(request)
    except (BrokenPipeError, EOFError, OSError):
        return ("eof",)
    return _receive(conn, timeout_s)


def _receive(conn: Connection, timeout_s: float) -> Any:
    """The child's next message; None on timeout, ("eof",) when it died."""
    try:
        if not conn.poll(timeout_s):
            return None
        return conn.recv()
    except (EOFError, OSError):
        return ("eof",)


# --- the child ------------------------------------------------------------------------------


def child_main(conn: Connection, tokenizer_info: str, max_threads: int, memory_mb: int) -> None:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
    compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
    _limit_memory(memory_mb)
    conn.send(("ready",))
    while True:
        try:
            job = conn.recv()
        except (EOFError, OSError):
            return
        started = time.perf_counter()
        try:
            compiled = compile_grammar(compiler, job)
            serialized = compiled.serialize_json()
            reply: tuple[Any, ...] = ("ok", serialized, time.perf_counter() - started)
        except MemoryError:
            reply = ("error", f"compiling it needs more than the {memory_mb} MiB allowed")
        except Exception as exc:
            message = clean_message(str(exc))
            if "bad_alloc" in message:
                message = f"compiling it needs more than the {memory_mb} MiB allowed"
            reply = ("error", message)
        conn.send(reply)


def compile_grammar(compiler: Any, job: CompileJob) -> Any:
    """Run `job` on an xgrammar GrammarCompiler (in the child; tests call it directly)."""
    import xgrammar as xgr

    method, source = job.method, job.source
    if method == "json_schema":
        # Built through json_strings: xgrammar's length-bounded strings admit raw control
        # characters and no escapes (json_strings.py).
        grammar = json_schema_grammar(
            source, any_whitespace=job.json_any_whitespace, strict_mode=JSON_STRICT_MODE
        )
        return compiler.compile_grammar(grammar)
    if method == "json_object":
        # json_object: any JSON object (OpenAI's JSON mode), whitespace as configured.
        return compiler.compile_json_schema(
            '{"type": "object"}', any_whitespace=job.json_any_whitespace, strict_mode=False
        )
    if method == "regex":
        return compiler.compile_regex(source)
    if method == "ebnf":
        return compiler.compile_grammar(source)
    if method == "lark":
        return compiler.compile_lark(source)
    if method == "structural_tag":
        tag = json.loads(source)
        if "structures" in tag:  # vLLM's legacy form: begin/schema/end items plus triggers
            items = [
                xgr.StructuralTagItem(
                    begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"]
                )
                for s in tag["structures"]
            ]
            return compiler.compile_structural_tag(items, tag.get("triggers", []))
        return compiler.compile_structural_tag(source)
    raise ValueError(f"unknown compile method {method!r}")


def _limit_memory(memory_mb: int) -> None:
    """Cap the address space at what is mapped now plus `memory_mb`: a runaway compilation
    fails with an allocation error instead of swapping the machine."""
    if memory_mb <= 0:
        return
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + memory_mb * 2**20
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


def clean_message(message: str) -> str:
    """xgrammar's C++ errors start with `[time] file.cc:line: `: keep what a client can act on."""
    text = _LOCATION.sub("", message.strip())
    if len(text) > MAX_MESSAGE_CHARS:
        text = text[:MAX_MESSAGE_CHARS] + "..."
    return text or "the grammar does not compile"
