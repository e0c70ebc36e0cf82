"""Real programs nobody here wrote, checked by pid: no false leak.

PostgreSQL (Debian's `postgresql` package; installed with apt-get when missing): a cluster in a
temporary directory, unix socket only, run as the `postgres` user; the postmaster and an idle
backend (psql connected, waiting) are checked. RegisterBackgroundWorker keeps its 584-byte
worker struct on a list linked through the struct's last member, a word into the block's last
8 bytes (issue 23): it was reported leaked in every process.

Each has exactly one real leak, the environment array save_ps_display_args copies: glibc's
first setenv (pg_perm_setlocale) makes an array of its own and drops that one, so no word
holds it (its strings stay live through the new array). The test proves that block is the
copy by reading it: its words point at exactly the environment postgres was given.
(`postgres -D DIR` leaks one more block, the strdup of DIR in PostmasterMain's local
userDoption; PGDATA is used instead.)
"""
from __future__ import annotations

import glob
import os
import pwd
import shutil
import signal
import struct
import subprocess
import tempfile
import time

import pytest

from memunreachable import get_unreachable_memory

pytestmark = [pytest.mark.ptrace, pytest.mark.slow]

USER = "postgres"


def postgres_bin() -> str:
    """The directory of Debian's postgres binaries, installing the package if it is missing."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
    if not found:
        r = subprocess.run(["apt-get", "install", "-y", "-qq", "postgresql"],
                           env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"),
                           capture_output=True, text=True)
        found = sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres"))
        assert found, f"PostgreSQL is needed: `apt-get install postgresql` failed:\n{r.stderr}"
    return os.path.dirname(found[-1])


def read_words(pid: int, address: int, size: int) -> list:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(address)
        return [w for (w,) in struct.iter_unpack("<Q", f.read(size))]


def read_string(pid: int, address: int) -> str:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(address)
        return f.read(4096).split(b"\0", 1)[0].decode()


def pointed_strings(pid: int, address: int, size: int) -> list:
    """The strings a NULL-terminated array of char * at address points at."""
    words = read_words(pid, address, size)
    assert 0 in words, f"no NULL in the {size}-byte block at {address:#x}"
    return [read_string(pid, w) for w in words[:words.index(0)]]


def wait_for(predicate, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture
def cluster():
    """(postmaster pid, idle backend pid, the environment postgres was given)."""
    bindir = postgres_bin()
    pw = pwd.getpwnam(USER)
    top = tempfile.mkdtemp(prefix="mu-pg-")
    os.chown(top, pw.pw_uid, pw.pw_gid)
    data = os.path.join(top, "data")
    env = {"PATH": "/usr/bin:/bin", "PGDATA": data}
    as_user = dict(user=pw.pw_uid, group=pw.pw_gid, extra_groups=[], cwd=top, env=env)
    postmaster = psql = None
    try:
        subprocess.run([os.path.join(bindir, "initdb"), "-A", "trust", "-U", USER, "--no-sync",
                        "-E", "UTF8", "--locale=C"], check=True, capture_output=True, **as_user)
        postmaster = subprocess.Popen([os.path.join(bindir, "postgres"), "-k", top,
                                       "-c", "listen_addresses=", "-c", "fsync=off"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      **as_user)
        pidfile = os.path.join(data, "postmaster.pid")
        # postmaster.pid's last line (PM_STATUS) says "ready" once connections are accepted
        wait_for(lambda: os.path.exists(pidfile) and open(pidfile).read().split()[-1:] == ["ready"],
                 "the postmaster to accept connections")
        psql = subprocess.Popen([os.path.join(bindir, "psql"), "-At", "-h", top, "-U", USER,
                                 "-d", "postgres"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, **as_user)
        psql.stdin.write("SELECT pg_backend_pid();\n")
        psql.stdin.flush()
        backend = int(psql.stdout.readline())     # answered: the backend is idle now
        yield postmaster.pid, backend, env
    finally:
        if psql is not None:
            psql.stdin.close()
            psql.wait(30)
        if postmaster is not None:
            postmaster.send_signal(signal.SIGINT)          # fast shutdown
            postmaster.wait(60)
        shutil.rmtree(top)


def test_postgres_postmaster_and_idle_backend(cluster):
    postmaster, backend, env = cluster
    given = sorted(f"{k}={v}" for k, v in env.items())
    for pid in (postmaster, backend):
        info = get_unreachable_memory(limit=None, pid=pid)
        assert info.complete, info.incomplete
        leaks = [(leak.address, leak.size) for leak in info.leaks]
        assert len(leaks) == 1, f"pid {pid}: {[(hex(a), s) for a, s in leaks]}"
        (address, size), = leaks
        # the environment copy: len(env) + 1 pointers, rounded up to glibc's usable size
        assert size == max(24, (8 * (len(env) + 1) + 8 + 15) // 16 * 16 - 8)
        assert sorted(pointed_strings(pid, address, size)) == given
        assert (info.num_leaks, info.leak_bytes) == (1, size)
