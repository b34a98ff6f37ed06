"""startup.imports_without_gc: the collector is off while the stack imports, and on again after (the outermost of
nested uses decides); a collector that was off stays off."""
from __future__ import annotations

import gc

from shardtune.startup import imports_without_gc


def test_collector_off_inside_and_restored_after() -> None:
    assert gc.isenabled()
    with imports_without_gc():
        assert not gc.isenabled()
        with imports_without_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner use left it to the outer one
    assert gc.isenabled()


def test_collector_back_on_after_an_error_and_off_stays_off() -> None:
    try:
        with imports_without_gc():
            raise KeyboardInterrupt  # Ctrl-C during the imports (the worker turns it into exit 130)
    except KeyboardInterrupt:
        pass
    assert gc.isenabled()
    gc.disable()
    try:
        with imports_without_gc():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
