"""gRPC plumbing both services share: servers and channels with bounded messages, TLS / mTLS, a bearer token
on the client-facing service, health and reflection, graceful SIGTERM drain, JSON logs and flag helpers.

A service builds `GrpcServer(ServerOptions.from_args(args))`, adds its servicer with `add_service`, calls
`set_serving(True)` once it can answer, and awaits `serve_forever()`; SIGTERM/SIGINT then drain it.
"""

import argparse
import asyncio
import gc
import hmac
import json
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specwire.grpc_handlers import same_kind_handler
from specwire.undecodable import UndecodableGuard
from specwire.v1 import drafter_pb2, generation_pb2

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
DRAFTER_SERVICE = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name
DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DEFAULT_GRACE_SECONDS = 30.0
DEFAULT_SWITCH_INTERVAL = 2e-4  # bench/results/switch_interval_h200x2/: 5 ms (Python's) halved speculation

# Long-lived Draft streams sit idle between bursts: clients ping to notice a dead peer, and servers must
# allow those pings or they answer GOAWAY "too_many_pings" and cut the stream.
_KEEPALIVE_CLIENT = [
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]
_KEEPALIVE_SERVER = [
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

log = logging.getLogger("specwire.grpc")
T = TypeVar("T")


# ---------------------------------------------------------------- flags from the environment


def env_default(name: str, default: T) -> T:
    """Environment variable `name` parsed like `default` (str, int, float or bool); `default` when unset.

    Used as an argparse default so every flag can come from the environment, e.g. in a Kubernetes ConfigMap.
    """
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    if isinstance(default, bool):
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True  # type: ignore[return-value]
        if lowered in ("0", "false", "no", "off"):
            return False  # type: ignore[return-value]
        raise ValueError(f"{name}={raw!r} is not a boolean (use 1/0, true/false, yes/no, on/off)")
    kind = type(default) if default is not None else str
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a valid {kind.__name__}") from None



def add_model_arguments(parser: argparse.ArgumentParser, dtype_of: str) -> None:
    """A service's --model, --device and --dtype (of `dtype_of`), each defaulting to its SPECWIRE_* env."""
    env = env_default
    parser.add_argument("--model", default=env("SPECWIRE_MODEL", None),
                        help="the target model: GGUF file or Hugging Face directory "
                             "(default: SmolLM2-135M-Instruct)")
    parser.add_argument("--device", default=env("SPECWIRE_DEVICE", None),
                        help="cpu or cuda[:N] (default: cuda if available, else cpu; env SPECWIRE_DEVICE)")
    parser.add_argument("--dtype", default=env("SPECWIRE_DTYPE", None), choices=["bf16", "fp16", "fp32"],
                        help=f"{dtype_of} (default: bf16 on CUDA, fp32 on CPU)")


# ---------------------------------------------------------------- logging


_RECORD_FIELDS = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


def _extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a log call passed as `extra=`."""
    return {k: v for k, v in record.__dict__.items() if k not in _RECORD_FIELDS}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then the record's `extra=` fields."""

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        line.update(_extra_fields(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


class TextFormatter(logging.Formatter):
    """One plain line, the record's `extra=` fields (a disconnect's reason, a request id) as key=value after
    the message: without them a text log says that something failed but not why."""

    def __init__(self):
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        extras = " ".join(f"{k}={v!r}" for k, v in _extra_fields(record).items())
        line = super().format(record)
        return f"{line} {extras}" if extras else line


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a record comes (as logging's last-resort handler does): a stderr
    replaced after set-up (a test's capture, closed once the test ends) never leaves a dead stream behind for
    the server's threads to log into."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, _: Any) -> None:
        pass


def setup_logging(level: str = "INFO", fmt: str = "json", stream: Any = None) -> None:
    """Routes all logging to one handler on `stream` (default: the current stderr) in `fmt` "json" or
    "text"."""
    if fmt not in ("json", "text"):
        raise ValueError(f"log format {fmt!r} is not 'json' or 'text'")
    handler = _CurrentStderr() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-level", default=env_default("SPECWIRE_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (env SPECWIRE_LOG_LEVEL)")
    parser.add_argument("--log-format", choices=("json", "text"),
                        default=env_default("SPECWIRE_LOG_FORMAT", "json"),
                        help="one JSON object per line, or plain text (env SPECWIRE_LOG_FORMAT)")


# ---------------------------------------------------------------- event loop


def run(main: Coroutine[Any, Any, T], switch_interval: float | None = None) -> T:
    """Runs `main` on uvloop where it is installed (lower RPC latency), else on asyncio's own loop.

    switch_interval: sys.setswitchinterval. A service's model thread gives up the GIL at every device wait
    and every torch call; while the event loop thread computes, taking it back costs up to one interval
    (Python's default is 5 ms, as long as a whole decode step)."""
    if switch_interval is not None:
        if not 0 < switch_interval <= 0.1:
            main.close()
            raise ValueError(f"--switch-interval must be in (0, 0.1] seconds, got {switch_interval}")
        sys.setswitchinterval(switch_interval)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


# ---------------------------------------------------------------- credentials


def _read(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read TLS file {path}: {e.strerror}") from None


def server_credentials(cert: str, key: str, client_ca: str | None = None) -> grpc.ServerCredentials:
    """TLS with the server's PEM cert chain and key; with `client_ca`, clients need a cert that CA signed."""
    return grpc.ssl_server_credentials([(_read(key), _read(cert))], root_certificates=_read(client_ca),
                                       require_client_auth=client_ca is not None)


def channel_credentials(ca: str | None = None, cert: str | None = None, key: str | None = None
                        ) -> grpc.ChannelCredentials:
    """TLS trusting `ca` (None: the system roots); `cert` + `key` present a client certificate (mTLS)."""
    if (cert is None) != (key is None):
        raise ValueError(f"client TLS needs both a cert and a key, got cert={cert} key={key}")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key),
                                        certificate_chain=_read(cert))


# ---------------------------------------------------------------- bearer token


def auth_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata that carries `token` (empty without one); pass as `metadata=` to each call."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to `protected_services` without the right `authorization: Bearer <token>` metadata.

    Other services (health, reflection, the internal drafter behind mTLS) stay open.
    """

    def __init__(self, token: str, protected_services: set[str]):
        if not token:
            raise ValueError("bearer token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self._protected = protected_services

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        service = details.method.rsplit("/", 2)[-2] if details.method else ""
        if handler is None or service not in self._protected:
            return handler
        sent = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        if sent is None:
            return _refusing(handler, "missing bearer token: send metadata 'authorization: Bearer <token>'")
        if not hmac.compare_digest(sent.encode() if isinstance(sent, str) else sent, self._expected):
            return _refusing(handler, "wrong bearer token")
        return handler


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that ends every call with UNAUTHENTICATED."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    return same_kind_handler(handler, refuse)


# ---------------------------------------------------------------- server


@dataclass(frozen=True)
class ServerOptions:
    """How a service listens; every field has a flag in `add_server_arguments`."""

    listen: str = "127.0.0.1:0"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None  # set: mutual TLS, clients need a cert this CA signed
    token: str | None = None  # set: the services added with require_token need it
    grace_seconds: float = DEFAULT_GRACE_SECONDS
    health_listen: str | None = None  # a plaintext health-only port for kubelet probes (they cannot do TLS)

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"TLS needs --tls-cert and --tls-key, got {self.tls_cert} and {self.tls_key}")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.max_message_bytes <= 0:
            raise ValueError(f"max message size must be positive, got {self.max_message_bytes}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ServerOptions":
        return cls(listen=args.listen, max_message_bytes=int(args.max_message_mb * 1024 * 1024),
                   tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                   token=args.token, grace_seconds=args.grace_seconds, health_listen=args.health_listen)


def add_server_arguments(parser: argparse.ArgumentParser, default_listen: str) -> None:
    """The flags of `ServerOptions`, each defaulting to its SPECWIRE_* environment variable."""
    env = env_default
    parser.add_argument("--listen", default=env("SPECWIRE_LISTEN", default_listen),
                        help="HOST:PORT to serve on (env SPECWIRE_LISTEN)")
    parser.add_argument("--health-listen", default=env("SPECWIRE_HEALTH_LISTEN", None),
                        help="HOST:PORT, plaintext, grpc.health.v1 only (env SPECWIRE_HEALTH_LISTEN)")
    parser.add_argument("--tls-cert", default=env("SPECWIRE_TLS_CERT", None), help="server PEM cert chain")
    parser.add_argument("--tls-key", default=env("SPECWIRE_TLS_KEY", None), help="server PEM private key")
    parser.add_argument("--tls-client-ca", default=env("SPECWIRE_TLS_CLIENT_CA", None),
                        help="PEM CA bundle: require client certificates it signed (mutual TLS)")
    parser.add_argument("--token", default=env("SPECWIRE_TOKEN", None),
                        help="bearer token the client-facing service requires (env SPECWIRE_TOKEN)")
    parser.add_argument("--max-message-mb", type=float, default=env("SPECWIRE_MAX_MESSAGE_MB", 64.0),
                        help="largest gRPC message sent or received, MiB (env SPECWIRE_MAX_MESSAGE_MB)")
    parser.add_argument("--grace-seconds", type=float,
                        default=env("SPECWIRE_GRACE_SECONDS", DEFAULT_GRACE_SECONDS),
                        help="on SIGTERM, how long in-flight calls may finish (env SPECWIRE_GRACE_SECONDS)")
    parser.add_argument("--switch-interval", type=float,
                        default=env("SPECWIRE_SWITCH_INTERVAL", DEFAULT_SWITCH_INTERVAL),
                        help="seconds a Python thread may hold the GIL while another waits for it: the "
                             "model thread waits at most this long to run again after a device wait "
                             "(env SPECWIRE_SWITCH_INTERVAL)")


def _message_size_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes)]


class GrpcServer:
    """A grpc.aio server with health (NOT_SERVING until `set_serving`), reflection, optional TLS / mTLS and
    bearer token, and a drain that stops taking calls and lets in-flight ones finish within the grace period.
    """

    def __init__(self, options: ServerOptions):
        self.options = options
        self._protected: set[str] = set()
        # The token check runs first: an unauthenticated caller learns nothing, not even about parsing.
        self.undecodable = UndecodableGuard()
        interceptors = [BearerTokenInterceptor(options.token, self._protected)] if options.token else []
        interceptors.append(self.undecodable)
        server_options = _message_size_options(options.max_message_bytes) + _KEEPALIVE_SERVER
        self._server = grpc.aio.server(interceptors=interceptors, options=server_options)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        self._health_server: grpc.aio.Server | None = None
        self._services = [""]  # "" is the whole server's health entry
        # Set when draining starts: long-lived handlers (the Draft stream) watch it to end early.
        self.draining = asyncio.Event()
        self.port: int | None = None
        self.health_port: int | None = None

    def add_service(self, name: str, add_to_server: Callable[[Any, grpc.aio.Server], None], servicer: Any,
                    *, require_token: bool = False) -> None:
        """Registers `servicer` (e.g. `add_GenerationServicer_to_server`) under its full service `name`."""
        add_to_server(servicer, self._server)
        self._services.append(name)
        if require_token:
            self._protected.add(name)

    async def start(self) -> int:
        """Binds the ports and starts serving (health NOT_SERVING); returns the bound main port."""
        names = [*self._services[1:], health.SERVICE_NAME, reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self._server)
        o = self.options
        if o.tls_cert is not None:
            creds = server_credentials(o.tls_cert, o.tls_key, o.tls_client_ca)
            self.port = self._server.add_secure_port(o.listen, creds)
        else:
            self.port = self._server.add_insecure_port(o.listen)
        if o.health_listen is not None:
            self._health_server = grpc.aio.server()
            health_pb2_grpc.add_HealthServicer_to_server(self._health, self._health_server)
            self.health_port = self._health_server.add_insecure_port(o.health_listen)
            await self._health_server.start()
        for name in self._services:
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        log.info("listening", extra={"listen": o.listen, "port": self.port, "tls": o.tls_cert is not None,
                                     "mtls": o.tls_client_ca is not None, "token": o.token is not None,
                                     "health_port": self.health_port, "services": self._services[1:]})
        return self.port

    async def set_serving(self, serving: bool) -> None:
        """Marks every service SERVING (ready for traffic) or NOT_SERVING; ignored once draining."""
        response = health_pb2.HealthCheckResponse
        status = response.SERVING if serving else response.NOT_SERVING
        for name in self._services:
            await self._health.set(name, status)

    async def drain(self, grace_seconds: float | None = None) -> None:
        """NOT_SERVING, refuse new calls, give in-flight calls `grace_seconds` to finish, then cancel them."""
        if self.draining.is_set():
            return
        grace = self.options.grace_seconds if grace_seconds is None else grace_seconds
        log.info("draining", extra={"grace_seconds": grace})
        self.draining.set()
        await self._health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._health_server is not None:
            await self._health_server.stop(None)
        log.info("stopped")

    async def serve_forever(self, on_ready: Callable[[], Awaitable[None]] | None = None) -> None:
        """Starts (unless started), drains on SIGTERM/SIGINT, and returns once the server has stopped.

        `on_ready` runs after the ports are bound, e.g. to load the model and then `set_serving(True)`. What
        the start-up left (modules, the model, compiled kernels: about 300,000 objects the cyclic collector
        tracks) is then frozen out of the collector's reach: each full collection walked them all, 145 ms on
        the 2-core CPU, and every stream of the process stalled meanwhile.
        """
        if self.port is None:
            await self.start()
        loop = asyncio.get_running_loop()
        drains: list[asyncio.Task] = []  # held so the drain task is not garbage-collected mid-way
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: drains.append(loop.create_task(self._on_signal(s))))
        try:
            if on_ready is not None:
                await on_ready()
            gc.collect()
            gc.freeze()
            log.info("start-up objects frozen out of the garbage collector",
                     extra={"objects": gc.get_freeze_count()})
            await self._server.wait_for_termination()
            for task in drains:
                await task
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)

    async def _on_signal(self, sig: signal.Signals) -> None:
        log.info("signal", extra={"signal": signal.Signals(sig).name})
        await self.drain()


# ---------------------------------------------------------------- channels


@dataclass(frozen=True)
class ChannelOptions:
    """How to reach a server; `add_channel_arguments` has a flag for each field."""

    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_server_name: str | None = None  # the name to check the server's cert against, if not the address's
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES

    @property
    def tls(self) -> bool:
        return self.tls_ca is not None or self.tls_cert is not None

    @classmethod
    def from_args(cls, args: argparse.Namespace, prefix: str = "") -> "ChannelOptions":
        attr = prefix.replace("-", "_")
        return cls(tls_ca=getattr(args, f"{attr}tls_ca"), tls_cert=getattr(args, f"{attr}tls_cert"),
                   tls_key=getattr(args, f"{attr}tls_key"),
                   tls_server_name=getattr(args, f"{attr}tls_server_name"))


def add_channel_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """--{prefix}tls-ca / -cert / -key / -server-name, defaulting to SPECWIRE_{PREFIX}TLS_* variables.

    The verifier uses prefix "drafter-" for its channel to the drafter; `specwire client` uses none.
    """
    env = "SPECWIRE_" + prefix.upper().replace("-", "_")
    parser.add_argument(f"--{prefix}tls-ca", default=env_default(f"{env}TLS_CA", None),
                        help=f"PEM CA bundle to trust: connect with TLS (env {env}TLS_CA)")
    parser.add_argument(f"--{prefix}tls-cert", default=env_default(f"{env}TLS_CERT", None),
                        help=f"client PEM certificate for mutual TLS (env {env}TLS_CERT)")
    parser.add_argument(f"--{prefix}tls-key", default=env_default(f"{env}TLS_KEY", None),
                        help=f"client PEM private key for mutual TLS (env {env}TLS_KEY)")
    parser.add_argument(f"--{prefix}tls-server-name", default=env_default(f"{env}TLS_SERVER_NAME", None),
                        help="host name the server certificate must carry, when it differs from the address")


def create_channel(target: str, options: ChannelOptions = ChannelOptions()) -> grpc.aio.Channel:
    """A grpc.aio channel to `target` (HOST:PORT) with bounded messages, keepalive and optional (m)TLS."""
    channel_options = _message_size_options(options.max_message_bytes) + _KEEPALIVE_CLIENT
    if options.tls_server_name is not None:
        channel_options.append(("grpc.ssl_target_name_override", options.tls_server_name))
    if not options.tls:
        return grpc.aio.insecure_channel(target, options=channel_options)
    creds = channel_credentials(options.tls_ca, options.tls_cert, options.tls_key)
    return grpc.aio.secure_channel(target, creds, options=channel_options)

