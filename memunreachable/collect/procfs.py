"""procfs.py: Stage 1-2 helper: /proc text in, plain data out.

Parsers (pure, unit-tested on literal text):
    parse_maps(text)   -> [Mapping]         /proc/PID/maps
    parse_status(text) -> Status            /proc/PID/status (State, Tgid, Uid, TracerPid, Seccomp,
                                            Seccomp_filters, CapEff)
    parse_stat(text)   -> Stat              /proc/PID/stat (comm may hold spaces and parentheses)
Readers (one open+read each; a vanished process raises NoSuchProcess without a hint: the
orchestrator that catches it adds one, diagnose.hinted(), which reads /proc through here):
    read_maps(pid), read_status(pid), read_stat(pid), list_tasks(pid), read_comm(pid)
Writer: oom_first(pid), the OOM killer's first choice; oom_kills() counts its kills so far,
oom_killed_since(count) says whether it killed since.
Memory cgroups: memory_room(pid) -> (bytes, cgroup) the process's memory cgroup and its
ancestors can still take before a limit makes the kernel kill something there, or None
(parse_cgroups, cgroup_room: pure). The machine: machine_room() -> bytes it can still give
(meminfo_room: pure).

Never psutil.memory_maps() during a pause: it reads smaps (24 ms at 1 GiB) where parsing
maps by hand takes 0.05 ms (ptrace-snapshot.md section 15).
References: proc(5); kernel fs/proc/array.c (task_state, do_task_stat), include/linux/sched.h
(PF_KTHREAD 0x00200000, unchanged since 2.6).
"""
from __future__ import annotations

import bisect
import errno
import os
import re
import struct
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from memunreachable._errors import NoSuchProcess
from memunreachable._types import FrozenFields, Mapping, set_fields

PF_KTHREAD = 0x00200000       # include/linux/sched.h: "I am a kernel thread"
CAP_SYS_PTRACE = 19           # include/uapi/linux/capability.h
SIGKILL = 9


class Status(FrozenFields):
    """The lines of /proc/PID/status that the checks need."""
    __slots__ = ("name", "state", "tgid", "pid", "ppid", "tracer_pid", "uids", "gids", "seccomp",
                 "cap_eff", "threads", "sig_pending", "seccomp_filters", "no_new_privs")

    def __init__(self, name: str,
                 state: str,                        # one letter: R S D T t Z X I ...
                 tgid: int, pid: int, ppid: int, tracer_pid: int,
                 uids: Tuple[int, int, int, int],   # real, effective, saved, fs
                 gids: Tuple[int, int, int, int],
                 seccomp: int,                      # 0 disabled, 1 strict, 2 filter
                 cap_eff: int, threads: int,
                 sig_pending: int = 0,              # SigPnd | ShdPnd (bit n-1 for signal n)
                 seccomp_filters: int = 0,          # Seccomp_filters: (kernel 5.9+; 0 when absent)
                 no_new_privs: int = 0):
        set_fields(self,
                   name, state, tgid, pid, ppid, tracer_pid, uids, gids, seccomp, cap_eff,
                   threads, sig_pending, seccomp_filters, no_new_privs)

    def has_cap(self, cap: int) -> bool:
        return bool(self.cap_eff >> cap & 1)

    @property
    def dying(self) -> bool:
        """Exited, or a SIGKILL is queued (the kernel queues it to every thread of the group)."""
        return self.state in ("Z", "X") or bool(self.sig_pending >> (SIGKILL - 1) & 1)


class Stat(FrozenFields):
    """The fields of /proc/PID/stat that the checks need."""
    __slots__ = ("pid", "comm", "state", "ppid", "flags", "start", "exit_signal")

    def __init__(self, pid: int, comm: str, state: str, ppid: int, flags: int,
                 start: Optional[int] = None,   # field 22: clock ticks since boot
                 # field 38: 0 for a clone(flags=0) child (kernels 2.2+)
                 exit_signal: Optional[int] = None):
        set_fields(self, pid, comm, state, ppid, flags, start, exit_signal)

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


# Returns the mappings in file order; blank lines are skipped. Raises ValueError on a
# malformed line (the kernel's format has been stable since 2.6).
def parse_maps(text: str) -> List[Mapping]:
    out = []
    for line in text.splitlines():
        m = _PARSED.get(line)
        if m is not None:
            out.append(m)
            continue
        if not line.strip():
            continue
        parts = line.split(None, 5)
        if len(parts) < 5:
            raise ValueError(f"malformed maps line: {line!r}")
        begin_s, _, end_s = parts[0].partition("-")
        path = parts[5].strip() if len(parts) > 5 else ""
        m = Mapping(begin=int(begin_s, 16), end=int(end_s, 16), perms=parts[1],
                    offset=int(parts[2], 16), dev=parts[3], inode=int(parts[4]), path=path)
        if len(_PARSED) >= _PARSED_MAX:
            _PARSED.clear()
        _PARSED[line] = m
        out.append(m)
    return out


# Lines already parsed -> their (immutable) Mapping: the helper of in-process checks parses
# the same ~200 maps lines and smaps headers twice a check (2 ms of Mapping construction)
_PARSED: Dict[str, Mapping] = {}
_PARSED_MAX = 8192


def _ints(value: str, n: int) -> tuple:
    vals = tuple(int(v) for v in value.split())
    return (vals + (0,) * n)[:n]


# Returns a Status; missing lines read as 0 / "" (Seccomp: exists since 3.8,
# TracerPid since 2.6.x). Raises ValueError when Name or State is missing.
def parse_status(text: str) -> Status:
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key] = value.strip()
    if "Name" not in fields or "State" not in fields:
        raise ValueError("not a /proc/PID/status text (no Name/State)")
    return Status(
        name=fields["Name"],
        state=fields["State"][:1],
        tgid=int(fields.get("Tgid", "0") or 0),
        pid=int(fields.get("Pid", "0") or 0),
        ppid=int(fields.get("PPid", "0") or 0),
        tracer_pid=int(fields.get("TracerPid", "0") or 0),
        uids=_ints(fields.get("Uid", ""), 4),
        gids=_ints(fields.get("Gid", ""), 4),
        seccomp=int(fields.get("Seccomp", "0") or 0),
        cap_eff=int(fields.get("CapEff", "0") or "0", 16),
        threads=int(fields.get("Threads", "0") or 0),
        sig_pending=int(fields.get("SigPnd", "0") or "0", 16) | int(fields.get("ShdPnd", "0") or "0", 16),
        seccomp_filters=int(fields.get("Seccomp_filters", "0") or 0),
        no_new_privs=int(fields.get("NoNewPrivs", "0") or 0),
    )


# Returns a Stat. comm sits between the first "(" and the LAST ")" (it may contain both).
# start and exit_signal are None when the line stops before them. Raises ValueError on a
# line too short to hold flags.
def parse_stat(text: str) -> Stat:
    lpar = text.index("(")
    rpar = text.rindex(")")
    rest = text[rpar + 1:].split()
    if len(rest) < 7:
        raise ValueError(f"short /proc stat line ({len(rest) + 2} fields)")
    # rest[0] is field 3 (state); flags is field 9 -> rest[6]; field N is rest[N - 3]
    return Stat(pid=int(text[:lpar]), comm=text[lpar + 1:rpar], state=rest[0],
                ppid=int(rest[1]), flags=int(rest[6]),
                start=int(rest[19]) if len(rest) > 19 else None,
                exit_signal=int(rest[35]) if len(rest) > 35 else None)


def _gone(pid: int) -> NoSuchProcess:
    return NoSuchProcess(pid, "no such process")


def _read(path: str, pid: int) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise _gone(pid) from exc
    except OSError as exc:
        if exc.errno == errno.ESRCH:
            raise _gone(pid) from exc
        raise


def read_status(pid: int, tid: Optional[int] = None) -> Status:
    path = f"/proc/{pid}/status" if tid is None else f"/proc/{pid}/task/{tid}/status"
    return parse_status(_read(path, pid))


def rss_anon_bytes(status_text: str) -> int:
    """The RssAnon line of a /proc/PID/status text, in bytes (0 when absent)."""
    for line in status_text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def read_rss_anon(pid: int) -> int:
    """Resident anonymous memory of pid, in bytes (0 when the kernel does not say)."""
    return rss_anon_bytes(_read(f"/proc/{pid}/status", pid))


# Memory cgroups (cgroup v1's memory controller, cgroup v2): where each hierarchy is mounted
# (systemd's layouts: v1 beside a v2 "unified" tree, or v2 alone), and the files each names.
CGROUP_V1_MEMORY = "/sys/fs/cgroup/memory"
CGROUP_V2 = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified")
# a limit at or above this is none (v1's PAGE_COUNTER_MAX pages: 9223372036854771712; v2 "max")
NO_LIMIT = 1 << 62


def parse_cgroups(text: str) -> Tuple[Optional[str], Optional[str]]:
    """(the v1 memory controller's cgroup, the v2 cgroup) of a /proc/PID/cgroup text (lines
    ID:CONTROLLERS:PATH; v2's is 0::PATH); None for one the process is in no hierarchy of."""
    v1 = v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif "memory" in parts[1].split(","):
            v1 = parts[2]
    return v1, v2


def cgroup_room(limit: str, usage: str, stat: str) -> Optional[int]:
    """Bytes one memory cgroup can still take before its limit (the texts of its memory.max
    or memory.limit_in_bytes, memory.current or memory.usage_in_bytes, memory.stat): the limit
    less the usage, with its page cache (the file LRU lists, active and inactive: shared
    memory is on the anonymous ones) counted as room: the kernel reclaims it before it kills.
    v1's hierarchical total_* counts, where given, include the cgroup's children. None
    without a limit."""
    limit = limit.strip()
    if limit == "max" or int(limit) >= NO_LIMIT:
        return None
    counts = {}
    for line in stat.splitlines():
        key, _, value = line.partition(" ")
        counts[key] = int(value) if value.strip().isdigit() else 0
    prefix = "total_" if "total_inactive_file" in counts else ""
    cache = counts.get(prefix + "active_file", 0) + counts.get(prefix + "inactive_file", 0)
    return max(0, int(limit) - int(usage.strip()) + cache)


def _read_small(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def memory_room(pid: int) -> Optional[Tuple[int, str]]:
    """(bytes, cgroup directory) of the least room among the memory cgroups that hold pid (its
    own and each ancestor, v1's memory controller and v2): what a copy-on-write snapshot of
    it may take before the kernel's OOM killer runs there. None when no limit applies or the
    files do not read (no such hierarchy mounted, or another cgroup namespace)."""
    text = _read_small(f"/proc/{pid}/cgroup")      # (absent: a kernel without cgroups)
    if text is None:
        return None
    v1, v2 = parse_cgroups(text)
    dirs = []
    if v1 is not None:
        dirs.append((CGROUP_V1_MEMORY, v1, "memory.limit_in_bytes", "memory.usage_in_bytes"))
    if v2 is not None:
        root = next((r for r in CGROUP_V2 if os.path.exists(os.path.join(r, "cgroup.controllers"))),
                    None)
        if root is not None:
            dirs.append((root, v2, "memory.max", "memory.current"))
    best = None
    for root, path, limit_file, usage_file in dirs:
        parts = [p for p in path.split("/") if p]
        # the process's own cgroup, then up to the root as this namespace sees it (inside a
        # container with its own cgroup namespace, "/" is the container's cgroup and limit;
        # the real root has none: no memory.max in v2, an unlimited one in v1)
        for k in range(len(parts), -1, -1):
            d = os.path.join(root, *parts[:k])
            texts = [_read_small(os.path.join(d, f)) for f in (limit_file, usage_file,
                                                               "memory.stat")]
            if None in texts:
                continue
            try:
                room = cgroup_room(*texts)
            except ValueError:
                continue
            if room is not None and (best is None or room < best[0]):
                best = (room, d)
    return best


def meminfo_room(text: str) -> Optional[int]:
    """Bytes the machine can still give before its OOM killer runs, from /proc/meminfo's
    text: MemAvailable (free memory and what reclaim can free without swapping) and SwapFree
    (the kernel swaps anonymous pages out before it kills). None when MemAvailable is absent
    (Linux before 3.14)."""
    kib = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            kib[key] = int(fields[0])
    if "MemAvailable" not in kib:
        return None
    return (kib["MemAvailable"] + kib.get("SwapFree", 0)) << 10


def machine_room() -> Optional[int]:
    """meminfo_room of this machine (None: not known)."""
    text = _read_small("/proc/meminfo")
    return None if text is None else meminfo_room(text)


def read_stat(pid: int, tid: Optional[int] = None) -> Stat:
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    return parse_stat(_read(path, pid))


def read_maps(pid: int) -> List[Mapping]:
    return parse_maps(_read(f"/proc/{pid}/maps", pid))


def object_data(maps: Sequence[Mapping], is_object: Callable[[Mapping], bool]) -> List[Mapping]:
    """The writable mappings of one loaded ELF object (the mappings is_object accepts) and,
    right after each, the anonymous writable mapping that continues it (the rest of its .bss,
    which the kernel maps apart from the file), in address order."""
    ordered = sorted(maps, key=lambda m: m.begin)
    out: List[Mapping] = []
    for k, m in enumerate(ordered):
        if m.readable and m.writable and is_object(m):
            out.append(m)
            nxt = ordered[k + 1] if k + 1 < len(ordered) else None
            if (nxt is not None and nxt.begin == m.end and nxt.writable and nxt.anonymous
                    and not nxt.path):
                out.append(nxt)
    return out


def read_exe(pid: Optional[int]) -> Optional[str]:
    """The target of /proc/PID/exe, None when there is none (no pid, gone, unreadable)."""
    if pid is None:
        return None
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def parse_environ_var(raw: bytes, name: str) -> Optional[str]:
    """The value of `name` in an environment block (NUL-separated NAME=value), or None."""
    key = name.encode() + b"="
    for entry in raw.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key):].decode(errors="replace")
    return None


def read_environ_var(pid: int, name: str) -> Optional[str]:
    """`name` in the environment process pid started with (/proc/PID/environ), or None when
    it is not set or cannot be read."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return parse_environ_var(f.read(), name)
    except OSError:
        return None


def read_comm(pid: int) -> str:
    """The comm of pid, or "" when it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


OOM_FIRST = 1000     # oom_score_adj's highest: the OOM killer's first choice


def oom_first(pid: Optional[int] = None) -> bool:
    """Make process pid (None: this one) the OOM killer's first choice (proc(5)
    oom_score_adj): a snapshot shares the target's pages and counts them as its own, and a
    sweeper holds copies of its heap; under memory pressure either must go before the
    target. Raising the score needs no privilege; False when it could not be written
    (the process is gone, or another user's)."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/oom_score_adj", "w") as f:
            f.write(str(OOM_FIRST))
        return True
    except OSError:
        return False


def oom_kills() -> int:
    """The OOM killer's kills since boot (/proc/vmstat oom_kill, Linux 4.13+), -1 unknown."""
    try:
        with open("/proc/vmstat", "rb") as f:
            for line in f:
                if line.startswith(b"oom_kill "):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def oom_killed_since(before: int) -> bool:
    """Whether the OOM killer killed anything since oom_kills() gave `before` (False when
    either count is unknown)."""
    return 0 <= before < oom_kills()


# Returns the tids of pid in ascending order. Raises NoSuchProcess when pid is gone.
def list_tasks(pid: int) -> List[int]:
    try:
        return sorted(int(t) for t in os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise _gone(pid) from exc


def task_state(pid: int, tid: int) -> str:
    """One-letter state of a thread, or "" when it is gone."""
    try:
        return read_stat(pid, tid).state
    except (NoSuchProcess, OSError, ValueError):
        return ""


# Returns [(Mapping, VmFlags)] in file order from /proc/PID/smaps text: each mapping's header
# line with the two-letter flags of its VmFlags line ("dc" MADV_DONTFORK, "wf"
# MADV_WIPEONFORK, "io"/"pf" device memory; proc(5)), plus the pseudo-flag "written" when the
# mapping holds anonymous pages, resident or swapped ("Anonymous:" or "Swap:" above 0 kB): in
# a private file mapping those are the pages the process wrote. A mapping without a VmFlags
# line (kernels before 3.8) gets no two-letter flags. Raises ValueError on a malformed header.
def parse_smaps_flags(text: str) -> List[Tuple[Mapping, frozenset]]:
    # three scans, each with a literal prefix the regex engine searches for fast (one
    # alternation tried at each of the ~5,000 line starts took twice as long), then each
    # line found goes to the mapping whose header comes last before it
    t = "\n" + text
    heads = [(m.start(), m.group(1)) for m in _SMAPS_HEADER.finditer(t)]
    if not heads:
        return []
    mappings = parse_maps("\n".join([h for _, h in heads]))
    starts = [pos for pos, _ in heads]
    flags = [frozenset()] * len(heads)
    for m in _SMAPS_NONZERO.finditer(t):
        i = bisect.bisect_right(starts, m.start()) - 1
        if i >= 0:
            flags[i] = WRITTEN
    for m in _SMAPS_VMFLAGS.finditer(t):
        i = bisect.bisect_right(starts, m.start()) - 1
        if i >= 0:
            fs = _FLAG_SETS.get(m.group(1))
            if fs is None:
                fs = _FLAG_SETS[m.group(1)] = frozenset(m.group(1).split())
                if len(_FLAG_SETS) > 4096:
                    _FLAG_SETS.clear()
            flags[i] = flags[i] | fs
    return list(zip(mappings, flags))


_SMAPS_HEADER = re.compile(r"\n([0-9a-f]+-[0-9a-f]+ [^\n]*)")
_SMAPS_NONZERO = re.compile(r"\n(?:Anonymous|Swap):[ \t]*0*[1-9]")     # above 0 kB
_SMAPS_VMFLAGS = re.compile(r"\nVmFlags:([^\n]*)")
_FLAG_SETS: Dict[str, frozenset] = {}
WRITTEN = frozenset({"written"})


# Returns {type: value} of the auxiliary vector text of /proc/PID/auxv (u64 pairs up to
# AT_NULL); getauxval(3).
def parse_auxv(data: bytes) -> Dict[int, int]:
    out: Dict[int, int] = {}
    for k in range(0, len(data) - 15, 16):
        key, value = struct.unpack_from("<QQ", data, k)
        if key == 0:
            break
        out[key] = value
    return out


def read_auxv(pid: int) -> Dict[int, int]:
    try:
        with open(f"/proc/{pid}/auxv", "rb") as f:
            return parse_auxv(f.read())
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise _gone(pid) from exc


def read_smaps_flags(pid: int) -> List[Tuple[Mapping, frozenset]]:
    return parse_smaps_flags(_read(f"/proc/{pid}/smaps", pid))


# ---- access probes and security labels (diagnose.py)

# Returns the confinement label from the text of /proc/PID/attr/current (AppArmor "profile
# (mode)", SELinux "user:role:type:level"), "" for none or unconfined.
def parse_lsm_label(text: str) -> str:
    label = text.strip().rstrip("\x00").strip()
    if not label or label == "unconfined" or label.startswith("unconfined ") \
            or label.startswith("unconfined_u:unconfined_r:unconfined_t"):
        return ""
    return label


def read_lsm_label(pid) -> str:
    """The AppArmor/SELinux label of pid ("self" for us), "" when none or unreadable.
    /proc/PID/attr/apparmor/current (kernel 5.8+, AppArmor stacked) first."""
    for path in (f"/proc/{pid}/attr/apparmor/current", f"/proc/{pid}/attr/current"):
        try:
            with open(path, "rb") as f:
                return parse_lsm_label(f.read(4096).decode("utf-8", "replace"))
        except OSError:
            continue
    return ""


# Returns True when the uid_map text maps the whole uid range onto itself: the process is in
# the initial user namespace (or one that mirrors it), where its capabilities reach every
# process. A rootless container shows e.g. "0 1000 1".
def parse_uid_map_is_initial(text: str) -> bool:
    rows = [line.split() for line in text.splitlines() if line.strip()]
    return rows == [["0", "0", "4294967295"]]


def in_initial_user_ns() -> bool:
    try:
        with open("/proc/self/uid_map") as f:
            return parse_uid_map_is_initial(f.read())
    except OSError:
        return True


def attach_access_errno(pid: int) -> int:
    """0 when /proc/PID/mem opens, else the errno (EACCES: refused). Opening it runs the
    kernel's attach-mode ptrace check (the one PTRACE_SEIZE runs, Yama and security modules
    included); nothing is read and the target is never touched."""
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        return exc.errno or errno.EIO
    os.close(fd)
    return 0


# Returns (Seccomp, Seccomp_filters) from the bytes of a status file; (0, 0) for lines
# that are missing (kernels without seccomp, or before 5.9 for the count).
def parse_seccomp(raw: bytes) -> Tuple[int, int]:
    out = []
    for key in (b"\nSeccomp:", b"\nSeccomp_filters:"):
        i = raw.find(key)
        if i < 0:
            out.append(0)
            continue
        j = raw.find(b"\n", i + 1)
        value = raw[i + len(key):j if j >= 0 else len(raw)].strip()
        out.append(int(value) if value.isdigit() else 0)
    return out[0], out[1]


def read_seccomp(pid: int, tid: int) -> Tuple[int, int]:
    """(seccomp mode, filter count) of one thread; a third of read_status()'s cost, for the
    pause. Raises NoSuchProcess when the thread is gone."""
    try:
        fd = os.open(f"/proc/{pid}/task/{tid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError) as exc:
        raise _gone(pid) from exc
    try:
        return parse_seccomp(os.read(fd, 16384))
    except ProcessLookupError as exc:
        raise _gone(pid) from exc
    finally:
        os.close(fd)


# Returns the file behind mappings (of one object), opened for reading: through
# /proc/PID/map_files first (it survives the file being replaced or deleted on disk), else by
# path. Raises OSError when neither opens.
def open_mapped_file(mappings: List[Mapping], pid: Optional[int], path: Optional[str] = None):
    first = min(mappings, key=lambda m: m.begin)
    if pid is not None:
        try:
            return open(f"/proc/{pid}/map_files/{first.begin:x}-{first.end:x}", "rb")
        except OSError:
            pass
    return open(path or first.path, "rb")


# pagemap(5): bit 63 page present, bit 62 swapped; both live in an entry's last byte.
_IN_USE = bytes(1 if b & 0xC0 else 0 for b in range(256))
PAGE = 4096


# Returns the runs of [begin, end) (page aligned) whose pages are present or swapped out, from
# one entry per page of /proc/PID/pagemap (8 bytes each, little-endian): the rest was never
# touched (or was discarded) and reads as zeros. Holes shorter than min_hole bytes stay inside
# their runs, at the range's ends too: a copy of the range then holds all of it unless a long
# hole splits it, and later stages view that one copy (an arena's untouched alignment slack at a
# mapping's ends had made the pool scan assemble its window from the copy and a read).
def runs_in_use(entries: bytes, begin: int, min_hole: int) -> List[Tuple[int, int]]:
    end = begin + len(entries) // 8 * PAGE
    runs: List[Tuple[int, int]] = []
    for b, e in _page_runs(entries, begin, _IN_USE):
        if runs and b - runs[-1][1] < min_hole:
            runs[-1] = (runs[-1][0], e)
        else:
            runs.append((b if runs or b - begin >= min_hole else begin, e))
    if runs and end - runs[-1][1] < min_hole:
        runs[-1] = (runs[-1][0], end)
    return runs


# Returns {(begin, end): runs_in_use of it} for each page-aligned range, read from
# /proc/PID/pagemap; None when it cannot be read (a range's pages then all count as in use).
def read_runs_in_use(pid: int, ranges, min_hole: int) -> Optional[dict]:
    return _per_range(pid, ranges, lambda entries, b: runs_in_use(entries, b, min_hole))


# pagemap(5) bit 58 (PM_GUARD_REGION, in an entry's last byte): a MADV_GUARD_INSTALL guard page.
_GUARD = bytes(1 if b & 0x04 else 0 for b in range(256))


# Returns the runs of [begin, end) that are guard pages, from its pagemap entries.
def guard_runs(entries: bytes, begin: int) -> List[Tuple[int, int]]:
    return _page_runs(entries, begin, _GUARD)


# Returns the runs of the pages whose entry's last byte `table` maps to 1, from the pagemap
# entries of the range at begin.
def _page_runs(entries: bytes, begin: int, table: bytes) -> List[Tuple[int, int]]:
    return [(begin + m.start() * PAGE, begin + m.end() * PAGE)
            for m in re.finditer(b"\x01+", entries[7::8].translate(table))]


# Returns {(begin, end): guard_runs of it} for each page-aligned range, read from
# /proc/PID/pagemap (empty runs where the kernel does not report guards); None when it cannot
# be read.
def read_guard_runs(pid: int, ranges) -> Optional[dict]:
    return _per_range(pid, ranges, guard_runs)


def _per_range(pid: int, ranges, parse) -> Optional[dict]:
    out = {}
    try:
        with open(f"/proc/{pid}/pagemap", "rb", buffering=0) as f:
            for b, e in ranges:
                entries = os.pread(f.fileno(), (e - b) // PAGE * 8, b // PAGE * 8)
                if len(entries) != (e - b) // PAGE * 8:
                    return None
                out[(b, e)] = parse(entries, b)
    except OSError:
        return None
    return out
