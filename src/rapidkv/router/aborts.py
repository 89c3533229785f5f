"""Telling P over the control plane that a client went away: fire and forget.

When a client disconnects, the router closes both upstream HTTP requests (vLLM
aborts a request whose connection closes) and, when P's control address is
known, sends P's connector ``Abort(xfer_id, reason=client_abort)`` so P stops
any transfer for it at once instead of waiting for a TransferKV that will not
come.

Rules: `abort` never blocks and never raises; the outcome is logged (debug on
an answer, warning on a failure) and counted. A P without a connector, or one
that cannot be reached, costs one failed RPC and nothing else. The `RpcClient`
(and its thread) is created on the first Abort, so a router that never sends
one never starts it.
"""

from __future__ import annotations

import concurrent.futures
import logging

from rapidkv.control.messages import Abort, AbortReason, Reply
from rapidkv.router.metrics import RouterMetrics
from rapidkv.router.rpc import LazyRpc

log = logging.getLogger(__name__)


class ControlAborter:
    """Sends Abort notices to prefill instances' control addresses."""

    def __init__(self, secret: bytes | None, timeout_s: float, metrics: RouterMetrics) -> None:
        self._rpc = LazyRpc(secret)
        self._timeout_s = timeout_s
        self._metrics = metrics

    def abort(
        self, address: str, xfer_id: str, reason: AbortReason = AbortReason.CLIENT_ABORT
    ) -> None:
        """Send ``Abort(xfer_id, reason)`` to `address`; returns at once."""
        try:
            client = self._rpc.get()
            if client is None:
                raise RuntimeError("router shutting down")
            request = Abort(xfer_id=xfer_id, reason=reason)
            future = client.submit(address, request, self._timeout_s)
        except Exception as e:
            self._failed(address, xfer_id, e)
            return
        future.add_done_callback(lambda f: self._settled(address, xfer_id, f))

    def _settled(
        self, address: str, xfer_id: str, future: concurrent.futures.Future[Reply]
    ) -> None:
        try:
            reply = future.result()
        except BaseException as e:  # RpcError, TimeoutError, ConnectionError, cancelled
            self._failed(address, xfer_id, e)
            return
        self._metrics.control_aborts.labels("ok").inc()
        log.debug("xfer %s: control abort to %s answered %r", xfer_id, address, reply)

    def _failed(self, address: str, xfer_id: str, error: BaseException) -> None:
        self._metrics.control_aborts.labels("failed").inc()
        log.warning("xfer %s: control abort to %s failed: %s", xfer_id, address, error)

    def close(self) -> None:
        """Stop the RPC client (pending Aborts fail). Blocks up to a few seconds."""
        self._rpc.close()
