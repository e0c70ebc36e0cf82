"""Unit tests of procfs.py: literal /proc text in, data out."""
import struct

import pytest

from memunreachable.collect import procfs
from memunreachable._types import Mapping

MAPS = """\
55d0c8a00000-55d0c8a01000 r--p 00000000 08:01 1311 /usr/bin/prog
55d0c8c02000-55d0c8c03000 rw-p 00002000 08:01 1311 /usr/bin/prog
55d0c9e4d000-55d0c9e6e000 rw-p 00000000 00:00 0                          [heap]
7f1c2c000000-7f1c2c021000 rw-p 00000000 00:00 0 
7f1c34e00000-7f1c34e22000 r-xp 00026000 fd:00 4203 /opt/my lib/libx.so (deleted)
7ffd5e5f3000-7ffd5e614000 rw-p 00000000 00:00 0                          [stack]
7ffd5e7f8000-7ffd5e7fa000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""

STATUS = """\
Name:\tmy prog
Umask:\t0022
State:\tS (sleeping)
Tgid:\t4242
Ngid:\t0
Pid:\t4243
PPid:\t17
TracerPid:\t999
Uid:\t1000\t1001\t1002\t1003
Gid:\t100\t101\t102\t103
Threads:\t7
SigPnd:\t0000000000000000
ShdPnd:\t0000000000000100
CapEff:\t000001ffffffffff
Seccomp:\t2
Seccomp_filters:\t1
"""


def test_parse_maps_fields():
    maps = procfs.parse_maps(MAPS)
    assert len(maps) == 8
    assert maps[0] == Mapping(0x55d0c8a00000, 0x55d0c8a01000, "r--p", 0, "08:01", 1311, "/usr/bin/prog")
    assert maps[1].offset == 0x2000 and maps[1].writable and not maps[1].executable
    assert maps[2].path == "[heap]" and maps[2].anonymous
    assert maps[3].path == "" and maps[3].begin == 0x7f1c2c000000 and maps[3].end == 0x7f1c2c021000
    assert maps[4].path == "/opt/my lib/libx.so (deleted)" and maps[4].dev == "fd:00" and maps[4].inode == 4203
    assert maps[4].executable and maps[4].offset == 0x26000
    assert maps[6].path == "[vdso]"
    assert maps[7].begin == 0xffffffffff600000 and maps[7].perms == "--xp" and not maps[7].readable


def test_parse_maps_blank_and_malformed():
    assert procfs.parse_maps("\n\n") == []
    with pytest.raises(ValueError):
        procfs.parse_maps("garbage line\n")


def test_parse_status():
    st = procfs.parse_status(STATUS)
    assert st.name == "my prog"
    assert st.state == "S"
    assert (st.tgid, st.pid, st.ppid, st.tracer_pid, st.threads) == (4242, 4243, 17, 999, 7)
    assert st.uids == (1000, 1001, 1002, 1003)
    assert st.gids == (100, 101, 102, 103)
    assert st.seccomp == 2
    assert st.cap_eff == 0x1ffffffffff
    assert st.has_cap(procfs.CAP_SYS_PTRACE)
    assert st.sig_pending == 0x100 and st.dying      # SIGKILL queued


def test_parse_status_minimal_and_no_cap():
    st = procfs.parse_status("Name:\tx\nState:\tZ (zombie)\nCapEff:\t0000000000000000\n")
    assert st.state == "Z" and st.tracer_pid == 0 and st.seccomp == 0 and st.uids == (0, 0, 0, 0)
    assert not st.has_cap(procfs.CAP_SYS_PTRACE)
    assert st.dying
    assert not procfs.parse_status(STATUS.replace("0000000000000100", "0000000000000200")).dying
    assert procfs.parse_status("Name:\tx\nState:\tR\nCapEff:\t0000000000080000\n").has_cap(19)
    with pytest.raises(ValueError):
        procfs.parse_status("Pid:\t3\n")


def test_parse_stat_comm_with_parens_and_spaces():
    text = "4242 (a) (b c)) t 17 4242 4242 0 -1 4194560 120 0 0 0 5 3 0 0 20 0 2 0\n"
    st = procfs.parse_stat(text)
    assert (st.pid, st.comm, st.state, st.ppid, st.flags) == (4242, "a) (b c)", "t", 17, 4194560)
    assert not st.kernel_thread


def test_parse_stat_kernel_thread_flag():
    text = "2 (kthreadd) S 0 0 0 0 -1 2129984 0 0 0 0 0 0 0 0 20 0 1 0 5\n"
    st = procfs.parse_stat(text)
    assert st.flags == 2129984 and st.flags & procfs.PF_KTHREAD
    assert st.kernel_thread


def test_readers_on_this_process_and_gone_pid(tmp_path):
    import os
    me = os.getpid()
    assert procfs.read_status(me).tgid == me
    assert me in procfs.list_tasks(me)
    assert procfs.read_stat(me).pid == me
    assert any(m.path == "[stack]" for m in procfs.read_maps(me))
    from memunreachable._errors import NoSuchProcess
    with pytest.raises(NoSuchProcess):
        procfs.read_status(4194305)     # above the largest possible pid_max (2^22)
    with pytest.raises(NoSuchProcess):
        procfs.list_tasks(4194305)
    assert procfs.task_state(4194305, 4194305) == ""


def test_parse_status_seccomp_filters_and_no_new_privs():
    st = procfs.parse_status(STATUS)
    assert (st.seccomp, st.seccomp_filters) == (2, 1)
    st = procfs.parse_status("Name:\tx\nState:\tS\nNoNewPrivs:\t1\nSeccomp:\t1\nSeccomp_filters:\t0\n")
    assert (st.seccomp, st.seccomp_filters, st.no_new_privs) == (1, 0, 1)
    # kernels before 5.9 have no Seccomp_filters line
    assert procfs.parse_status("Name:\tx\nState:\tS\nSeccomp:\t2\n").seccomp_filters == 0


@pytest.mark.parametrize("text, label", [
    ("", ""),
    ("unconfined\n", ""),
    ("unconfined (unconfined)\n", ""),
    ("unconfined_u:unconfined_r:unconfined_t:s0-s0:c0.c1023\x00", ""),
    ("docker-default (enforce)\n", "docker-default (enforce)"),
    ("system_u:system_r:container_t:s0:c1,c2\x00", "system_u:system_r:container_t:s0:c1,c2"),
])
def test_parse_lsm_label(text, label):
    assert procfs.parse_lsm_label(text) == label


@pytest.mark.parametrize("text, initial", [
    ("         0          0 4294967295\n", True),
    ("0 1000 1\n", False),
    ("0 100000 65536\n", False),
    ("0 0 4294967295\n1 1 1\n", False),
    ("", False),
])
def test_parse_uid_map_is_initial(text, initial):
    assert procfs.parse_uid_map_is_initial(text) is initial



def test_parse_seccomp():
    assert procfs.parse_seccomp(STATUS.encode()) == (2, 1)
    assert procfs.parse_seccomp(b"Name:\tx\nSeccomp:\t1\nSeccomp_filters:\t0\nSpeculation_Store_Bypass:\tx\n") == (1, 0)
    assert procfs.parse_seccomp(b"Name:\tx\nSeccomp:\t2\n") == (2, 0)
    assert procfs.parse_seccomp(b"Name:\tx\nState:\tS\n") == (0, 0)


def _smaps_flags_model(text):
    """parse_smaps_flags as one pass over the lines (the regex alternation it replaced)."""
    import re
    out = []
    for m in re.finditer(r"\n(?:([0-9a-f]+-[0-9a-f]+ [^\n]*)|(Anonymous|Swap):\s*(\d+)|"
                         r"VmFlags:([^\n]*))", "\n" + text):
        header, counter, flags = m.group(1, 3, 4)
        if header is not None:
            out.append((procfs.parse_maps(header)[0], frozenset()))
        elif out and counter is not None:
            if int(counter):
                out[-1] = (out[-1][0], out[-1][1] | {"written"})
        elif out and flags is not None:
            out[-1] = (out[-1][0], out[-1][1] | frozenset(flags.split()))
    return out


def test_parse_smaps_flags_equals_the_line_model_on_this_process():
    with open("/proc/self/smaps") as f:
        text = f.read()
    got = procfs.parse_smaps_flags(text)
    assert got == _smaps_flags_model(text)
    assert any("written" in fl for _, fl in got) and any("rd" in fl for _, fl in got)
    # a counter or flags line before any header belongs to no mapping; an old kernel's
    # mapping without VmFlags gets none
    odd = "Anonymous: 4 kB\nVmFlags: rd\n" + text.replace("VmFlags:", "Other:", 1)
    assert procfs.parse_smaps_flags(odd) == _smaps_flags_model(odd)


def test_rss_anon_bytes_of_a_status_text():
    from memunreachable.collect.procfs import rss_anon_bytes
    text = "Name:\tpython\nVmRSS:\t   30892 kB\nRssAnon:\t    2002 kB\nRssFile:\t 28890 kB\n"
    assert rss_anon_bytes(text) == 2002 * 1024
    assert rss_anon_bytes("Name:\tkthreadd\nState:\tS (sleeping)\n") == 0


def test_runs_in_use_from_pagemap_entries():
    from memunreachable.collect.procfs import runs_in_use
    present, swapped, none = (1 << 63) | 1234, 1 << 62, 0
    base = 0x7f0000000000
    pages = [present, present, none, none, none, swapped, none, present] + [none] * 8 + [present]
    entries = b"".join(struct.pack("<Q", e) for e in pages)
    # holes of 1 page joined (shorter than 2 pages), of 3 and 8 pages kept
    assert runs_in_use(entries, base, 2 * 4096) == [
        (base, base + 2 * 4096), (base + 5 * 4096, base + 8 * 4096), (base + 16 * 4096, base + 17 * 4096)]
    # every hole shorter than 9 pages joined: one run
    assert runs_in_use(entries, base, 9 * 4096) == [(base, base + 17 * 4096)]
    assert runs_in_use(struct.pack("<QQ", none, none), base, 4096) == []     # never touched
    # untouched pages at the ends: kept in the first and last runs when shorter than a hole
    edges = [none] * 3 + [present] * 2 + [none] * 4 + [present] + [none] * 2
    entries = b"".join(struct.pack("<Q", e) for e in edges)
    assert runs_in_use(entries, base, 4 * 4096) == [(base, base + 5 * 4096),
                                                   (base + 9 * 4096, base + 12 * 4096)]
    assert runs_in_use(entries, base, 3 * 4096) == [(base + 3 * 4096, base + 5 * 4096),
                                                   (base + 9 * 4096, base + 12 * 4096)]
    assert runs_in_use(entries, base, 5 * 4096) == [(base, base + 12 * 4096)]


def test_object_data_is_the_writable_mappings_and_the_bss_after_each():
    lib, other = "/usr/lib/libx.so", "/usr/lib/liby.so"
    maps = [Mapping(0x9000, 0xa000, "rw-p", 0, "fe:00", 9, other),
            Mapping(0xa000, 0xb000, "rw-p", 0, "00:00", 0, ""),     # other's .bss: not lib's
            Mapping(0x1000, 0x2000, "r--p", 0, "fe:00", 7, lib),    # read-only: no data
            Mapping(0x2000, 0x3000, "rw-p", 0x1000, "fe:00", 7, lib),
            Mapping(0x3000, 0x4000, "rw-p", 0, "00:00", 0, ""),     # its .bss
            Mapping(0x4000, 0x5000, "rw-p", 0, "00:00", 0, ""),     # adjacent, but after the .bss
            Mapping(0x6000, 0x7000, "rw-p", 0x2000, "fe:00", 7, lib),
            Mapping(0x7000, 0x8000, "r--p", 0, "00:00", 0, ""),     # not writable: no .bss
            Mapping(0x8000, 0x8800, "rw-p", 0x3000, "fe:00", 7, lib),
            Mapping(0x8800, 0x8900, "rw-p", 0, "00:00", 0, "[anon:x]")]     # named: not .bss
    got = procfs.object_data(maps, lambda m: m.path == lib)         # unsorted in: sorted out
    assert [(m.begin, m.end) for m in got] == [(0x2000, 0x3000), (0x3000, 0x4000),
                                               (0x6000, 0x7000), (0x8000, 0x8800)]
    assert procfs.object_data(maps, lambda m: False) == []


def test_parse_cgroups_v1_memory_and_v2():
    text = ("12:pids:/a\n4:memory:/process_api/460e\n3:cpu,cpuacct:/\n1:name=systemd:/x\n"
            "0::/user.slice/app.scope\n")
    assert procfs.parse_cgroups(text) == ("/process_api/460e", "/user.slice/app.scope")
    assert procfs.parse_cgroups("0::/system.slice/nginx.service\n") == \
        (None, "/system.slice/nginx.service")
    assert procfs.parse_cgroups("5:cpuset,memory:/c\n") == ("/c", None)
    assert procfs.parse_cgroups("") == (None, None)


def test_cgroup_room_counts_inactive_file_cache_and_knows_no_limit():
    stat_v2 = ("anon 104857600\nfile 20971520\nshmem 2097152\nactive_file 10485760\n"
               "inactive_file 8388608\n")
    assert procfs.cgroup_room("209715200\n", "125829120\n", stat_v2) == \
        209715200 - 125829120 + 10485760 + 8388608
    # v1: the hierarchical total_ counts (its children's cache too)
    stat_v1 = ("cache 0\nactive_file 0\ninactive_file 4096\ntotal_active_file 2097152\n"
               "total_inactive_file 1048576\n")
    assert procfs.cgroup_room("1073741824", "1073741824", stat_v1) == 3145728
    assert procfs.cgroup_room("100", "300", "") == 0            # over its limit: none left
    assert procfs.cgroup_room("max\n", "5", "") is None
    assert procfs.cgroup_room("9223372036854771712\n", "5", "") is None     # v1's no limit


def _cgroup_dir(path, limit, usage, inactive_file=0):
    path.mkdir(parents=True, exist_ok=True)
    (path / "memory.max").write_text(f"{limit}\n")
    (path / "memory.current").write_text(f"{usage}\n")
    (path / "memory.stat").write_text(f"anon {usage}\ninactive_file {inactive_file}\n")


def test_memory_room_is_the_least_of_the_cgroup_and_its_ancestors(tmp_path, monkeypatch):
    # v2 mounted at tmp_path: the process in /a/b; /a's limit is the tighter one
    (tmp_path / "cgroup.controllers").write_text("cpu memory pids\n")
    _cgroup_dir(tmp_path / "a", 1 << 30, 900 << 20, 20 << 20)
    _cgroup_dir(tmp_path / "a" / "b", "max", 500 << 20)
    monkeypatch.setattr(procfs, "CGROUP_V2", (str(tmp_path),))
    monkeypatch.setattr(procfs, "CGROUP_V1_MEMORY", str(tmp_path / "no-v1"))
    monkeypatch.setattr(procfs, "_read_small", _files(tmp_path, "0::/a/b\n"))
    assert procfs.memory_room(1) == ((1 << 30) - (900 << 20) + (20 << 20), str(tmp_path / "a"))
    # inside a container with its own cgroup namespace: "/" is the container's cgroup
    _cgroup_dir(tmp_path, 512 << 20, 500 << 20)
    monkeypatch.setattr(procfs, "_read_small", _files(tmp_path, "0::/\n"))
    assert procfs.memory_room(1) == (12 << 20, str(tmp_path))
    (tmp_path / "memory.max").write_text("max\n")
    assert procfs.memory_room(1) is None            # no limit anywhere
    monkeypatch.setattr(procfs, "_read_small", _files(tmp_path, None))
    assert procfs.memory_room(1) is None            # no /proc/PID/cgroup: no cgroups


def _files(root, cgroup_text):
    """_read_small with /proc/PID/cgroup's text given (None: absent), other files read."""
    real = procfs._read_small

    def read(path):
        return cgroup_text if path.startswith("/proc/") else real(path)
    return read


MEMINFO = """MemTotal:       23069176 kB
MemFree:         1031256 kB
MemAvailable:   20245012 kB
Buffers:          355332 kB
SwapTotal:       2097148 kB
SwapFree:        1048576 kB
HugePages_Total:       0
Hugepagesize:       2048 kB
"""


def test_meminfo_room_is_available_memory_and_free_swap():
    assert procfs.meminfo_room(MEMINFO) == (20245012 + 1048576) * 1024
    no_swap = "\n".join(l for l in MEMINFO.splitlines() if not l.startswith("Swap"))
    assert procfs.meminfo_room(no_swap) == 20245012 * 1024
    assert procfs.meminfo_room("MemTotal: 1000 kB\nMemFree: 10 kB\n") is None   # Linux < 3.14
    with open("/proc/meminfo") as f:                # this machine's: a number, under its total
        text = f.read()
    total = int(text.split("MemTotal:")[1].split()[0]) << 10
    assert 0 < procfs.meminfo_room(text) <= total + (int(text.split("SwapTotal:")[1].split()[0]) << 10)


def test_an_environment_variable_from_an_environment_block():
    raw = b"HOME=/root\0LD_PRELOAD=/usr/lib/libjemalloc.so.2 /x/liba.so\0EMPTY=\0"
    assert procfs.parse_environ_var(raw, "LD_PRELOAD") == "/usr/lib/libjemalloc.so.2 /x/liba.so"
    assert procfs.parse_environ_var(raw, "EMPTY") == ""
    assert procfs.parse_environ_var(raw, "HOM") is None
    assert procfs.parse_environ_var(raw, "PATH") is None
