"""Ctrl-C while a worker sets up (trainer/worker.py): exit 130 with the interrupt's one line, also when a library
turns the KeyboardInterrupt into an error of its own as it unwinds (omegaconf did: an AttributeError out of its
schema building, which the launcher reported as an internal error; seen in tests/integration/test_checkpoint.py's
ctrl-c-in-setup case)."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from shardtune.trainer import worker


@pytest.mark.parametrize("unwinds_as", [KeyboardInterrupt, AttributeError])
def test_ctrl_c_while_loading_the_recipe_is_exit_130(monkeypatch, capsys, unwinds_as):
    def load_recipe(path: str):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, delivered at the next bytecode
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            if unwinds_as is KeyboardInterrupt:
                raise
            raise AttributeError("'NoneType' object has no attribute '_invalidate_flags_cache'") from None
        raise AssertionError("SIGINT was not delivered")

    monkeypatch.setattr(worker, "load_recipe", load_recipe)
    monkeypatch.setattr(sys, "argv", ["worker", "recipe.yaml"])
    monkeypatch.setenv("RANK", "0")
    handler = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(SystemExit) as exit_:
            worker.main()
    finally:
        signal.signal(signal.SIGINT, handler)
        worker._SETUP_INTERRUPTS.clear()
    assert exit_.value.code == 130
    assert capsys.readouterr().err.strip() == (
        "shardtune: interrupted (Ctrl-C, SIGINT) before the first step; checkpoint: none")
