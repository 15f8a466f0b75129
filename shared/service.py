"""One way to run a meshllm service: the Service base class and `run_service`.

Lifecycle of a process (`python -m services.<name>` calls `run_service`):
1. logs are configured and the HTTP app (admin routes + the service's own) is bound and served
   at once, so `/health` answers while Redis is still being reached; `/ready` says 503 until
   `start()` has finished and the dependencies answer;
2. `start()` connects the bus (waiting for Redis however long it takes) and starts the
   heartbeat; then `run()` runs the service's loops, which ride out Redis outages: /ready says
   503 while Redis is away and 200 again once it answers;
3. SIGTERM/SIGINT (or the `drain` admin action, minus the exit) sets `stopping`, awaits
   `drain()` bounded by `shutdown_timeout_s`, then stops the HTTP server and closes the bus.
   The exit status is 0 for a requested shutdown, 1 when `run()` failed or `start()` did.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import faulthandler
import gc
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

import uvicorn
from fastapi import APIRouter, FastAPI
from prometheus_client import Gauge

from shared.admin import build_admin_app, describe_settings, package_version
from shared.bus import Bus
from shared.config import CommonSettings, ModelSettings, SchedulerSettings
from shared.heap_trim import trim_heap_every
from shared.heartbeat import INCARNATION, Heartbeater
from shared.logs import configure_logging
from shared.metrics import metric_name
from shared.model.source import served_model_name
from shared.streams import Streams

if TYPE_CHECKING:
    from shared.protocol.health import GroupLoad, GroupRole, ServiceName

log = logging.getLogger(__name__)

READY_PING_TIMEOUT_S = 2.0
FIRST = asyncio.FIRST_COMPLETED

# multiprocess_mode: how a gateway's API processes combine (shared/metrics.py); ready only
# when every live one is.
SERVICE_READY = Gauge(
    metric_name("service_ready"),
    "1 when the service's last readiness check passed",
    ["service"],
    multiprocess_mode="livemin",
)
SERVICE_START_TIME = Gauge(
    metric_name("service_start_time_seconds"),
    "Unix time the service object was made",
    ["service"],
    multiprocess_mode="min",
)


class Service(abc.ABC):
    """Base of every service. Subclasses set `name`, implement `run()`, and extend the hooks
    (calling `super()` in `start`, `check_ready`, `state`, `admin_actions`, `close`)."""

    name: ClassVar[ServiceName]

    def __init__(self, settings: CommonSettings) -> None:
        self.settings = settings
        self.streams = Streams(settings.cluster)
        self.incarnation = INCARNATION
        self.stopping = asyncio.Event()
        self.started = False
        self.started_at = time.time()
        self._closed = asyncio.Event()
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self._drain_task: asyncio.Task[bool] | None = None
        self.heartbeater: Heartbeater | None = None
        self.bus: Bus
        SERVICE_START_TIME.labels(self.name).set(self.started_at)
        SERVICE_READY.labels(self.name).set(0)

    # --- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect the bus and start heartbeating. Subclasses set up after `super().start()`."""
        s = self.settings
        self.bus = Bus(
            s.redis_url,
            consumer=consumer_name(self.name, s.group, s.instance_id),
            maxlen=s.stream_maxlen,
            retention_s=s.stream_retention_s,
            dead_letter_stream=self.streams.deadletter,
            publish_timeout_s=s.publish_timeout_s,
            op_timeout_s=s.redis_timeout_s,
        )
        await self.bus.connect()  # however long Redis takes: /ready says "starting" meanwhile
        self.heartbeater = Heartbeater(
            self.bus,
            self.streams.heartbeats,
            service=self.name,
            instance_id=self.settings.instance_id,
            group=self.settings.group,
            interval_s=self.settings.heartbeat_interval_s,
            is_ready=self._ready_flag,
            model=self.served_model(),
            role=self.group_role(),
            load=self.group_load,
        )
        self._heartbeat_task = asyncio.create_task(
            self.heartbeater.run(self._closed), name=f"{self.name}-heartbeat"
        )
        self._trim_task = asyncio.create_task(
            trim_heap_every(s.malloc_trim_interval_s, self._closed), name=f"{self.name}-trim"
        )
        self.started = True

    @abc.abstractmethod
    async def run(self) -> None:
        """The service's loops. Must return soon after `self.stopping` is set."""

    async def drain(self) -> None:
        """Stop taking work and finish what is in flight. The base service holds no work."""
        return None

    async def close(self) -> None:
        """Release resources after draining: stop the heartbeat, close the bus."""
        self._closed.set()
        for task in (self._heartbeat_task, self._trim_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        bus: Bus | None = getattr(self, "bus", None)  # absent when start() never ran
        if bus is not None:
            await bus.close()

    def begin_drain(self) -> asyncio.Task[bool]:
        """Set `stopping` and run `drain()` once, bounded by `shutdown_timeout_s`.

        Idempotent: the admin action and the signal handler share one drain. The task's result
        is True when the drain finished in time.
        """
        if self._drain_task is None:
            self.stopping.set()
            self._drain_task = asyncio.create_task(self._bounded_drain(), name="drain")
        return self._drain_task

    async def _bounded_drain(self) -> bool:
        timeout = self.settings.shutdown_timeout_s
        try:
            await asyncio.wait_for(self.drain(), timeout=timeout)
            return True
        except TimeoutError:
            log.warning("drain did not finish within %.1f s; shutting down anyway", timeout)
        except Exception:
            log.exception("drain failed")
        return False

    # --- health and admin --------------------------------------------------------------------

    async def check_ready(self) -> tuple[bool, dict[str, Any]]:
        """Ready = started, not stopping, and Redis answers a PING. Subclasses add checks to
        the returned `checks` dict and AND their verdict in."""
        checks: dict[str, str] = {}
        if not self.started:
            checks["service"] = "starting"
        elif self.stopping.is_set():
            checks["service"] = "draining"
        else:
            checks["service"] = "ok"
        if self.started:
            try:
                await asyncio.wait_for(self.bus.redis.ping(), READY_PING_TIMEOUT_S)
                checks["redis"] = "ok"
            except Exception as exc:
                checks["redis"] = f"unreachable: {type(exc).__name__}: {exc}"
        else:
            checks["redis"] = "not connected"
        ready = all(v == "ok" for v in checks.values())
        SERVICE_READY.labels(self.name).set(1 if ready else 0)
        return ready, {"checks": checks}

    async def _ready_flag(self) -> bool:
        return (await self.check_ready())[0]

    def served_model(self) -> str:
        """The model name this service's heartbeats announce: from its settings, so a beat
        names the model before it is loaded (and from services that never load it, like the
        scheduler); "" for services without a model."""
        s = self.settings
        return (
            served_model_name(s.model, s.served_model_name) if isinstance(s, ModelSettings) else ""
        )

    def group_role(self) -> GroupRole:
        """A scheduler's role (both / prefill / decode) for its heartbeats; "" otherwise."""
        return self.settings.role if isinstance(self.settings, SchedulerSettings) else ""

    def group_load(self) -> GroupLoad | None:
        """A scheduler's load for its heartbeats; None for other services."""
        return None

    def state(self) -> dict[str, Any]:
        """For GET /admin/state. Subclasses add their queues under their own keys."""
        return {
            "service": self.name,
            "instance_id": self.settings.instance_id,
            "incarnation": self.incarnation,
            "cluster": self.settings.cluster,
            "group": self.settings.group,
            "version": package_version(),
            "python": sys.version.split()[0],
            "event_loop": loop_name(asyncio.get_running_loop()),
            "started_at": self.started_at,
            "uptime_s": round(time.time() - self.started_at, 3),
            "started": self.started,
            "stopping": self.stopping.is_set(),
            "heartbeats_sent": self.heartbeater.sent if self.heartbeater else 0,
            "config": describe_settings(self.settings),
        }

    def admin_actions(self) -> dict[str, Callable[[], Awaitable[dict[str, Any]]]]:
        """POST /admin/actions/{name}. `drain` stops taking work but keeps the process up (not
        ready) so an operator can drain before a restart; SIGTERM then exits at once."""
        return {"drain": self._drain_action}

    async def _drain_action(self) -> dict[str, Any]:
        finished = await self.begin_drain()
        return {"drained": finished, "stopping": True}

    def routes(self) -> list[APIRouter]:
        """Extra routes served on the service's port (the gateway's OpenAI API)."""
        return []

    def configure_app(self, app: FastAPI) -> None:
        """Last hook on the app after routes are added (exception handlers, middleware)."""
        return None


def consumer_name(service: str, group: str, instance_id: str) -> str:
    """This process's consumer name in stream groups: stable across its restarts (so a restart
    resumes its own pending entries at once instead of waiting for them to go idle), distinct
    for each service and worker group on one host."""
    return f"{service}:{group}:{instance_id}"


class _AdminServer(uvicorn.Server):
    """uvicorn without its own signal handling: run_service owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind before serving so a port clash fails start-up with a clear error."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only
    # then, and without it every keep-alive response stalls ~40 ms (Nagle + delayed ACK).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot bind {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


async def serve(
    service: Service,
    *,
    sock: socket.socket | None = None,
    shutdown: asyncio.Event | None = None,
    freeze_heap: bool = False,
) -> int:
    """Run `service` until SIGTERM/SIGINT (or `shutdown` is set) or a failure; returns the
    process exit status. `sock` and `shutdown` let tests run a service in-process;
    `freeze_heap` (a service's own process: run_service) freezes the start-up heap once the
    service has started (freeze_startup_heap)."""
    settings = service.settings
    sock = sock or bind_socket(settings.host, settings.port)
    config = uvicorn.Config(
        build_admin_app(service),
        http="httptools" if settings.event_loop == "uvloop" else "h11",
        log_config=None,
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
    )
    server = _AdminServer(config)
    server_task = asyncio.create_task(server.serve(sockets=[sock]), name="http")
    shutdown = shutdown or asyncio.Event()
    shutdown_task = asyncio.create_task(shutdown.wait(), name="shutdown-signal")
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    # `kill -USR2 <pid>`: drain as the admin action does (the process stays up, not ready).
    loop.add_signal_handler(signal.SIGUSR2, service.begin_drain)
    log.info("%s listening on %s:%s", service.name, *sock.getsockname()[:2])

    status = 0
    run_task: asyncio.Task[None] | None = None
    try:
        start_task = asyncio.create_task(service.start(), name=f"{service.name}-start")
        await asyncio.wait({start_task, shutdown_task, server_task}, return_when=FIRST)
        if start_task.done():
            start_task.result()
            frozen = freeze_startup_heap() if freeze_heap else 0
            log.info(
                "%s started (%d start-up objects frozen out of the collector's scans)",
                service.name, frozen, extra={"incarnation": service.incarnation},
            )  # fmt: skip
            run_task = asyncio.create_task(service.run(), name=f"{service.name}-run")
            await asyncio.wait({run_task, shutdown_task, server_task}, return_when=FIRST)
            if run_task.done() and not shutdown.is_set() and run_task.exception() is None:
                if not service.stopping.is_set():
                    raise RuntimeError("run() returned before shutdown was requested")
                # Drained by the admin action: keep answering admin requests until the signal.
                await asyncio.wait({shutdown_task, server_task}, return_when=FIRST)
        else:
            await _finish(start_task, 0)
        if server_task.done() and not shutdown.is_set():
            raise RuntimeError(f"HTTP server stopped: {server_task.exception() or 'exited'}")
        log.info("%s shutting down", service.name)
    except Exception:
        log.exception("%s failed", service.name)
        status = 1
    finally:
        shutdown_task.cancel()
        if service.started:
            await service.begin_drain()
        service.stopping.set()
        if run_task is not None:
            status = max(status, await _finish(run_task, settings.shutdown_timeout_s))
        server.should_exit = True
        await _finish(server_task, 10.0)
        try:
            await service.close()
        except Exception:
            log.exception("closing %s failed", service.name)
        sock.close()
        # Removed only now: a second Ctrl-C during the drain must not raise KeyboardInterrupt.
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR2):
            loop.remove_signal_handler(sig)
    return status


def freeze_startup_heap() -> int:
    """Collect once, then move every object alive after start-up (imported modules, a loaded
    model, caches) into the permanent generation (`gc.freeze`), so the cyclic collector stops
    walking them; returns how many objects are frozen. A full collection walks the whole
    start-up heap (a loaded model's modules and tensors included) and stops the event loop and
    the step thread while it runs; a long decode loop allocates enough to trigger one every few
    dozen steps, and each left the GPU idle for many step times. Objects made later (requests,
    steps) are collected as before. vLLM's engine core does the same after start-up."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def _finish(task: asyncio.Task[Any], timeout: float) -> int:
    """Wait for `task`, cancelling it past `timeout`; 1 when it failed, else 0."""
    if not task.done():
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            log.warning("%s did not stop within %.1f s; cancelling", task.get_name(), timeout)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return 0
        except Exception:
            pass
    if task.cancelled():
        return 0
    if task.exception() is not None:
        log.error("%s failed", task.get_name(), exc_info=task.exception())
        return 1
    return 0


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The event loop a service's process runs on (CommonSettings.event_loop); None: asyncio's."""
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """ "uvloop.Loop" or "asyncio.<class>": which loop a process really runs on."""
    cls = type(loop)
    return f"{cls.__module__.split('.')[0]}.{cls.__qualname__}"


def run_service(service: Service, sock: socket.socket | None = None) -> None:
    """Entry point of every `services/<name>/__main__.py`; exits the process with its status.
    `sock`: a listening socket to serve on (a gateway's API processes share one)."""
    settings = service.settings
    configure_logging(service.name, settings.instance_id, settings.log_level, settings.log_json)
    # `kill -USR1 <pid>`: every thread's Python stack on stderr, for a process that hangs
    # (py-spy's dump without installing it; the signal handler runs even with the loop stuck).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        with asyncio.Runner(loop_factory=loop_factory(settings.event_loop)) as runner:
            status = runner.run(serve(service, sock=sock, freeze_heap=True))
    except OSError as exc:
        log.error("%s", exc)
        status = 1
    sys.exit(status)
