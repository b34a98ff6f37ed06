"""What only a process of its own shows: a data build SIGKILLed half-way (nothing can clean up after it), and what a
fresh interpreter imports (the demo's builtin data needs neither `datasets` nor pandas). Moved from
tests/unit/test_data_cache.py, which stays in-process."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from shardtune.data import build_data
from tests.unit.test_data_cache import TOK, _cfg, _entries, _rows, _write


def test_killed_build_leaves_no_trusted_cache(tmp_path):
    cfg = _cfg(tmp_path, _write(tmp_path / "d.jsonl", _rows(60)))
    # SIGKILL after the documents are tokenized, before the manifest and the rename: nothing can clean up.
    code = textwrap.dedent(f"""
        import json, os, signal
        from shardtune.config.schema import DataConfig
        from shardtune.data.char_tokenizer import build_char_tokenizer
        from shardtune.data.pipeline import build_data
        cfg = DataConfig(**json.loads({json.dumps(json.dumps(vars(cfg)))}))
        build_data(cfg, build_char_tokenizer(), seed=0,
                   progress=lambda done, total: os.kill(os.getpid(), signal.SIGKILL))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-2000:]
    root = tmp_path / "cache"
    leftovers = list(root.glob(".tmp-*"))
    assert leftovers and list(leftovers[0].glob("docs-*.arrow")) and _entries(root) == []
    data = build_data(cfg, TOK, seed=0)  # the half build is ignored: a full build, then a usable entry
    assert data.built and len(data.train) > 0
    os.utime(leftovers[0], (0, 0))  # a day-old temp dir is swept by the next build
    build_data(_cfg(tmp_path, tmp_path / "d.jsonl", seq_len=40), TOK, seed=0)
    assert not leftovers[0].exists()


def test_builtin_tasks_build_without_datasets(tmp_path):
    """Builtin tasks are tokenized in-process with pyarrow: the demo's first run imports neither `datasets` nor
    pandas, not even for its first batch (that the rows equal the `datasets.map` path: tests/unit/test_data_cache.py)."""
    script = textwrap.dedent(f"""
        import sys
        from shardtune.config.schema import DataConfig
        from shardtune.data import build_data
        from shardtune.data.char_tokenizer import build_char_tokenizer
        data = build_data(DataConfig(path="builtin:sort", format="instruction", seq_len=40, num_samples=300,
                                     eval_fraction=0.1, cache_dir={str(tmp_path / 'sub')!r}), build_char_tokenizer(), seed=0)
        assert data.built and len(data.train) > 0
        data.train.take([0, 1])
        print("datasets" in sys.modules, "pandas" in sys.modules)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "False False"
