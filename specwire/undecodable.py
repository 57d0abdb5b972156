"""Undecodable request messages end the call with INVALID_ARGUMENT and one rate-limited warning line.

Left alone, grpc.aio answers a message it cannot parse with UNKNOWN and logs a full traceback at ERROR for
every one, so a misbehaving client floods the logs. `UndecodableGuard` is a server interceptor that wraps
each method's request deserializer and behaviour: nothing is lost (the call fails cleanly, the servicer and
its state never see the bytes), and the log says once per interval how many such messages arrived.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from specwire.grpc_handlers import behavior_of, same_kind_handler

log = logging.getLogger("specwire.grpc")


class UndecodableMessage(Exception):
    """Raised by a wrapped streaming deserializer; deliberately not a ValueError, which handlers may catch."""


class _Undecodable:
    """Stands in for a unary request that did not parse (the deserializer runs before the handler)."""

    def __init__(self, error: str):
        self.error = error


class RateLimitedWarning:
    """Logs at most one WARNING line per `interval` seconds; the next line counts what was held back."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0):
        self.logger, self.interval = logger, interval
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._suppressed = 0

    def __call__(self, message: str, **extra: Any) -> bool:
        """Logs `message` unless one was logged less than `interval` ago; True when it was logged."""
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval:
                self._suppressed += 1
                return False
            suppressed, self._suppressed, self._last = self._suppressed, 0, now
        self.logger.warning(message, extra={**extra, "suppressed_since_last": suppressed})
        return True


class UndecodableGuard(grpc.aio.ServerInterceptor):
    """Answers requests that fail to parse with INVALID_ARGUMENT and a rate-limited one-line warning."""

    def __init__(self, warn: RateLimitedWarning | None = None):
        self.warn = warn or RateLimitedWarning(log)
        self.count = 0  # undecodable messages seen (tests and debugging)

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]],
                                details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return self._guarded(handler, details.method)

    async def _refuse(self, context: grpc.aio.ServicerContext, method: str, error: str) -> None:
        self.count += 1
        self.warn("undecodable request message", method=method, error=error, peer=context.peer())
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"undecodable request message for {method}")

    def _guarded(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        parse = handler.request_deserializer
        streaming_request = handler.request_streaming

        def deserialize(raw: bytes) -> Any:
            try:
                return parse(raw)
            except DecodeError as e:
                if streaming_request:  # read inside the handler: surfaces there, caught by the wrapper below
                    raise UndecodableMessage(str(e)) from None
                return _Undecodable(str(e))

        behavior = behavior_of(handler)
        if inspect.isasyncgenfunction(behavior):
            async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await self._refuse(context, method, request.error)
                try:
                    async for response in behavior(request, context):
                        yield response
                except UndecodableMessage as e:
                    await self._refuse(context, method, str(e))
        else:
            async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    await self._refuse(context, method, request.error)
                try:
                    return await behavior(request, context)
                except UndecodableMessage as e:
                    await self._refuse(context, method, str(e))

        return same_kind_handler(handler, guarded, deserialize)
