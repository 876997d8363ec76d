"""A device process: the gRPC server around a `device.DeviceServicer`, and its lifetime.

`start_server` binds and starts the server (token checked from metadata before any body
is read, TLS, connection, call and idle caps, Health answered beside other calls);
`serve` runs one device until SIGTERM, SIGINT or its launcher's exit, printing one JSON
line once listening (see `device`).
The command line that calls it is `device_cli`.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
from concurrent import futures
from typing import Optional, Union

import grpc

from fax_bridge.errors import FleetError
from fax_bridge.fleet import security
from fax_bridge.fleet.device import DeviceServicer
from fax_bridge.rounds.client_runtime import ClientRuntime
from fax_bridge.fleet.protocol import (DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CONCURRENT_CALLS,
                                      DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_MESSAGE_BYTES,
                                      HANDSHAKE_TIMEOUT_MS, DeviceLimits, format_address,
                                      grpc_options, parse_address)
from fax_bridge.v1 import device_pb2_grpc as pb_grpc

log = logging.getLogger("fax_bridge.device")


def _run_xla_inline() -> None:
    """Runs this process's XLA calls in the thread that makes them. A device waits for
    every call's result at once, so jax's asynchronous CPU dispatch gains nothing and
    costs a hand-off to its worker thread and back on each call (about 0.1 ms of a
    0.7 ms round handler). Takes effect only before the CPU backend starts."""
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)


HEALTH_METHOD = "/fax_bridge.v1.Device/Health"
HEALTH_CALLS = 8   # Health calls that may run beside --max-concurrent-calls others
FD_RESERVE = 256   # descriptors kept for files, pipes and outgoing connections


class CallGate(grpc.ServerInterceptor):
    """Calls other than Health: at most `max_calls` in progress (more are refused at once
    with RESOURCE_EXHAUSTED) and `max_running` of them running (the others wait, each in
    its own thread, for one to finish). Health passes beside them: with a thread pool of
    `max_calls + HEALTH_CALLS`, a device busy with calls, or held by streams that never
    send, still answers a Health call at once."""

    def __init__(self, max_running: int, max_calls: int):
        self._running = threading.BoundedSemaphore(int(max_running))
        self._max_calls = int(max_calls)
        self._calls = 0
        self._lock = threading.Lock()
        self._gated: dict = {}  # method -> (its handler, that handler gated)

    @property
    def in_progress(self) -> int:
        """Calls admitted and not yet finished (running or waiting for their turn)."""
        with self._lock:
            return self._calls

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method == HEALTH_METHOD:
            return handler
        found = self._gated.get(method)
        if found is None or found[0] is not handler:
            found = self._gated[method] = (handler, self._gate(handler, method))
        return found[1]

    def _gate(self, handler, method: str):
        kind = (("stream" if handler.request_streaming else "unary") + "_"
                + ("stream" if handler.response_streaming else "unary"))
        behavior = getattr(handler, kind)
        if handler.response_streaming:
            def gated(request, context):
                self._enter(context, method)
                try:
                    yield from behavior(request, context)
                finally:
                    self._leave()
        else:
            def gated(request, context):
                self._enter(context, method)
                try:
                    return behavior(request, context)
                finally:
                    self._leave()
        return handler._replace(**{kind: gated})

    def _enter(self, context, method: str) -> None:
        with self._lock:
            if self._calls >= self._max_calls:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"{method}: {self._max_calls} calls are in progress on this "
                              "device (--max-concurrent-calls); retry later")
            self._calls += 1
        if self._running.acquire(blocking=False):
            return
        while not self._running.acquire(timeout=0.5):
            if not context.is_active():  # the caller gave up while waiting for a turn
                self._leave(running=False)
                context.abort(grpc.StatusCode.CANCELLED, f"{method}: the caller went away")

    def _leave(self, running: bool = True) -> None:
        if running:
            self._running.release()
        with self._lock:
            self._calls -= 1


def raise_fd_limit() -> int:
    """Raises this process's soft limit on open descriptors to its hard limit (at most
    65536), so the connection cap, not the descriptor table, bounds idle connections;
    returns the soft limit now in force."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
    return soft


def _connection_cap(max_connections: int) -> int:
    """`max_connections`, lowered to what the descriptor limit leaves room for."""
    import resource

    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY or soft - FD_RESERVE >= max_connections:
        return int(max_connections)
    cap = max(1, soft - FD_RESERVE)
    log.warning("--max-connections %d lowered to %d: this process may open %d files "
                "(ulimit -n)", max_connections, cap, soft)
    return cap


def start_server(listen: str, servicer: DeviceServicer, max_workers: int = 4, *,
                 token: Optional[str] = None, tls: Optional[security.TlsConfig] = None,
                 allow_remote: bool = False,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 max_concurrent_calls: int = DEFAULT_MAX_CONCURRENT_CALLS,
                 idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S,
                 ) -> tuple[grpc.Server, int]:
    """Starts a gRPC server for `servicer` on `listen`; returns it and the bound port.

    `token`: refuse calls without it (UNAUTHENTICATED, decided from the call's metadata
    before its body is read); `tls`: serve mutual TLS only; `allow_remote`: permit a
    non-loopback `listen` host (logged as a warning). `max_connections` open connections
    at most (more are closed at once; lowered to fit the descriptor limit), connections
    idle for `idle_timeout_s` are closed and a connection must finish its handshake
    within 10 s. Calls other than Health: `max_concurrent_calls` in progress at most
    (more get RESOURCE_EXHAUSTED), `max_workers` of them running at once; Health is
    answered beside them (`CallGate`).
    """
    host, port = parse_address(listen, "--listen", allow_port_zero=True)
    security.check_address(host, allow_remote, tls, "device listen address")
    interceptors = [security.TokenAuthInterceptor(token)] if token else []
    interceptors.append(CallGate(max_workers, max_concurrent_calls))
    options = grpc_options(max_message_bytes) + (
        ("grpc.so_reuseport", 0),
        ("grpc.max_allowed_incoming_connections", _connection_cap(max_connections)),
        ("grpc.max_connection_idle_ms", int(idle_timeout_s * 1000)),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_MS),
    )
    # A thread for every call admitted: calls wait for their turn in CallGate, never for
    # a thread, so Health never queues behind them (threads start only when needed).
    threads = int(max_concurrent_calls) + HEALTH_CALLS
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=threads),
                         interceptors=interceptors, options=options,
                         maximum_concurrent_rpcs=threads)
    pb_grpc.add_DeviceServicer_to_server(servicer, server)
    target = format_address(host, port)
    try:
        if tls is not None:
            bound = server.add_secure_port(target, tls.server_credentials())
        else:
            bound = server.add_insecure_port(target)
    except RuntimeError as e:
        raise FleetError(f"cannot listen on {listen}: {e}; pick another port or use port 0")
    if not bound:
        raise FleetError(f"cannot listen on {listen}; pick another port or use port 0")
    server.start()
    return server, bound


def _watch_parent(parent_pid: int, stop: threading.Event) -> None:
    """Sets `stop` once the launching process is gone (so no device outlives it)."""
    while not stop.wait(0.5):
        if os.getppid() != parent_pid:
            log.warning("parent process %d is gone; shutting down", parent_pid)
            stop.set()


def serve(listen: str = "127.0.0.1:0", device_id: str = "device", max_workers: int = 4,
          parent_pid: Optional[int] = None, *, token: Optional[str] = None,
          tls: Optional[security.TlsConfig] = None, allow_remote: bool = False,
          allow_no_auth: bool = False, limits: Optional[DeviceLimits] = None,
          population: Optional[str] = None, population_name: Optional[str] = None,
          shared_memory: Optional[str] = None,
          client_runtime: Union[str, ClientRuntime] = "xla") -> int:
    """Runs a device until SIGTERM/SIGINT (or the parent's exit); returns an exit code.

    On SIGTERM, waits (Map delays) end at once and long calls stop between clients; the
    process exits within about two seconds.

    Without a `token` the device refuses to start unless `allow_no_auth` is set.
    `limits`: what callers may make it spend (`protocol.DeviceLimits`, default its
    defaults).
    `population`: a directory written by `write_population` whose clients this device
    reads by id (named `population_name`, by default the directory's base name).
    `shared_memory`: the launcher's directory of shared-memory segments (`LocalFleet`
    gives one to the devices it starts); removed on exit when the launcher is gone.
    `client_runtime`: what runs rounds' client parts (`rounds.client_runtime`: "xla",
    "litert" or a runtime object).
    """
    if not token:
        if not allow_no_auth:
            raise FleetError(
                f"no fleet token: set {security.TOKEN_ENV} or pass --token-file (a 0600 "
                "file); --insecure-no-auth serves without one, for debugging only")
        log.warning("serving WITHOUT authentication (--insecure-no-auth): anyone who can "
                    "reach %s may run computations here", listen)
    limits = limits or DeviceLimits()
    _run_xla_inline()
    raise_fd_limit()
    servicer = DeviceServicer(device_id, max_stored_bytes=limits.max_stored_bytes,
                              population=population, population_name=population_name,
                              max_clients=limits.max_clients,
                              max_call_seconds=limits.max_call_seconds,
                              max_delay_seconds=limits.max_delay_seconds,
                              shared_memory=shared_memory, client_runtime=client_runtime)
    server, port = start_server(listen, servicer, max_workers, token=token, tls=tls,
                                allow_remote=allow_remote,
                                max_message_bytes=limits.max_message_bytes,
                                max_connections=limits.max_connections,
                                max_concurrent_calls=limits.max_concurrent_calls,
                                idle_timeout_s=limits.idle_timeout_s)
    host, _ = parse_address(listen, "--listen", allow_port_zero=True)
    stop = threading.Event()

    def on_signal(signum, frame):
        log.warning("received signal %d; shutting down", signum)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    if parent_pid:
        threading.Thread(target=_watch_parent, args=(parent_pid, stop), daemon=True).start()
    print(json.dumps({"listening": format_address(host, port), "port": port, "pid": os.getpid(),
                      "device_id": device_id}), flush=True)
    while not stop.wait(1.0):
        pass
    servicer.stopping.set()
    server.stop(grace=1.0).wait(5.0)
    if servicer.shared_memory is not None and parent_pid and os.getppid() != parent_pid:
        servicer.shared_memory.remove()  # its coordinator cannot any more
    return 0
