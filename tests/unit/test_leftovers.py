"""Unit tests of leftovers.py's pure parts: /proc stat fields, the record, leftover matching."""
from memunreachable.collect.leftovers import PAGE, Clone, Record, decode_record, match_leftovers
from memunreachable.collect.procfs import Stat, parse_stat


def ProcStat(pid, state, ppid, start, exit_signal):  # noqa: N802 - the fields leftovers uses
    return Stat(pid=pid, comm="x", state=state, ppid=ppid, flags=0, start=start,
                exit_signal=exit_signal)

# a zombie clone(0) child: comm with spaces and ")", exit_signal (field 38) 0
STAT = ("4242 (my (odd) prog) Z 4200 4200 4200 0 -1 4227148 0 0 0 0 0 0 0 0 20 0 1 0 "
        "987654 0 0 18446744073709551615 0 0 0 0 0 0 0 0 0 0 0 0 0 3 0 0 0 0 0 0 0 0 0 0 0 0 0")


def test_parse_stat_fields():
    st = parse_stat(STAT)
    assert (st.pid, st.comm, st.state, st.ppid, st.start, st.exit_signal) == \
        (4242, "my (odd) prog", "Z", 4200, 987654, 0)
    normal = STAT.replace(" 0 3 0 0 0", " 17 3 0 0 0")      # exit_signal SIGCHLD
    assert parse_stat(normal).exit_signal == 17


def test_parse_stat_short_line():
    try:
        parse_stat("1 (x) S 0 1")
    except ValueError:
        return
    raise AssertionError("a short line must raise ValueError")


def test_record_round_trip_is_whole_pages():
    rec = Record(target=10, target_start=500, checker=11, checker_start=600,
                 clones=[Clone(12, 700)], windows=[(690, 900)])
    data = rec.encode()
    assert len(data) == PAGE and data.rstrip(b" ").endswith(b"}")
    assert decode_record(data) == rec
    big = Record(10, 500, clones=[Clone(100000 + i, 10 ** 9 + i) for i in range(300)])
    assert len(big.encode()) % PAGE == 0 and decode_record(big.encode()) == big


def test_decode_record_rejects_garbage():
    assert decode_record(b"") is None
    assert decode_record(b" " * PAGE) is None
    assert decode_record(b'{"version": 99, "target": 1, "target_start": 2}') is None
    assert decode_record(b'{"version": 1, "target": 1') is None
    assert decode_record(b"\xff\xfe") is None


def test_match_leftovers_named_or_in_window_and_exit_signal_0():
    target = 100
    stats = {
        201: ProcStat(201, "Z", target, 5000, 0),    # named, same start: a leftover
        202: ProcStat(202, "Z", target, 5001, 0),    # named, but another start: pid reused
        203: ProcStat(203, "Z", target, 6050, 0),    # born inside the window
        204: ProcStat(204, "Z", target, 6050, 17),   # in the window but a fork (SIGCHLD)
        205: ProcStat(205, "Z", target, 7000, 0),    # the program's own clone(0): not recorded
        206: ProcStat(206, "Z", 999, 5000, 0),       # not a child of the target
    }
    inherited = [Clone(201, 5000), Clone(202, 4000), Clone(206, 5000)]
    found = match_leftovers(target, stats, inherited, [(6000, 6100)])
    assert [p for p, _ in found] == [201, 203]
    assert match_leftovers(target, stats, [], []) == []
