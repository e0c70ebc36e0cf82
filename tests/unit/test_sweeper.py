"""Unit tests of the sweeper's pipe protocol and failure handling (no ptrace)."""
import os
import signal

import pytest

from memunreachable._errors import SweepError, UnsupportedTarget
from memunreachable.collect.leftovers import children_of
from memunreachable.sweep.sweeper import (HEADER, SweepEntry, SweepResult, decode, encode_error,
                                          encode_result, run_here, run_sweeper)


def sample():
    return SweepResult(10, 2000, 3, 144, 4096,
                       [SweepEntry(0x5555aaaa0010, 32, 2, 112, b"\x01" * 32),
                        SweepEntry(0x5555aaaa0100, 24, 0, 0, b"ab")],
                       {"allocator": {"name": "glibc", "version": "2.36"}})


def test_result_round_trip():
    got = decode(encode_result(sample()))
    assert got == sample()


def test_uncertain_entries_and_leak_addresses_round_trip():
    res = sample()
    res.leak_addresses = [0x5555aaaa0010, 0x5555aaaa0100, 0x5555aaaa0200]
    res.uncertain = [SweepEntry(0x5555aaaa0200, 72, 0, 0, b"\x07" * 32)]
    got = decode(encode_result(res))
    assert got.uncertain == res.uncertain and got.entries == res.entries
    assert got.leak_addresses == res.leak_addresses and got == res


def test_requested_sizes_and_indirect_leaks_round_trip():
    # issue 23: each entry's requested size and its indirect leaks, each with its own stack
    res = sample()
    head = res.entries[0]
    head.stack, head.stack_status, head.requested_size = (0x401234,), "recorded", 30
    head.num_indirect, head.indirect_size = 2, 112
    head.indirect = [SweepEntry(0x5555aaaa0040, 48, 0, 0, b"", stack=(0x401300, 0x401400),
                                stack_status="recorded", requested_size=41),
                     SweepEntry(0x5555aaaa0080, 64, 0, 0, b"", stack_status="table_full",
                                requested_size=64)]
    got = decode(encode_result(res))
    assert got == res
    assert got.entries[0].indirect[0].requested_size == 41
    assert got.entries[0].indirect[1].stack_status == "table_full"
    assert got.entries[1].num_indirect == 0 and got.entries[1].indirect == []


def test_error_round_trip_keeps_type_and_hint():
    with pytest.raises(UnsupportedTarget) as ei:
        decode(encode_error(UnsupportedTarget("jemalloc", hint="nothing was checked")))
    assert ei.value.hint == "nothing was checked"


def test_garbage_and_truncation_are_sweep_errors():
    msg = encode_result(sample())
    with pytest.raises(SweepError):
        decode(msg[:-1])
    with pytest.raises(SweepError):
        decode(b"XXXX" + msg[4:])
    with pytest.raises(SweepError):
        decode(msg[:HEADER.size - 1])


def test_run_sweeper_returns_result_from_child():
    assert run_sweeper(sample, timeout=10) == sample()


def test_run_sweeper_large_result_does_not_deadlock():
    big = SweepResult(entries=[SweepEntry(i * 16, 24, 0, 0, b"x" * 32) for i in range(50000)])
    assert len(run_sweeper(lambda: big, timeout=30).entries) == 50000


def test_sweeper_crash_is_reported():
    def crash():
        os.kill(os.getpid(), signal.SIGSEGV)
    with pytest.raises(SweepError, match="SIGSEGV"):
        run_sweeper(crash, timeout=10)


def test_sweeper_exception_becomes_sweep_error():
    def boom():
        raise ValueError("bad")
    with pytest.raises(SweepError, match="ValueError: bad"):
        run_sweeper(boom, timeout=10)


def test_the_sweeper_is_the_oom_killers_first_choice_and_the_checker_is_not():
    # it holds copies of the target's heap: under memory pressure it goes first
    def report():
        with open("/proc/self/oom_score_adj") as f:
            raise ValueError(f"oom_score_adj {f.read().strip()}")
    with open("/proc/self/oom_score_adj") as f:
        own = f.read().strip()
    with pytest.raises(SweepError, match="ValueError: oom_score_adj 1000$"):
        run_sweeper(report, timeout=10)
    with open("/proc/self/oom_score_adj") as f:
        assert f.read().strip() == own != "1000"


def test_a_sweeper_killed_while_the_oom_killer_ran_is_said_to_be_out_of_memory(monkeypatch):
    from memunreachable.collect import procfs
    kills = iter([7, 8])
    monkeypatch.setattr(procfs, "oom_kills", lambda: next(kills))

    def killed():
        os.kill(os.getpid(), signal.SIGKILL)
    with pytest.raises(SweepError, match=r"killed \(SIGKILL\) while the kernel's OOM killer ran") \
            as e:
        run_sweeper(killed, timeout=10)
    assert "free memory" in e.value.hint and "first choice" in e.value.hint
    kills = iter([7, 7])        # no OOM kill meanwhile: something else killed it
    with pytest.raises(SweepError, match=r"killed \(SIGKILL\) before sending") as e:
        run_sweeper(killed, timeout=10)
    assert "something outside memunreachable killed it" in e.value.hint


def test_sweeper_timeout_kills_child():
    import time

    def hang():
        time.sleep(60)

    def children() -> set:      # threads (background reapers) may end while it reads
        return set(children_of(os.getpid()))
    before = children()         # e.g. the in-process API's long-lived helper
    t0 = time.monotonic()
    with pytest.raises(SweepError, match="did not finish"):
        run_sweeper(hang, timeout=0.5)
    assert time.monotonic() - t0 < 5
    # the sweeper was killed and reaped (earlier tests' sweepers, reaped in the background
    # once they exit, may be gone too)
    assert children() <= before


def test_sweeper_that_sent_its_result_is_reaped_in_the_background():
    import time

    from memunreachable.sweep import sweeper

    def work():
        sweeper.retain_list().append(bytearray(64 << 20))   # kept until the sweeper exits
        return sample()
    assert sweeper.retain_list() is None                      # only inside a sweeper
    assert run_sweeper(work, timeout=10) == sample()
    sweeper.join_reapers(5)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        zombies = [p for p in os.listdir("/proc") if p.isdigit() and _zombie_child(int(p))]
        if not zombies:
            break
        time.sleep(0.05)
    assert zombies == []


def _zombie_child(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[0] == "Z" and int(fields[1]) == os.getpid()


def test_run_here_gives_what_the_sweeper_gives_and_restores_the_gc():
    import gc
    seen = []

    def work():
        seen.append((os.getpid(), gc.isenabled()))
        return sample()
    assert gc.isenabled()
    assert run_here(work) == run_sweeper(sample, timeout=10) == sample()
    assert seen == [(os.getpid(), False)] and gc.isenabled()


def test_run_here_errors_are_the_sweepers():
    import gc

    def unsupported():
        raise UnsupportedTarget("jemalloc", hint="nothing was checked")

    def boom():
        raise ValueError("bad")

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(UnsupportedTarget) as ei:
        run_here(unsupported)
    assert ei.value.hint == "nothing was checked"
    with pytest.raises(SweepError, match="ValueError: bad"):
        run_here(boom)
    with pytest.raises(KeyboardInterrupt):
        run_here(interrupted)
    assert gc.isenabled()
