"""noleaks.LeakBaseline: which leaks of a check are new, on in-memory reports."""
from memunreachable.noleaks import LeakBaseline
from memunreachable.reporters.report import Leak, UnreachableMemoryInfo


def _info(*addresses):
    info = UnreachableMemoryInfo(pid=1, comm="x")
    info.leaks = [Leak(address=a, size=32) for a in addresses]
    return info


def test_new_leaks_are_those_missing_from_the_baseline():
    base = LeakBaseline([0x1000, 0x2000])
    assert [l.address for l in base.new_leaks(_info(0x1000, 0x3000))] == [0x3000]
    assert 0x2000 in base and 0x3000 not in base
    assert base.addresses == (0x1000, 0x2000)


def test_union_holds_the_leaks_of_both():
    seen = LeakBaseline([0x1000]) | LeakBaseline([0x3000])
    assert seen.addresses == (0x1000, 0x3000)
    assert [l.address for l in seen.new_leaks(_info(0x1000, 0x3000, 0x5000))] == [0x5000]


def test_no_raw_address_is_stored():
    # the keys are complemented: no set entry or stored hash equals a leak's address
    base = LeakBaseline([0x7F00_0000_1000])
    assert all(k != 0x7F00_0000_1000 and hash(k) != 0x7F00_0000_1000 for k in base._keys)


def test_a_leak_seen_with_its_size_matches_only_that_size():
    # a block once reported, freed later, can leave its address to another block that leaks:
    # the new leak has another size, and is new
    info = UnreachableMemoryInfo(pid=1, comm="x")
    info.leaks = [Leak(address=0x1000, size=32), Leak(address=0x2000, size=4104)]
    base = LeakBaseline.of(info.leaks)
    assert base.addresses == (0x1000, 0x2000) and 0x2000 in base and 0x3000 not in base
    later = UnreachableMemoryInfo(pid=1, comm="x")
    later.leaks = [Leak(address=0x1000, size=32), Leak(address=0x2000, size=80),
                   Leak(address=0x3000, size=32)]
    assert [(l.address, l.size) for l in base.new_leaks(later)] == [(0x2000, 80), (0x3000, 32)]
    # union with an address-only baseline: that one matches any size at its addresses
    both = base | LeakBaseline([0x3000])
    assert [(l.address, l.size) for l in both.new_leaks(later)] == [(0x2000, 80)]
    assert both.addresses == (0x1000, 0x2000, 0x3000)
    assert all(k != 0x1000 and hash(k) != 0x1000 and hash(k) != 0x2000 for k, _ in base._sized)
