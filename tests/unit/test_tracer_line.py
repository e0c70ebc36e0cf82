"""_tracer's "go" line: the DEAD ranges word, on in-memory text."""
from memunreachable._tracer import format_ranges, parse_ranges
from memunreachable.mark import DeadWords, with_dead_ranges


def test_dead_ranges_round_trip_aligned_inwards():
    assert format_ranges([]) == "-" and parse_ranges("-") == []
    text = format_ranges([(0x1000, 0x5000), (0x7003, 0x700f)])
    assert text == "1000-5000,7003-700f"
    # 0x7003-0x700f holds no whole aligned word: dropped
    assert parse_ranges(text) == [(0x1000, 0x5000)]
    assert parse_ranges("1001-2007") == [(0x1008, 0x2000)]


def test_with_dead_ranges_merges_into_the_mask():
    dead = with_dead_ranges(DeadWords(ranges=[(0x1000, 0x1010)]), [(0x1008, 0x1100), (0x3000, 0x3008)])
    assert list(dead.ranges) == [(0x1000, 0x1100), (0x3000, 0x3008)]
    assert with_dead_ranges(None, []) is None
