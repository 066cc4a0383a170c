"""Timing of every tier-manager RPC, taken in one place: a gRPC server interceptor.

Each unary call's duration goes into `tierstack_rpc_duration_seconds{method}` and each
failed one into `tierstack_rpc_failures_total{method,code}`; calls being served are
counted as a queue depth. A SetAccessOrder that succeeds installs a new plan (the layer
order prefetch and eviction follow), so the interceptor also keeps the plan's version.
Streaming calls (WatchStats) last as long as their watcher and are not timed.
"""

from __future__ import annotations

import threading
import time

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram

from tierstack.metric_catalog import RPC_DURATION, RPC_FAILURES

PLAN_METHOD = "SetAccessOrder"


class RpcMetrics(grpc.ServerInterceptor):
    """Wraps the server's unary handlers with a timer."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.duration = Histogram(RPC_DURATION.name, RPC_DURATION.help, RPC_DURATION.labels,
                                  buckets=RPC_DURATION.buckets, registry=registry)
        self.failures = Counter(RPC_FAILURES.name, RPC_FAILURES.help, RPC_FAILURES.labels,
                                registry=registry)
        self._lock = threading.Lock()
        self.in_flight = 0
        self.plan_version = 0
        self.plan_keys = 0
        self.plan_updated_at: float | None = None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        method = handler_call_details.method.rpartition("/")[2]
        observe = self.duration.labels(method).observe  # bound once per call, not per sample
        inner = handler.unary_unary

        def timed(request, context):
            with self._lock:
                self.in_flight += 1
            start = time.perf_counter()
            code = grpc.StatusCode.UNKNOWN
            try:
                response = inner(request, context)
                code = context.code() or grpc.StatusCode.OK
                return response
            except BaseException:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise
            finally:
                observe(time.perf_counter() - start)
                with self._lock:
                    self.in_flight -= 1
                    if code == grpc.StatusCode.OK and method == PLAN_METHOD:
                        self.plan_version += 1
                        self.plan_keys = len(request.keys)
                        self.plan_updated_at = time.time()
                if code != grpc.StatusCode.OK:
                    self.failures.labels(method, code.name).inc()

        return grpc.unary_unary_rpc_method_handler(
            timed, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
