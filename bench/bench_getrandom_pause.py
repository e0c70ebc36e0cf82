"""bench_getrandom_pause.py: the pause of a check of a process that called getrandom() on
glibc 2.41+, against the same process that did not (issue 22).

Starts fixtures/getrandom_state.c in the trixie root (tests/distros.py: glibc 2.41; built
when missing) three times: "none" (no getrandom() call), "getrandom" (main and 2 threads
called it: glibc's MAP_DROPPABLE state page, VmFlags wf dd nr dp) and "wipe" (as getrandom,
plus a MADV_WIPEONFORK page of its own holding a block's only pointer: that one still needs
a second pause to copy it). Runs RUNS checks of each, in turn, and prints per fixture the
median pause (info.pause_ms: every pause of the check, the reap's included), the retakes,
and the ratio getrandom / none. Aim: within 10% (before issue 22 every getrandom check was
retaken: about 2x). --rule-off reads no mapping as getrandom state (the behaviour before).

    python bench/bench_getrandom_pause.py [--runs 31] [--root trixie] [--rule-off]
"""
import argparse
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import fixtures  # noqa: E402
from memunreachable.collect import memory  # noqa: E402
from memunreachable import unreachable

MODES = ("none", "getrandom", "wipe")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=31)
    ap.add_argument("--root", default="trixie")
    ap.add_argument("--rule-off", action="store_true",
                    help="no getrandom rule: every wipe-on-fork page is copied in a retake")
    args = ap.parse_args()
    if args.rule_off:
        memory.is_getrandom_state = lambda m, flags: False
    fxs = {mode: fixtures.start("getrandom_state", mode, root=args.root) for mode in MODES}
    pauses = {mode: [] for mode in MODES}
    retakes = {mode: 0 for mode in MODES}
    try:
        for mode, fx in fxs.items():                     # warm: imports, caches, the roots' files
            unreachable.check(fx.pid, limit=None)
        for _ in range(args.runs):
            for mode, fx in fxs.items():
                info = unreachable.check(fx.pid, limit=None, symbolize=False)
                if {l.address for l in info.leaks} != fx.addresses("leak"):
                    raise SystemExit(f"{mode}: leaks {[hex(l.address) for l in info.leaks]} "
                                     f"!= the planted {sorted(map(hex, fx.addresses('leak')))}")
                pauses[mode].append(info.pause_ms)
                retakes[mode] += info.retries
    finally:
        for fx in fxs.values():
            fx.finish()
    print(f"{args.runs} checks each in the {args.root} root"
          f"{' (rule off)' if args.rule_off else ''}:")
    for mode in MODES:
        p = sorted(pauses[mode])
        print(f"  {mode:10s} median pause {statistics.median(p):6.2f} ms  "
              f"(p10 {p[len(p) // 10]:.2f}, p90 {p[len(p) * 9 // 10]:.2f})  "
              f"retakes {retakes[mode]}/{args.runs}")
    ratio = statistics.median(pauses["getrandom"]) / statistics.median(pauses["none"])
    print(f"  ratio getrandom / none: {ratio:.3f} (aim <= 1.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
