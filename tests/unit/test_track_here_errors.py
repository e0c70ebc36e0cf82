"""track_here.py without a routed process: a library that cannot load is a TrackingError
with a hint (never an OSError), and the error pickles with its errno and hint."""
import pickle

import pytest

from memunreachable import track_here
from memunreachable._errors import MemunreachableError, TrackingError


def test_missing_library_is_a_tracking_error(monkeypatch, tmp_path):
    monkeypatch.setattr(track_here, "LIBRARY", str(tmp_path / "_track.so"))
    monkeypatch.setattr(track_here, "_lib", None)
    with pytest.raises(TrackingError) as exc:
        track_here.start()
    assert isinstance(exc.value, MemunreachableError)
    assert "cannot load the tracking library" in str(exc.value)
    assert "reinstall" in exc.value.hint
    assert not track_here.active()
    track_here.stop()               # nothing started: nothing to undo
    assert not track_here.active()


def test_tracking_error_pickles():
    err = pickle.loads(pickle.dumps(TrackingError("no route", hint="do this", errno=13)))
    assert (type(err), str(err), err.hint, err.errno) == (TrackingError, "no route", "do this", 13)
