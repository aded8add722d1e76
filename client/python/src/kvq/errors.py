"""The one exception type of the kvq client.

Every error the client raises is a KvqError: an RPC that failed (the server's status code and
message), an item of a batched call that failed (when the call was made with check=True), or
a bad argument found before anything was sent (code INVALID_ARGUMENT, message naming the field).
"""

from __future__ import annotations

import grpc

__all__ = ["KvqError"]


class KvqError(Exception):
    """A failed kvq call.

    Attributes:
        code: the grpc.StatusCode (INVALID_ARGUMENT for errors found client-side).
        details: the server's message (or the client's, for client-side checks).
        method: the RPC's name, e.g. "Attend".
    """

    def __init__(self, method: str, code: grpc.StatusCode, details: str) -> None:
        self.method = method
        self.code = code
        self.details = details
        super().__init__(f"{method}: {code.name}: {details}")

    @classmethod
    def from_rpc_error(cls, method: str, err: grpc.RpcError, server: str = "") -> KvqError:
        """Wraps a grpc.RpcError (a grpc.Call) with the server's code and message."""
        code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
        details = err.details() if hasattr(err, "details") else str(err)
        if code is None:
            code = grpc.StatusCode.UNKNOWN
        details = details or ""
        if server:
            details = f"{details} [server {server}]"
        return cls(method, code, details)

    @classmethod
    def invalid(cls, method: str, details: str) -> KvqError:
        """A client-side argument error (raised before anything is sent)."""
        return cls(method, grpc.StatusCode.INVALID_ARGUMENT, details)


_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def code_from_int(code: int) -> grpc.StatusCode:
    """grpc.StatusCode for a numeric code (as in ItemStatus.code); UNKNOWN for others."""
    return _BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN)
