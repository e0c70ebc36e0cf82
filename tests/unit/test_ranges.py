"""merge_ranges, subtract_ranges and RangeCutter (memunreachable/_types.py) against a
byte-by-byte model, on fixed and random ranges."""
import random

from memunreachable._types import Range, RangeCutter, merge_ranges, subtract_ranges


def covered(ranges) -> set:
    return {a for r in ranges for a in range(r.begin, r.end)}


def runs(addresses: set) -> list:
    """Maximal runs of consecutive addresses, as Ranges, ascending."""
    out = []
    for a in sorted(addresses):
        if out and out[-1].end == a:
            out[-1] = Range(out[-1].begin, a + 1)
        else:
            out.append(Range(a, a + 1))
    return out


def test_fixed_cases():
    assert merge_ranges([Range(5, 9), Range(0, 3), Range(3, 4), Range(8, 12), Range(7, 7)]) == \
        [Range(0, 4), Range(5, 12)]
    cut = RangeCutter([Range(10, 20), Range(15, 30), Range(40, 45)])
    assert cut(Range(0, 50)) == [Range(0, 10), Range(30, 40), Range(45, 50)]
    assert cut(Range(12, 28)) == []
    assert cut(Range(20, 35)) == [Range(30, 35)]
    assert cut(Range(45, 46)) == [Range(45, 46)]
    assert RangeCutter([])(Range(1, 2)) == [Range(1, 2)]


def test_random_ranges_match_the_model():
    rng = random.Random(8)
    for _ in range(300):
        base = [Range(b, b + rng.randrange(0, 12)) for b in (rng.randrange(0, 80) for _ in range(rng.randrange(0, 6)))]
        holes = [Range(b, b + rng.randrange(0, 15)) for b in (rng.randrange(0, 80) for _ in range(rng.randrange(0, 8)))]
        assert merge_ranges(base) == runs(covered(base))
        want = runs(covered(base) - covered(holes))
        assert subtract_ranges(base, holes) == want
        cut = RangeCutter(holes)
        for r in base:
            assert cut(r) == runs(covered([r]) - covered(holes))
