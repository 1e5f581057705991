"""The wire format shared by client and daemon: one JSON object per line over a Unix socket.

Request:  {"v": 1, "op": "submit", "args": {...}}
Reply:    {"v": 1, "ok": true, "result": ...}  or  {"v": 1, "ok": false, "error": "one line", "code": "..."}
Streams (logs --follow, wait, watch) send {"v": 1, "event": ...} lines before the final reply.
The caller's identity is never in the message: the daemon reads it from SO_PEERCRED.
"""
from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is not imported at run time: `colo submit` loads this module (colo/cli/submitspec.py)
    from typing import Any

VERSION = 1
MAX_LINE = 1 << 20  # a request larger than this is refused, not buffered

OPS = frozenset({
    "hello", "submit", "ls", "show", "logs", "wait", "cancel", "gpus", "explain", "top",
    "history", "report", "shutdown", "slurm",
    "profiles", "profile", "profile_share",  # what the daemon places jobs with (issue 11 item 5)
    "profile_put",  # a profile the caller recorded becomes their own (issue 13)
    "hold", "release", "edit", "requeue",  # a queued job held back or changed; an ended one again (issue 16)
    "clean",  # ended jobs removed (pueue's clean)
    "session",  # a job on a terminal colo made for it, attached (colo shell, colo run; issue 32)
    "attach",  # a detached session's terminal taken over by its owner (colo attach; issue 43)
    "signal",  # a signal to a running job's main process (a notebook kernel's interrupt)
    "pause", "resume",  # a running job frozen and thawed (issue 36)
    "suspend",  # a running job's GPU memory moved to host memory (issue 40; `resume` brings it back)
    "drain", "undrain",  # a GPU taken out of service by an admin, and put back (issue 42)
    "admin_log",  # what admins (and colo's fault drains) did: colo history --admin (issue 42)
})
# An event that carries a file descriptor (a session's terminal), or three (the pipes of a host
# session without one): sent with SCM_RIGHTS on its line's first byte. The daemon's streams name it with this key; the JSON sent says {"tty": true}.
PASS_FD = "_fd"
SIGNALS = (1, 2, 3, 10, 12, 15)  # HUP INT QUIT USR1 USR2 TERM: what a job's shim passes on to it
SIGNAL_NAMES = {"HUP": 1, "INT": 2, "QUIT": 3, "USR1": 10, "USR2": 12, "TERM": 15}  # (Linux's numbers)


def signal_number(sig: int | str) -> int:
    """2, "2", "INT" or "SIGINT" as the number op `signal` takes; ValueError for another."""
    if isinstance(sig, int):
        return sig
    s = sig.strip().upper()
    if s.isascii() and s.isdigit():
        return int(s)
    n = SIGNAL_NAMES.get(s.removeprefix("SIG"))
    if n is None:
        raise ValueError(f"colo sends a job HUP, INT, QUIT, USR1, USR2 or TERM (what its shim passes on), not {sig!r}")
    return n

# error codes (stable, for scripts)
BAD_REQUEST = "bad_request"
NOT_FOUND = "not_found"
FORBIDDEN = "forbidden"
INVALID = "invalid"
VERSION_MISMATCH = "version"
INTERNAL = "internal"
UNAVAILABLE = "unavailable"  # the daemon cannot do it now (e.g. its state disk is full); try again later


MAX_ID = (1 << 63) - 1  # SQLite's INTEGER
MAX_WAIT_IDS = 1000  # jobs one `wait` may name
MAX_UNCHECKED_ARGS = 32  # an op without a table below: at most this many arguments


class ProtocolError(ValueError):
    def __init__(self, message: str, code: str = BAD_REQUEST):
        super().__init__(message)
        self.code = code


def encode(obj: dict[str, Any]) -> bytes:
    import json

    return (json.dumps(obj, separators=(",", ":"), default=str) + "\n").encode()


def request(op: str, **args: Any) -> bytes:
    return (dumps({"v": VERSION, "op": op, "args": args}) + "\n").encode()


# The client's codec: the C encoder and scanner the json package itself uses, called directly, so
# that a client (the `colo submit` short path) does without json's Python layer and the `re` it
# imports (about a third of a bare interpreter's start-up on a loaded machine). The same JSON as
# json.dumps(obj, separators=(",", ":"), default=str) and json.loads; json itself where _json
# is missing or differs.
_codec: tuple | None = None


def _fast() -> tuple:
    global _codec
    if _codec is None:
        try:
            from _json import encode_basestring_ascii, make_encoder, make_scanner

            class _Ctx:  # what json.decoder.JSONDecoder hands the scanner
                strict, object_hook, object_pairs_hook = True, None, None
                parse_float, parse_int = float, int
                parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__
                memo: dict = {}

            enc = make_encoder(None, str, encode_basestring_ascii, None, ":", ",", False, False, True)
            _codec = (lambda o: "".join(enc(o, 0)), make_scanner(_Ctx()), None)
        except (ImportError, TypeError):
            import json

            _codec = (lambda o: json.dumps(o, separators=(",", ":"), default=str), None, json.loads)
    return _codec


def dumps(obj: Any) -> str:
    """Compact JSON (json.dumps(obj, separators=(",", ":"), default=str))."""
    return _fast()[0](obj)


def loads(data: bytes | str) -> Any:
    """json.loads for one message; ValueError when it is not one JSON value."""
    _, scan, slow = _fast()
    if slow is not None:
        return slow(data)
    text = (data.decode() if isinstance(data, (bytes, bytearray)) else data).strip()
    try:
        obj, end = scan(text, 0)
    except StopIteration:
        raise ValueError("malformed JSON: no value") from None
    if end != len(text):
        raise ValueError("malformed JSON: more after the value")
    return obj


class Raw(bytes):
    """A result already encoded as JSON (the daemon's cached rows), spliced in as it is."""


# A success reply is OK_HEAD, the result's JSON, OK_END (the daemon writes a long listing's result
# between them a slice at a time: colo/daemon/slices.py)
OK_HEAD = b'{"v":%d,"ok":true,"result":' % VERSION
OK_END = b"}\n"


def ok(result: Any = None) -> bytes:
    if isinstance(result, Raw):
        return OK_HEAD + result + OK_END
    return encode({"v": VERSION, "ok": True, "result": result})


def error(message: str, code: str = INVALID) -> bytes:
    return encode({"v": VERSION, "ok": False, "error": message, "code": code})


def event(data: Any) -> bytes:
    return encode({"v": VERSION, "event": data})


def parse_request(line: bytes) -> tuple[str, dict[str, Any]]:
    import json

    try:
        msg = json.loads(line)
    except (ValueError, UnicodeDecodeError) as e:
        raise ProtocolError(f"malformed JSON: {e}") from e
    except RecursionError:
        raise ProtocolError("malformed JSON: nested too deeply") from None
    if not isinstance(msg, dict):
        raise ProtocolError("a request must be a JSON object")
    if msg.get("v") != VERSION:
        raise ProtocolError(f"protocol version {short(msg.get('v'))} not spoken here (daemon speaks {VERSION}); "
                            "use the colo of the same version as the daemon", VERSION_MISMATCH)
    op, args = msg.get("op"), msg.get("args", {})
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown op {short(op)}")
    if not isinstance(args, dict):
        raise ProtocolError("args must be a JSON object")
    check_args(op, args)
    return op, args


def short(v: Any, n: int = 40) -> str:
    """A value as an error message may quote it: one line, at most n characters."""
    text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."


def _job_id(v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 < v <= MAX_ID:
        raise ProtocolError(f"malformed job id {short(v)}")


def _flag(name: str):
    def check(v: Any) -> None:
        if not isinstance(v, bool):
            raise ProtocolError(f"{name} must be true or false, not {short(v)}")
    return check


def _count(name: str):
    def check(v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= MAX_ID:
            raise ProtocolError(f"{name} must be a whole number from 0, not {short(v)}")
    return check


def _ids(v: Any) -> None:
    if not isinstance(v, list) or not v:
        raise ProtocolError("wait needs job ids")
    if len(v) > MAX_WAIT_IDS:
        raise ProtocolError(f"wait takes at most {MAX_WAIT_IDS} job ids, not {len(v)}")
    for i in v:
        _job_id(i)


def _user(v: Any) -> None:
    if isinstance(v, str) and 0 < len(v) <= 64:
        return
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 1 << 32:
        raise ProtocolError(f"malformed user {short(v)}")


def _name(v: Any) -> None:
    if not isinstance(v, str) or not 0 < len(v) <= 64:
        raise ProtocolError(f"malformed profile name {short(v)}")


def _profile_text(v: Any) -> None:
    if not isinstance(v, str) or not 0 < len(v) <= 256 * 1024:
        raise ProtocolError("profile_put takes the profile's text, up to 256 KiB")
    # its content: colo/profiles.py check_upload, in the daemon


def _time(name: str):
    def check(v: Any) -> None:
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < 1e11:
            raise ProtocolError(f"{name} must be seconds since the epoch, not {short(v)}")
    return check


# What `ls` may ask for by field (its compact reply, see Api.ls); "argv" is the command as one line,
# "array" a task's ARRAY_INDEX (12_3).
LS_FIELDS = frozenset({"id", "name", "user", "state", "gpus", "mode", "budget", "submitted_at", "started_at",
                       "ended_at", "exit_code", "priority", "reason", "argv", "array"})
LS_STATES = ("queued", "starting", "running", "succeeded", "failed", "cancelled", "lost")
ENDED_STATES = ("succeeded", "failed", "cancelled", "lost")
MAX_LS_FILTER = 256  # values in one ls filter
MAX_CLEAN_REFS = 1000  # jobs one `clean` may name (an array's id names all its tasks)


def _texts(name: str, allowed: frozenset | tuple | None = None, most: int = MAX_LS_FILTER):
    def check(v: Any) -> None:
        if not isinstance(v, list) or len(v) > most:
            raise ProtocolError(f"{name} must be a list of at most {most} names")
        for x in v:
            if not isinstance(x, str) or not 0 < len(x) <= 64:
                raise ProtocolError(f"{name} must be text of 1-64 characters, not {short(x)}")
            if allowed is not None and x not in allowed:
                raise ProtocolError(f"unknown {name} {short(x)}: one of {', '.join(sorted(allowed))}")
    return check


def _changes(v: Any) -> None:
    if not isinstance(v, dict) or not v or len(v) > 3:
        raise ProtocolError("edit takes changes: gpu_mem, priority, name")
    # their values: colo/daemon/validate.py, as for a submit


def _signal(v: Any) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v not in SIGNALS:
        raise ProtocolError(f"signal must be one of {', '.join(map(str, SIGNALS))} (HUP INT QUIT USR1 USR2 TERM), "
                            f"not {short(v)}", INVALID)


MAX_DRAIN_REASON = 200


def _reason(v: Any) -> None:
    if not isinstance(v, str) or not v.strip() or len(v) > MAX_DRAIN_REASON:
        raise ProtocolError(f"drain --reason must be text of 1-{MAX_DRAIN_REASON} characters, not {short(v)}")


def _spec(v: Any) -> None:
    if not isinstance(v, dict):
        raise ProtocolError("spec must be an object", INVALID)
    # its fields: colo/daemon/validate.py, which knows what a job may ask for


# The `slurm` op: colo's SPANK plugin (native/slurm/colo_spank.c) and its helper (colo/cli/slurm.py),
# as root. The batch script's end and the job's end the plugin sends itself, one line each in the
# text below (its C format strings are these; tests/test_slurm_wire.py holds them equal), so a job
# costs one Python start (its first step's attach), not three; the helper sends the same lines
# where the plugin cannot. `status`: the batch script's wait status (SPANK's task_exit), from which
# the daemon takes the job's exit (slurmjob.status_exit); without it, from Slurm's record.
SLURM_ATTACH, SLURM_HOLD, SLURM_BATCH_EXIT, SLURM_END = "attach", "hold", "batch_exit", "end"
SLURM_WIRE = {SLURM_BATCH_EXIT: ("job", "status"), SLURM_END: ("job",)}  # what the plugin sends, in order
SLURM_ARGS = frozenset({"action", "job", "uid", "gid", "ref", "node", "gpu_mem", "gpu_index", "profile",
                        "known_only", "comment", "status", "exit_code", "signal"})


def slurm_request(action: str, **fields: int) -> bytes:
    """The line the plugin sends for `action` (SLURM_WIRE's fields, in its order)."""
    if set(fields) != set(SLURM_WIRE[action]):
        raise ValueError(f"{action} takes {', '.join(SLURM_WIRE[action])}")
    return request("slurm", action=action, **{k: fields[k] for k in SLURM_WIRE[action]})


def _slurm_action(v: Any) -> None:
    if v not in (SLURM_ATTACH, SLURM_HOLD, SLURM_BATCH_EXIT, SLURM_END):
        raise ProtocolError(f"unknown slurm action {short(v)}", INVALID)


def _checked_by_handler(v: Any) -> None:
    """Its value: colo/daemon/external.py, which knows what each action takes."""


# Every argument of every op, with its check (None is "not given" for each); anything else is refused.
ARGS: dict[str, dict[str, Any]] = {
    "hello": {"detail": _flag("detail")}, "gpus": {}, "top": {}, "shutdown": {},
    "history": {"since": _time("history --since"), "users": _texts("history user"),
                "limit": _count("history --limit"), "full": _flag("full")},
    "admin_log": {"since": _time("history --since"), "limit": _count("history --limit")},
    "report": {"since": _time("report --since"), "users": _texts("report user")},
    "submit": {"spec": _spec},
    "ls": {"all": _flag("all"), "limit": _count("ls --limit"), "users": _texts("ls user"),
           "states": _texts("ls state", LS_STATES), "names": _texts("ls name"), "refs": _texts("ls job"),
           "fields": _texts("ls field", LS_FIELDS), "cut": _count("ls cut"), "head": _count("ls head"),
           "tasks": _flag("ls tasks")},  # false: an array's queued tasks in one row (Api._live_rows)
    "show": {"id": _job_id}, "explain": {"id": _job_id}, "cancel": {"id": _job_id},
    "logs": {"id": _job_id, "follow": _flag("follow"), "tail": _count("logs --tail"), "since": _time("logs --since"),
             "timestamps": _flag("timestamps")},
    "hold": {"id": _job_id}, "release": {"id": _job_id}, "requeue": {"id": _job_id},
    "pause": {"id": _job_id}, "resume": {"id": _job_id}, "suspend": {"id": _job_id},
    "edit": {"id": _job_id, "changes": _changes},
    "wait": {"ids": _ids},
    "session": {"spec": _spec}, "attach": {"id": _job_id},
    "signal": {"id": _job_id, "signal": _signal},
    "profiles": {"user": _user}, "profile": {"name": _name, "user": _user},
    "profile_share": {"name": _name, "user": _user},
    "profile_put": {"text": _profile_text},  # no user: a user writes only their own
    # refs as ls reads them (ids, an array's id, names, ARRAY_INDEX); without refs, the filters pick
    "drain": {"gpus": _texts("drain GPU", most=64), "reason": _reason, "now": _flag("now")},
    "undrain": {"gpus": _texts("undrain GPU", most=64)},
    "clean": {"refs": _texts("clean job", most=MAX_CLEAN_REFS), "before": _time("clean --before"), "users": _texts("clean user"),
              "states": _texts("clean state", ENDED_STATES)},
    "slurm": {name: _checked_by_handler for name in SLURM_ARGS} | {"action": _slurm_action},
}


def check_args(op: str, args: dict[str, Any]) -> None:
    """Types and sizes of an op's arguments, before any handler sees them (one line if wrong)."""
    table = ARGS.get(op)
    if table is None:  # an op this table does not know yet: its handler checks its values
        if len(args) > MAX_UNCHECKED_ARGS:
            raise ProtocolError(f"too many arguments for {op} ({len(args)})")
        return
    for name, value in args.items():
        check = table.get(name)
        if check is None:
            raise ProtocolError(f"{op} takes no argument {short(name)}")
        if value is not None:
            check(value)
    for name in ("id", "ids", "spec", "name", "text", "signal"):  # required where the op has them
        if name in table and args.get(name) is None:
            table[name](None)
