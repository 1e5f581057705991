"""The one error a request handler raises: a line for the user and its kind (protocol's codes)."""
from __future__ import annotations

from .. import protocol


class ApiError(Exception):
    def __init__(self, message: str, code: str = protocol.INVALID):
        super().__init__(message)
        self.code = code
