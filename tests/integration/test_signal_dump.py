"""Issue 3: the log dump on signal, in a subprocess."""
import os
import signal
import subprocess
import sys
import time

import pytest

from inprocess_helpers import build_leaky, python_env

pytestmark = pytest.mark.ptrace

SCRIPT = r"""
import logging, sys, time, memunreachable
import leakytools as leaky
logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
memunreachable.enable_signal_dump()
addr, size = leaky.leak(34607016)
print("block", addr, size, flush=True)
ticks = 0
deadline = time.monotonic() + 60
while time.monotonic() < deadline:      # the main program keeps working during the dump
    ticks += 1
    time.sleep(0.001)
    if "done" in open(sys.argv[1]).read():
        break
print("ticks", ticks, flush=True)
"""


def test_sigusr2_logs_the_leak(tmp_path):
    flag = tmp_path / "flag"
    flag.write_text("")
    proc = subprocess.Popen([sys.executable, "-c", SCRIPT, str(flag)], env=python_env(build_leaky()),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        addr, size = map(int, proc.stdout.readline().split()[1:])
        os.kill(proc.pid, signal.SIGUSR2)
        deadline = time.monotonic() + 60
        log = ""
        while f"bytes unreachable at {addr:x}" not in log and time.monotonic() < deadline:
            log += os.read(proc.stderr.fileno(), 65536).decode()
        flag.write_text("done")
        out, err = proc.communicate(timeout=60)
        log += err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log
    assert f"memunreachable ERROR   {size} bytes unreachable at {addr:x}" in log
    assert f"{size} bytes in 1 unreachable allocation" in log
    assert int(out.split()[-1]) > 0
