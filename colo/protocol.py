"""The wire format shared by client and daemon: one JSON object per line over a Unix socket.

Request:  {"v": 1, "op": "submit", "args": {...}}
Reply:    {"v": 1, "ok": true, "result": ...}  or  {"v": 1, "ok": false, "error": "one line", "code": "..."}
Streams (logs --follow, wait, watch) send {"v": 1, "event": ...} lines before the final reply.
The caller's identity is never in the message: the daemon reads it from SO_PEERCRED.
"""
from __future__ import annotations

import json
from typing import Any

VERSION = 1
MAX_LINE = 1 << 20  # a request larger than this is refused, not buffered

OPS = frozenset({
    "hello", "submit", "ls", "show", "logs", "wait", "cancel", "gpus", "explain", "top",
    "history", "shutdown", "slurm",
    "profiles", "profile", "profile_share",  # what the daemon places jobs with (issue 11 item 5)
})

# error codes (stable, for scripts)
BAD_REQUEST = "bad_request"
NOT_FOUND = "not_found"
FORBIDDEN = "forbidden"
INVALID = "invalid"
VERSION_MISMATCH = "version"
INTERNAL = "internal"
UNAVAILABLE = "unavailable"  # the daemon cannot do it now (e.g. its state disk is full); try again later


class ProtocolError(ValueError):
    def __init__(self, message: str, code: str = BAD_REQUEST):
        super().__init__(message)
        self.code = code


def encode(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()


def request(op: str, **args: Any) -> bytes:
    return encode({"v": VERSION, "op": op, "args": args})


class Raw(bytes):
    """A result already encoded as JSON (the daemon's cached rows), spliced in as it is."""


def ok(result: Any = None) -> bytes:
    if isinstance(result, Raw):
        return b'{"v":%d,"ok":true,"result":%s}\n' % (VERSION, result)
    return encode({"v": VERSION, "ok": True, "result": result})


def error(message: str, code: str = INVALID) -> bytes:
    return encode({"v": VERSION, "ok": False, "error": message, "code": code})


def event(data: Any) -> bytes:
    return encode({"v": VERSION, "event": data})


def parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed JSON: {e}") from e
    except RecursionError:
        raise ProtocolError("malformed JSON: nested too deeply") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a request must be a JSON object")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {msg.get('v')!r} not spoken here (daemon speaks {VERSION}); "
                            "use the colo of the same version as the daemon", VERSION_MISMATCH)
    op, args = msg.get("op"), msg.get("args", {})
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown op {op!r}")
    if not isinstance(args, dict):
        raise ProtocolError("args must be a JSON object")
    return op, args
