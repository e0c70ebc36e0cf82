"""_tracer.py: the helper process of an in-process check (python -m memunreachable._tracer).

The caller (noleaks.py) starts us with a result fd and a control pipe on stdin. We wait for
"go" (sent after the caller's prctl(PR_SET_PTRACER, our pid)), run the ordinary check
pipeline against the caller (freeze, clone snapshot, thaw, sweep, reap), and write one
pickled message back: ("ok", UnreachableMemoryInfo) or ("error", MemunreachableError).
The caller sits in a blocking read on the result fd meanwhile, so it holds no GIL and no
allocator lock while its threads are frozen.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pid", type=int, required=True)
    ap.add_argument("--fd", type=int, required=True)
    ap.add_argument("--limit", type=int, default=-1)
    ap.add_argument("--timeout", type=float, default=2.0)
    args = ap.parse_args(argv)
    if sys.stdin.buffer.read(3) != b"go\n":
        return 2
    try:
        from memunreachable.unreachable import check
        info = check(args.pid, limit=None if args.limit < 0 else args.limit, timeout=args.timeout)
        msg = ("ok", info)
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the caller
        from memunreachable._errors import MemunreachableError, SweepError
        if not isinstance(exc, MemunreachableError):
            exc = SweepError(f"in-process check failed: {type(exc).__name__}: {exc}")
        msg = ("error", exc)
    data = pickle.dumps(msg)
    view = memoryview(data)
    while view:
        view = view[os.write(args.fd, view):]
    os.close(args.fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
