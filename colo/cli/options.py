"""Every daemon command's arguments and options, in one place.

Two readers use this table and nothing else: colo/cli/argv.py parses a command line by it without
importing typer (what `colo` runs: colo/cli/entry.py), and colo/cli/app.py builds the typer
command from it (for --help, completion, and the lines anything the short parser refuses gets).
Each command names the function that runs it ("module:function"), which both call with the same
keyword arguments. Light to import: plain classes, no typing, dataclasses or re.
"""
from __future__ import annotations


class Opt:
    """An option: its names (long and short), the keyword its value goes to, its type (str, int,
    float; bool for a flag), whether it repeats (a list), its default and its help."""

    __slots__ = ("names", "dest", "help", "type", "many", "default", "min", "envvar", "metavar", "complete")

    def __init__(self, names: tuple, dest: str, help: str, type: type = str, many: bool = False,
                 default: object = None, min: int | None = None, envvar: str | None = None,
                 metavar: str | None = None, complete: str | None = None):
        self.names, self.dest, self.help, self.type, self.many = names, dest, help, type, many
        self.default = [] if many else (False if type is bool and default is None else default)
        self.min, self.envvar, self.metavar, self.complete = min, envvar, metavar, complete


class Arg:
    """A positional argument: one (required unless `required` is False) or many. complete:
    "jobs" or "open" (shell completion offers job ids and names: any, or the open ones)."""

    __slots__ = ("dest", "help", "many", "required", "complete")

    def __init__(self, dest: str, help: str, many: bool = False, required: bool = True,
                 complete: str | None = None):
        self.dest, self.help, self.many, self.required, self.complete = dest, help, many, required, complete


class Cmd:
    """summary: the one line `colo --help` shows; help: the rest (paragraphs, then an example)."""

    __slots__ = ("name", "run", "summary", "help", "params", "interspersed", "aliases")

    def __init__(self, name: str, run: str, summary: str, help: str, params: list, interspersed: bool = True,
                 aliases: tuple = ()):
        self.name, self.run, self.summary, self.help, self.params = name, run, summary, help, params
        self.interspersed, self.aliases = interspersed, aliases


SOCKET = Opt(("--socket",), "sock", "daemon socket", envvar="COLO_SOCKET", metavar="PATH")
JSON = Opt(("--json",), "as_json", "print JSON for scripts", bool)
STATES = ("queued", "starting", "running", "succeeded", "failed", "cancelled", "lost")
LS_COLUMNS = "id, name, user, state, gpu, mode, budget, age, exit, priority, command, reason, array"
HISTORY_COLUMNS = "id, name, user, state, exit, waited, ran, gpus, gpu-h, budget, slowdown, started, ended"
REF = "a job id, ARRAY_INDEX (12_3) or a job's name"


def _jobs(what: str, complete: str = "jobs", required: bool = True) -> Arg:
    return Arg("jobs", what, many=True, required=required, complete=complete)


def _job(complete: str = "jobs") -> Arg:
    return Arg("job", "job id, ARRAY_INDEX (12_3) or name", complete=complete)


_AFTER = ("(repeatable; {}: an array's id means all its tasks, a name your jobs of that name: the open "
          "ones, or else the newest)").format(REF)

SUBMIT = Cmd(
    "submit", "colo.cli.submitspec:submit", "Queue a job; prints its id (an array's: its first task's).",
    "Example: colo submit --image local/trainer:1 --gpu-mem 4GiB --name mnist -- python train.py\n\n"
    "·   colo submit --process --gpus 0 --after-fail 7 -- ./notify.sh \"job 7 failed\"\n\n"
    "·   colo submit --process --gpu-mem 2GiB --array 0-15%4 --gpu-type A100 --name sweep -o out-%A_%a.txt -- ./run.sh",
    [Arg("command", "the command, after --", many=True, required=False),
     Opt(("--image",), "image", "container image (local)"),
     Opt(("--process",), "process", "run as a host process, no container", bool),
     Opt(("--gpu-mem",), "gpu_mem", "GPU memory budget per GPU, e.g. 4GiB"),
     Opt(("--gpus",), "gpus", "number of GPUs (0: a CPU-only job)", int, default=1),
     Opt(("--name",), "name", "a name to refer to the job by (letters, digits, . _ -)"),
     Opt(("--env",), "env", "K=V, repeatable", many=True),
     Opt(("--env-file",), "env_file", "K=V lines (# comments), repeatable", many=True),
     Opt(("--mount",), "mount", "SRC:DST[:ro], repeatable", many=True),
     Opt(("--workdir",), "workdir", "folder the job starts in (a process job: the current one by default)"),
     Opt(("--after",), "after", "start only after this job succeeded; if it fails, this job fails too " + _AFTER,
         many=True, complete="jobs"),
     Opt(("--after-any",), "after_any", "start only after this job ended, however it ended " + _AFTER, many=True,
         complete="jobs"),
     Opt(("--after-fail",), "after_fail", "start only after this job ended without succeeding: failed, cancelled "
         "or lost; if it succeeds, this job fails, as it will never run " + _AFTER, many=True, complete="jobs"),
     Opt(("--priority",), "priority", "higher starts first (users may set up to max_user_priority)", int, default=0),
     Opt(("--profile",), "profile", "profile name this job runs under"),
     Opt(("--retries",), "retries", "requeue after an MPS server fault, up to N times", int, default=0),
     Opt(("--hold", "-H"), "hold", "queue it held: it does not start until `colo release` (as sbatch -H)", bool),
     Opt(("--begin",), "begin", "start no earlier than this: a local time (14:00, 2026-11-30T08:00, tomorrow) "
         "or now+DURATION (now+1h), as sbatch --begin"),
     Opt(("--delay",), "delay", "start no earlier than this long from now: 90s, 10m, 2h, 1d (as pueue --delay)"),
     Opt(("--output", "-o"), "output", "also write the job's stdout (and its stderr, unless -e) to this file, as "
         "you: %j is the job id, %A the array's id, %a the task's index, %x the name, %u the user, %% a % "
         "(as sbatch -o); a relative path is taken from the workdir; process jobs only"),
     Opt(("--error", "-e"), "error", "write the job's stderr to this file apart (as sbatch -e), as -o"),
     Opt(("--on-end",), "on_end", "a shell command run as you when the job ends, with COLO_JOB_ID, "
         "COLO_JOB_NAME, COLO_JOB_STATE and COLO_JOB_EXIT set (as pueue's callback); its output goes to the "
         "job's log"),
     Opt(("--mail-type",), "mail_type", "mail when the job ends: END, FAIL or ALL (as sbatch; only where the "
         "node has a mail transfer agent)"),
     Opt(("--mail-user",), "mail_user", "where --mail-type mails go (default: your user on this node)"),
     Opt(("--wait",), "wait_", "block until the job ends; exit with its exit code (with --json: print how it "
         "ended)", bool),
     Opt(("--follow", "-f"), "follow", "print its output until it ends (implies --wait)", bool),
     Opt(("--grow",), "grow", "may run with more than --gpu-mem: lent, learned from your runs, or requeued once "
         "when refused", bool),
     Opt(("--no-suspend",), "no_suspend", "never suspended by colo's policies (idle_jobs, idle_sessions, preempt: "
         "docs/suspend.md); `colo suspend` by you or an admin still may", bool),
     Opt(("--cpus",), "cpus", "CPU limit in cores, e.g. 2 or 0.5", float),
     Opt(("--tasks",), "tasks", "most processes and threads the job may have at once (default: the node's "
         "job_tasks); a fork past it fails inside the job", int),
     Opt(("--mem",), "mem", "host memory limit, e.g. 8GiB"),
     Opt(("--time",), "time_limit", "wall-time limit as Slurm reads it: minutes, MM:SS, HH:MM:SS, D-HH:MM:SS "
         "(or 90s, 2h)"),
     Opt(("--array",), "array", "a job array, as Slurm's: one task per index (0-9, 0-9:2, 1,3,5; %N at the end: "
         "at most N at once, 0-15%4), each with COLO_ARRAY_INDEX and COLO_ARRAY_JOB_ID set; prints the array's "
         "id, which ls, wait, cancel, hold, release and requeue take for all its tasks; at most 1,000 tasks"),
     Opt(("--gpu-id",), "gpu_id", "only these GPUs may take the job: indices as `colo gpus` shows them, e.g. 1 "
         "or 0,2 (repeatable)", many=True),
     Opt(("--gpu-type",), "gpu_type", "only GPUs whose name holds this text (any case), e.g. A100 or 'RTX 4090'"),
     SOCKET, JSON],
    interspersed=False)

LS = Cmd(
    "ls", "colo.cli.lsview:ls", "List jobs: the queued and running ones, or with --all every job colo remembers.",
    "The queued tasks of an array share one row (12_[3-9,11]) unless -r.\n\n"
    "Example: colo ls --all --state failed --user alice -o id,name,exit,reason   ·   colo ls 12 -o id,array,state",
    [Arg("refs", "only these jobs (ended ones too): ids, names, an array's id or name (all its tasks), ARRAY_INDEX",
         many=True, required=False, complete="jobs"),
     Opt(("--all", "-a"), "all_", "ended jobs too (default: queued and running)", bool),
     Opt(("--user", "-u"), "users", "only this user's jobs (repeatable)", many=True),
     Opt(("--state", "-s"), "states", "only jobs in this state (repeatable): " + ", ".join(STATES), many=True),
     Opt(("--name", "-n"), "names", "only jobs of this name (repeatable)", many=True),
     Opt(("--quiet", "-q"), "quiet", "job ids only, one a line", bool),
     Opt(("--format", "-o"), "fmt", "columns, comma-separated, of: " + LS_COLUMNS),
     Opt(("--wide", "-w"), "wide", "reasons and commands in full", bool),
     Opt(("--tasks", "-r"), "tasks", "every task of an array on a row of its own (as squeue -r)", bool),
     Opt(("--limit",), "limit", "only the newest N; 0: every job (a terminal shows at most 500 otherwise: the "
         "running jobs first, then the front of the queue)", int),
     SOCKET, JSON])

SHOW = Cmd("show", "colo.cli.jobview:show", "Everything known about one job.",
           "Its state, budget, GPUs and mode, dependencies, array, decision and events.\n\nExample: colo show 7",
           [_job(), SOCKET, JSON])

EXPLAIN = Cmd("explain", "colo.cli.jobview:explain", "Why a job was placed where it was, or why it waits.",
              "Once it ended: how it ended, and the slowdown predicted at its start against the one observed.\n\n"
              "Example: colo explain 7", [_job(), SOCKET, JSON])

LOGS = Cmd(
    "logs", "colo.cli.jobview:logs", "A job's output, as it wrote it (stdout and stderr together).",
    "Jobs write no times into their output: colo notes when it sees each line arrive (see --timestamps).\n\n"
    "Example: colo logs -f --tail 20 7   ·   colo logs --since 10m --timestamps train",
    [_job(),
     Opt(("--follow", "-f"), "follow", "follow until the job ends", bool),
     Opt(("--tail", "-n"), "tail", "only the last N lines (after --since, when both are given)", int, min=0),
     Opt(("--since",), "since", "only lines colo saw at or after this: a duration back from now (10m, 2h) or a "
         "time (2026-11-22T14:00)"),
     Opt(("--timestamps", "-t"), "timestamps", "put before each line the time colo first saw it in the job's "
         "output: the line was written then or at most one sample interval (1 s) before; lines of jobs that "
         "ended before colo noted such times show the job's end", bool),
     SOCKET, JSON])

WAIT = Cmd(
    "wait", "colo.cli.jobview:wait", "Block until jobs end; say how each ended; exit with the first failure's code.",
    "The first non-zero exit code among them, in the order given (1 for a job that ended without one: "
    "cancelled, lost, never started). An array's id or name waits for all its tasks. A job run again by "
    "`colo requeue` is followed to its newest copy: the wait ends with the copy's end.\n\n"
    "Example: colo wait 3 2 1 && echo all succeeded   ·   colo wait sweep",
    [_jobs("job ids or names", "open"), SOCKET, JSON])

CANCEL = Cmd(
    "cancel", "colo.cli.jobview:cancel", "Stop jobs, or send them a signal (-s).",
    "Queued ones end at once; running ones get SIGTERM, then SIGKILL after the grace period. Returns at once: "
    "the stops go on in the daemon, all at the same time. With -s SIGNAL the running jobs get that signal "
    "only (as scancel -s and pueue kill -s) and go on until they end by themselves.\n\n"
    "Example: colo cancel 7 8   ·   colo cancel --all -t queued   ·   colo cancel --name sweep   ·   "
    "colo cancel -s SIGINT 12_3",
    [_jobs("job ids or names; an array's id or name: its open tasks", "open", required=False),
     Opt(("--signal", "-s"), "signal", "send this signal instead: HUP, INT, QUIT, USR1, USR2 or TERM (SIGINT, INT "
         "or 2), to the job's main process (a container's too)"),
     Opt(("--user", "-u"), "users", "every open job of this user (repeatable)", many=True),
     Opt(("--state", "-t"), "states", "only open jobs in this state: queued, starting, running (as scancel -t)",
         many=True),
     Opt(("--name", "-n"), "names", "every open job of this name", many=True),
     Opt(("--all",), "all_", "every open job of your own", bool),
     Opt(("--all-users",), "all_users", "every open job of every user (root and admin_group only: before "
         "removing colo, say)", bool),
     SOCKET, JSON])

HOLD = Cmd("hold", "colo.cli.jobview:hold", "Keep queued jobs from starting until `colo release`.",
           "As Slurm's scontrol hold. ls, show and explain say who holds them. Your own jobs; any job for root "
           "and the admin group.\n\nExample: colo hold 7 8   ·   colo hold sweep-3   ·   colo hold 12 (an array's "
           "queued tasks)", [_jobs("ids or names of queued jobs", "open"), SOCKET, JSON])

RELEASE = Cmd("release", "colo.cli.jobview:release", "Let held jobs start again: they keep their place in the queue.",
              "Example: colo release 7 8", [_jobs("ids or names of held jobs", "open"), SOCKET, JSON])

PAUSE = Cmd(
    "pause", "colo.cli.jobview:pause", "Freeze running jobs where they are (as pueue pause, scontrol suspend).",
    "Every process of the job stops at once (the cgroup freezer; `docker pause` for a container) and keeps its "
    "memory, its GPU memory and its budget: nothing else is placed in it meanwhile. `colo resume` thaws it. An "
    "MPS client is not paused: frozen in the middle of a kernel it could stall the GPU's MPS server for every "
    "other job on it. A --time limit goes on counting.\n\nExample: colo pause 7   ·   colo pause sweep",
    [_jobs("ids or names of running jobs", "open"), SOCKET, JSON])

SUSPEND = Cmd(
    "suspend", "colo.cli.jobview:suspend", "Give a running job's GPU memory back: it is held in host memory.",
    "The driver's checkpoint (driver 570 or later) locks the job's CUDA processes, copies their GPU memory to "
    "host memory and frees it on the GPU: its budget is given to the queue. Its CPU side runs on (a notebook "
    "still answers); a CUDA call waits until `colo resume` restores it on the same GPU, as soon as its budget "
    "fits there again. Refused for MPS clients, for what the driver cannot checkpoint (with its reason), and "
    "when the host memory it would take passes the node's limit (docs/suspend.md).\n\nExample: colo suspend 7",
    [_jobs("ids or names of running jobs", "open"), SOCKET, JSON])

RESUME = Cmd("resume", "colo.cli.jobview:resume", "Thaw paused jobs, restore suspended ones: they go on where they "
             "stopped.", "A suspended job is restored as soon as its budget fits on its GPU again; until then it "
             "waits at the front of the queue (colo explain says for what).\n\nExample: colo resume 7",
             [_jobs("ids or names of paused or suspended jobs", "open"), SOCKET, JSON])

EDIT = Cmd(
    "edit", "colo.cli.jobview:edit", "Change a queued job's budget, priority or name.",
    "Checked as `colo submit` checks them. A job that started keeps what it started with.\n\n"
    "Example: colo edit 7 --gpu-mem 6GiB --priority 5",
    [_job("open"),
     Opt(("--gpu-mem",), "gpu_mem", "new GPU memory budget per GPU, e.g. 6GiB"),
     Opt(("--priority",), "priority", "new priority (higher starts first; users may set up to max_user_priority)",
         int),
     Opt(("--name",), "name", "new name (letters, digits, . _ -)"),
     SOCKET, JSON])

REQUEUE = Cmd(
    "requeue", "colo.cli.jobview:requeue", "Run ended jobs again, each as a copy with a new id.",
    "Succeeded, failed, cancelled or lost: each is submitted anew, as pueue's restart does by default; the ended "
    "run stays in `colo history`. An array's id or name: every task of it that ended (a task still queued or "
    "running is left as it is and named). Prints the new ids.\n\n"
    "Example: colo requeue 7   ·   colo requeue 12 (the array's ended tasks)   ·   "
    "colo ls -q --all --state failed | xargs colo requeue",
    [_jobs("ids or names of ended jobs; an array's id or name: its ended tasks"), SOCKET, JSON], aliases=("restart",))

CLEAN = Cmd(
    "clean", "colo.cli.jobview:clean", "Remove ended jobs for good, as pueue's clean.",
    "Their rows in ls --all, history and report, their decisions, samples and logs. Your own jobs (anyone's for "
    "root and the admin group); never a queued, held or running one. What was learned (profiles, co-run factors) "
    "and fair-share use stay. Named jobs must all have ended, else nothing is removed. Kept for now: jobs a queued "
    "job depends on (--after), tasks of an array not all ended, and jobs whose container the engine has not let "
    "colo remove yet. The daemon can do it by itself: history_keep_days in its config.\n\n"
    "Example: colo clean   ·   colo clean --before 30d --succeeded-only   ·   colo clean 12 sweep   ·   "
    "colo clean -u bob",
    [_jobs("only these ended jobs: ids, names, an array's id or name (all its tasks), ARRAY_INDEX (12_3)",
           required=False),
     Opt(("--before",), "before", "only jobs that ended before this: a duration back from now (30d, 12h) or a "
         "local date or time (2026-11-01, 2026-11-01T08:00)"),
     Opt(("--failed-only",), "failed_only", "only jobs that did not succeed (failed, cancelled, lost)", bool),
     Opt(("--succeeded-only",), "succeeded_only", "only jobs that succeeded", bool),
     Opt(("--user", "-u"), "users", "this user's jobs instead of your own (repeatable; others': root and the admin "
         "group)", many=True),
     SOCKET, JSON])

GPUS = Cmd("gpus", "colo.cli.jobview:gpus", "The GPUs as the daemon sees them, with the budgets placed on each.",
           "Exact: what is usable is what a --gpu-mem may ask for.\n\nExample: colo gpus --json", [SOCKET, JSON])

DRAIN = Cmd(
    "drain", "colo.cli.drainview:drain", "Take GPUs out of service: no new job is placed on them.",
    "As Slurm's State=DRAIN: running jobs finish where they are (with --now they are suspended, or else queued "
    "again to start elsewhere); waiting jobs say why in `colo explain`. It lasts across daemon restarts until `colo undrain`; "
    "`colo gpus` and `colo top` show it. Root and the admin group only.\n\n"
    "Example: colo drain 0 --reason \"driver update\"   ·   colo drain GPU-5f3c... --reason \"Xid 79\" --now",
    [Arg("gpus", "GPU indices or UUIDs, as `colo gpus` shows them", many=True),
     Opt(("--reason",), "reason", "why it is out of service (shown to waiting jobs and in colo gpus)"),
     Opt(("--now",), "now", "also move the jobs running on it now: each is suspended there where it can be (its "
         "GPU memory to host memory; restored once the GPU is undrained), else requeued to start again on another "
         "GPU (an MPS client, --no-suspend, what the driver cannot checkpoint); says which per job", bool),
     SOCKET, JSON])

UNDRAIN = Cmd("undrain", "colo.cli.drainview:undrain", "Put drained GPUs back in service.",
              "Root and the admin group only.\n\nExample: colo undrain 0",
              [Arg("gpus", "GPU indices or UUIDs", many=True), SOCKET, JSON])

CONFIG = Cmd(
    "config", "colo.cli.drainview:config", "Check a daemon config file as the daemon reads it.",
    "`colo config check [FILE]` (FILE: $COLO_CONFIG, else /etc/colo/colo.toml) prints every error the daemon "
    "would refuse to start with, one a line with its line number, and exits 1; \"ok\" and 0 when there is none. "
    "Needs no daemon: the unit runs it before a (re)start, so a bad edit keeps the running daemon.\n\n"
    "Example: colo config check /etc/colo/colo.toml",
    [Arg("action", "check"), Arg("file", "the TOML file", required=False)])

_SINCE = Opt(("--since", "-S"), "since", "jobs that ended within this period (90m, 12h, 7d, 2w) or since this "
             "local date or time (2026-11-01, 2026-11-01T08:00)", default="7d")
_USERS = Opt(("--user", "-u"), "users", "only this user's jobs (repeatable)", many=True)

HISTORY = Cmd(
    "history", "colo.cli.acctview:history", "Ended jobs, as sacct shows them.",
    "Waited, ran, GPUs, GPU-hours, budget, exit, and SLOWDOWN: its run time over its profile's run time alone "
    "(— where it had no profile or did not succeed). The daemon filters and picks the newest in its database: "
    "months of history cost no more.\n\n"
    "Example: colo history --since 1d --user alice   ·   colo history -o id,name,state,exit,ran | grep failed   ·   "
    "colo history --admin --since 30d",
    [_SINCE, _USERS,
     Opt(("--limit", "-n"), "limit", "only the newest N; 0: every job (a terminal shows the newest 200 otherwise)",
         int),
     Opt(("--format", "-o"), "fmt", "columns, comma-separated, of: " + HISTORY_COLUMNS),
     Opt(("--admin",), "admin", "the admin log instead, newest first: drains and undrains (colo's own on GPU "
         "faults too), reloads, and what root and the admin group did to other users' jobs (cancel, hold, "
         "release, pause, resume, suspend, edit, signal); root and the admin group only", bool),
     SOCKET, JSON])

REPORT = Cmd(
    "report", "colo.cli.acctview:report", "Per user GPU-hours, waits and slowdown; what sharing GPUs saved.",
    "Per user: jobs, GPU-hours, waiting, slowdown against alone (run time over the profile's run time alone, "
    "over the succeeded jobs that had a profile: \"—\" where none had); for the node: what sharing GPUs saved "
    "against one job per GPU (the GPU-hours the same jobs take each alone on its GPUs, less the GPU-hours the "
    "GPUs were busy).\n\nExample: colo report --since 30d   ·   colo report --since 30d --svg report.svg",
    [_SINCE, _USERS,
     Opt(("--svg",), "svg", "also write the report as an SVG image to this file: GPU-hours and GiB-hours budgeted "
         "per user, and per day GPU-hours one job per GPU would take, busy and saved"),
     SOCKET, JSON])

TOP = Cmd("top", "colo.cli.jobview:top", "Live view of GPUs, jobs, budgets and the queue.",
          "Example: colo top   ·   colo top --once --lines 40 > snapshot.txt",
          [Opt(("--once",), "once", "print one plain-text frame and exit", bool),
           Opt(("--lines",), "lines", "with --once: at most N lines (default: the terminal's height when printing "
               "to one; 0: no bound)", int),
           SOCKET])

# In the order `colo --help` lists them.
def _session(command: Arg) -> list:
    """A session's arguments: what it shares with `colo submit`, and its own."""
    return [command,
            Opt(("--gpu-mem",), "gpu_mem", "GPU memory budget per GPU, e.g. 8GiB (without it: no GPU)"),
            Opt(("--gpus",), "gpus", "number of GPUs (default: 1 with --gpu-mem, else 0)", int),
            Opt(("--name",), "name", "a name to refer to the job by"),
            Opt(("--env",), "env", "K=V, repeatable (TERM is this terminal's)", many=True),
            Opt(("--workdir",), "workdir", "folder it starts in (default: the current one; in a container, the "
                "image's)"),
            Opt(("--time",), "time", "wall-time limit as Slurm reads it (minutes, HH:MM:SS, 2h)"),
            Opt(("--cpus",), "cpus", "CPU limit in cores", float),
            Opt(("--mem",), "mem", "host memory limit, e.g. 8GiB"),
            Opt(("--gpu-id",), "gpu_id", "only these GPUs may take it (indices, e.g. 0,2)", many=True),
            Opt(("--gpu-type",), "gpu_type", "only GPUs whose name holds this text"),
            Opt(("--priority",), "priority", "higher starts first", int, default=0),
            Opt(("--after",), "after", "start only after this job succeeded " + _AFTER, many=True,
                complete="jobs"),
            Opt(("--image",), "image", "run it in a container of this local image, as colo submit --image"),
            Opt(("--mount",), "mount", "SRC:DST[:ro] into a container session, as colo submit --mount; repeatable",
                many=True),
            Opt(("--detach",), "detach", "start it with no client: its terminal kept by the daemon (its output "
                "in a scrollback) until colo attach JOB", bool),
            SOCKET]


SHELL = Cmd(
    "shell", "colo.cli.sessions:shell", "Your shell on this node as a colo job, on this terminal.",
    "Queued and placed like any job (its reason shown while it waits), held to its GPU budget, contained and "
    "counted; it ends when you leave the shell, or when this client goes (unless --detach). With --image, in "
    "a container of that image (/bin/sh unless a command is given).\n\n"
    "Example: colo shell --gpu-mem 8GiB   ·   colo shell --gpus 0 -- bash -l   ·   "
    "colo shell --image pytorch:24.05 --gpu-mem 8GiB -- bash",
    _session(Arg("command", "what to run instead of your shell, after --", many=True, required=False)),
    interspersed=False)
RUN = Cmd(
    "run", "colo.cli.sessions:run", "Run a command as a colo job attached to this terminal, as srun --pty does.",
    "It waits in the queue, then runs on a terminal of its own (Ctrl-C, Ctrl-Z and window size reach it); "
    "exits with its exit code. Fed from a pipe or written to one, it gets no terminal (as ssh without one): "
    "your stdin is its, and its stdout and stderr come back apart.\n\n"
    "Example: colo run --gpu-mem 4GiB -- python train.py   ·   colo run --image pytorch:24.05 -- nvidia-smi   ·   "
    "printf 'a\\n' | colo run -- sort",
    _session(Arg("command", "the command, after --", many=True, required=False)), interspersed=False)
ATTACH = Cmd(
    "attach", "colo.cli.sessions:attach", "Take over the terminal of a session started with --detach (yours).",
    "Its last output is shown first; the detach keys (Ctrl-\\ then d) leave it running again. Exits with its "
    "code when it ends while attached.\n\nExample: colo shell --detach --gpu-mem 8GiB   ·   colo attach 12",
    [Arg("job", "the detached session's job id", complete="open"),
     Opt(("--detach-keys",), "keys", "the keys that leave it running, as docker writes them (default ctrl-\\,d)",
         envvar="COLO_DETACH_KEYS"),
     SOCKET])

COMMANDS = [SUBMIT, LS, SHOW, EXPLAIN, LOGS, WAIT, CANCEL, HOLD, RELEASE, PAUSE, SUSPEND, RESUME, EDIT, REQUEUE, CLEAN,
            GPUS, DRAIN, UNDRAIN, HISTORY, REPORT, TOP, CONFIG, SHELL, RUN, ATTACH]
BY_NAME = {n: c for c in COMMANDS for n in (c.name, *c.aliases)}
