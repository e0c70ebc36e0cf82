"""Memos the sweep keeps between checks of one process (the pytest plugin's helper checks the
test process after every test): they must follow the process's mapped files. A library
dlopen'ed between two checks changes the files: linkmaps' memo (r_debug, l_gnu_chain_zero per
object) is rebuilt, and the words it gives equal a computation without any memo."""
import os
import subprocess
import sys
import textwrap

import pytest

from memunreachable.collect import procfs
from memunreachable.heaps.glibc import linkmaps
from memunreachable.unreachable import check

pytestmark = pytest.mark.ptrace

LIB = r"""
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
/* imports: undefined symbols at the head of .dynsym (symoffset > 0) */
int memo_probe(const char *s) { char *p = malloc(strlen(s) + 1); strcpy(p, s); puts(p); free(p); return 1; }
"""

TARGET = textwrap.dedent(r'''
    import ctypes, sys
    sys.stdout.write("ready\n"); sys.stdout.flush()
    sys.stdin.readline()
    lib = ctypes.CDLL(sys.argv[1])
    sys.stdout.write("loaded\n"); sys.stdout.flush()
    sys.stdin.readline()
''')


@pytest.fixture
def target(tmp_path):
    src = tmp_path / "memo_probe.c"
    src.write_text(LIB)
    so = tmp_path / "libmemo_probe.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-Wl,--hash-style=gnu", "-o", str(so), str(src)],
                   check=True)
    p = subprocess.Popen([sys.executable, "-c", TARGET, str(so)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "ready\n"
    yield p, str(so)
    p.kill()
    p.wait()


def test_linkmaps_memo_follows_a_dlopen_between_checks(target, monkeypatch):
    p, so = target
    seen, texts = [], []
    real = linkmaps.of_process

    def spy(mem, pid, maps=None):
        found = real(mem, pid, maps)
        fresh = linkmaps.computed_words(mem, procfs.read_auxv(pid))         # no memo at all
        seen.append((found, fresh, linkmaps._MEMO.key, dict(linkmaps._MEMO.chain_zero)))
        texts.append({linkmaps._c_string(mem, a) for a, _ in found.string_tails})
        return found

    monkeypatch.setattr(linkmaps, "of_process", spy)
    for _ in range(2):                                  # the second check uses the memo
        assert check(p.pid, sweep_here=True).num_leaks == 0
    # (a check whose snapshot is retaken, as under load, sweeps and asks once more)
    assert len(seen) >= 2
    (w1, f1, k1, c1), (w2, f2, k2, c2) = seen[0], seen[-1]
    assert w1 == f1 and w2 == f2 and w1 == w2 and k1 == k2 and c1 == c2
    before = len(texts)
    p.stdin.write("\n")
    p.stdin.flush()
    assert p.stdout.readline() == "loaded\n"
    assert check(p.pid, sweep_here=True).num_leaks == 0
    w3, f3, k3, c3 = seen[-1]
    assert k3 != k2                                     # the mapped files changed: a new memo
    assert any(path == so for path, *_ in k3) and not any(path == so for path, *_ in k2)
    assert w3 == f3 and len(w3.words) == len(w2.words) + 1     # the new object's link map word
    # and its two path strings: l_name (the path) and l_origin (its directory)
    assert len(w3.string_tails) == len(w2.string_tails) + 2
    assert {so.encode(), os.path.dirname(so).encode()} <= texts[-1] - texts[before - 1]
    base = min(m.begin for m in procfs.read_maps(p.pid) if m.path == so)
    assert [v for (l_addr, _), v in c3.items() if l_addr == base] != [None]
    assert set(c3) - set(c2) == {(l_addr, l_ld) for l_addr, l_ld in c3 if l_addr == base}
