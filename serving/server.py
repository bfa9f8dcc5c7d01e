"""Runs both faces on one asyncio loop and owns the process lifecycle.

Start-up: bind HTTP and gRPC first (health says NOT_SERVING / 503, requests get
UNAVAILABLE), build and warm the engine on a worker thread, then flip to SERVING.

Shutdown (``stop`` / SIGTERM / SIGINT):
  1. stop accepting: requests get UNAVAILABLE/503, health NOT_SERVING, listening sockets close;
  2. ``engine.shutdown(grace_s)`` finishes or aborts in-flight work and flushes write-backs;
  3. the servers stop once their streams are done (at most ``grace_s`` later).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import uvicorn

from serving.config import ServerConfig
from serving.frontend import EngineLike, Frontend
from serving.grpc_server import GrpcFace
from serving.http_server import create_app
from serving.metrics import build_metrics

log = logging.getLogger(__name__)

EngineFactory = Callable[[], EngineLike]
T = TypeVar("T")


def _in_thread(fn: Callable[..., T], *args: object) -> asyncio.Future[T]:
    """Run ``fn`` on a fresh thread; unlike ``asyncio.to_thread`` this works while the interpreter exits."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def run() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
            loop.call_soon_threadsafe(_settle_exception, future, exc)
        else:
            loop.call_soon_threadsafe(_settle_result, future, result)

    threading.Thread(target=run, name=f"strata-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return future


def _settle_result(future: asyncio.Future[T], result: T) -> None:
    if not future.done():
        future.set_result(result)


def _settle_exception(future: asyncio.Future[T], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


class _UvicornServer(uvicorn.Server):
    """uvicorn without its own signal handling (``StrataServer`` handles signals)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # proto set: asyncio then sets TCP_NODELAY
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


EXIT_ENGINE_FAILED = 70  # EX_SOFTWARE (sysexits.h): the engine stopped after an unrecoverable error


class StrataServer:
    """Both faces over one engine.  ``await serve()`` runs until ``request_stop()``."""

    def __init__(self, config: ServerConfig, engine_factory: EngineFactory) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self.frontend = Frontend(
            build_metrics(lambda: self.frontend.engine_or_none), config.served_model_name, config.handoff
        )
        self.http_port: int | None = None
        self.grpc_port: int | None = None
        self.bound = threading.Event()  # ports are known
        self.ready = threading.Event()  # the engine is warm (or failed)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.exit_code = 0

    def request_stop(self) -> None:
        """Thread-safe: begin the graceful shutdown."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    def _watch_engine(self, engine: object, grpc_face: GrpcFace | None) -> None:
        """An engine that stops for good (an unrecoverable error) takes the server down, non-zero.

        Health turns 503 / NOT_SERVING first (a router stops sending here), then the
        graceful shutdown runs and the process exits with ``EXIT_ENGINE_FAILED``, so a
        supervisor (systemd, Kubernetes) sees a failure and restarts it.
        """
        loop, stop = self._loop, self._stop
        assert loop is not None and stop is not None

        def died(exc: BaseException) -> None:  # on the event loop
            log.critical(
                "the engine stopped after an unrecoverable error; shutting down (exit code %d)", EXIT_ENGINE_FAILED
            )
            self.frontend.fail(f"the engine stopped: {type(exc).__name__}: {exc}")
            self.exit_code = EXIT_ENGINE_FAILED
            if grpc_face is not None:
                loop.create_task(grpc_face.set_serving(False))
            stop.set()

        def on_fatal(exc: BaseException) -> None:  # on the engine thread
            loop.call_soon_threadsafe(died, exc)

        if hasattr(engine, "on_fatal"):
            engine.on_fatal = on_fatal  # the fake engines of the face tests have none
            fatal = getattr(engine, "fatal_error", None)
            if fatal is not None:  # it died before the hook was set
                on_fatal(fatal)

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT begin the graceful shutdown (main thread only)."""
        assert self._loop is not None
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.add_signal_handler(sig, self._stop.set)  # type: ignore[union-attr]

    async def serve(self, *, handle_signals: bool = False) -> int:
        """Serve until stopped; returns the process exit code."""
        self._loop = asyncio.get_running_loop()
        self._stop = stop = asyncio.Event()
        if handle_signals:
            self.install_signal_handlers()
        cfg = self.config
        grpc_face = GrpcFace(self.frontend, cfg) if cfg.enable_grpc else None
        http_server, sock = self._bind_http() if cfg.enable_http else (None, None)
        if grpc_face is not None:
            self.grpc_port = grpc_face.port
            await grpc_face.start()
        http_task = asyncio.create_task(http_server.serve(sockets=[sock])) if http_server and sock else None
        self.bound.set()
        log.info("serving HTTP on %s:%s, gRPC on %s:%s", cfg.host, self.http_port, cfg.host, self.grpc_port)

        warm = asyncio.ensure_future(_in_thread(self._engine_factory))
        stop_wait = asyncio.create_task(stop.wait())
        waiters: set[asyncio.Future[Any]] = {warm, stop_wait}
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        engine = await self._start_engine(warm, grpc_face) if warm.done() else None
        self.ready.set()
        await stop.wait()

        log.info("shutting down (grace %.1fs)", cfg.grace_s)
        self.frontend.begin_drain()
        if http_server is not None:
            http_server.should_exit = True  # closes the listening socket, lets open streams finish
        grpc_stop = asyncio.create_task(grpc_face.stop(cfg.grace_s + 1.0)) if grpc_face is not None else None
        if engine is None and not warm.done():
            engine = await warm  # cannot interrupt a warm-up; wait for it, then shut it down
        if engine is not None:
            await self._shut_down_engine(engine)
        self.frontend.mark_stopped()
        log.info("engine stopped; closing the servers")
        if grpc_stop is not None:
            await grpc_stop
        if http_task is not None:
            await http_task
        stop_wait.cancel()
        log.info("stopped (exit code %d)", self.exit_code)
        return self.exit_code

    def _bind_http(self) -> tuple[_UvicornServer, socket.socket]:
        """The HTTP server and its bound socket (it answers once ``serve`` runs on it)."""
        cfg = self.config
        sock = _bind(cfg.host, cfg.port)
        self.http_port = sock.getsockname()[1]
        server = _UvicornServer(
            uvicorn.Config(
                create_app(self.frontend, cfg),
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=max(1, int(cfg.grace_s) + 1),
                timeout_keep_alive=30,
                lifespan="off",
            )
        )
        return server, sock

    async def _start_engine(self, warm: asyncio.Future[EngineLike], grpc_face: GrpcFace | None) -> EngineLike | None:
        """Serve the warmed-up engine, or fail the server (exit code 1) if it did not start."""
        cfg = self.config
        try:
            engine = warm.result()
        except Exception as exc:  # noqa: BLE001 - any start-up failure stops the server, saying why
            if isinstance(exc, ValueError):  # a model or setting that cannot be served: the message says why
                log.error("the engine failed to start: %s", exc)
            else:
                log.exception("the engine failed to start")
            self.frontend.fail(f"it failed to start: {type(exc).__name__}: {exc}")
            self.exit_code = 1
            assert self._stop is not None
            self._stop.set()
            return None
        self.frontend.attach(engine)
        self._watch_engine(engine, grpc_face)
        if cfg.profile_on_start:
            await _in_thread(engine.start_profile, cfg.profile_dir)
        if grpc_face is not None:
            await grpc_face.set_serving(True)
        log.info("engine ready: %s", self.frontend.model_name)
        return engine

    async def _shut_down_engine(self, engine: EngineLike) -> None:
        """Stop a trace started at start-up, then let the engine finish or abort its work."""
        cfg = self.config
        try:
            if cfg.profile_on_start and self.frontend.failure is None:
                await _in_thread(engine.stop_profile)
            await _in_thread(engine.shutdown, cfg.grace_s)
        except Exception:  # noqa: BLE001 - the servers still stop; the exit code says it failed
            log.exception("engine shutdown failed")
            self.exit_code = 1


class ThreadedServer:
    """A ``StrataServer`` on a background thread with its own loop (tests, embedding)."""

    def __init__(self, config: ServerConfig, engine_factory: EngineFactory) -> None:
        self.server = StrataServer(config, engine_factory)
        self._thread = threading.Thread(target=self._run, name="strata-server", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
            log.exception("server thread crashed")
            self.server.bound.set()
            self.server.ready.set()

    def start_nowait(self) -> ThreadedServer:
        """Start the server thread without waiting for the engine (``server.bound`` and
        ``server.ready`` say when the ports are bound and when the engine serves)."""
        self._thread.start()
        return self

    def start(self, timeout: float = 600.0) -> ThreadedServer:
        """Start the server thread and wait until the engine serves."""
        self.start_nowait()
        if not self.server.ready.wait(timeout):
            raise TimeoutError("the server did not become ready")
        if self.error is not None:
            raise RuntimeError("the server failed to start") from self.error
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.request_stop()
        self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the server to stop by itself (an engine that died); True once it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def frontend(self) -> Frontend:
        return self.server.frontend

    @property
    def http_url(self) -> str:
        return f"http://{self.server.config.host}:{self.server.http_port}"

    @property
    def grpc_target(self) -> str:
        return f"{self.server.config.host}:{self.server.grpc_port}"
