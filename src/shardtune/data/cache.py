"""Where a tokenized dataset lives on disk, what names it, and how it is committed.

A cache entry is the directory `<root>/<key>/`; it is trusted only when `manifest.json` is in it, and the manifest
is written last, inside a private temp dir that is then renamed into place in one `os.rename`. So:
- a killed build leaves only `<root>/.tmp-<key>-<host>-<pid>-<rand>/`, which no reader looks at (and a later
  build sweeps away once it is a day old: a dead build on another node cannot be told from a slow one sooner);
- two concurrent builders each write their own temp dir; the first rename wins, the second finds the entry
  there (rename onto a non-empty dir fails) and drops its copy. No lock, so nothing to go stale after a crash;
  the cost of a race is one duplicated build.

The key hashes everything that changes the result: the data files' names, sizes and mtimes (not their bytes:
hashing 10 GB of jsonl would cost as much as tokenizing it; an in-place edit that keeps size and mtime is not
seen), the tokenizer's full serialised state, format, field keys and template, seq_len, packing, eval_fraction, the seed and
CACHE_VERSION. Bump CACHE_VERSION whenever the build's output changes for the same inputs.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
import uuid
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from shardtune.config.data_keys import ENTRY_KEYS
from shardtune.config.schema import DataConfig

CACHE_VERSION = 3  # 2: instruction templates (a separator after the prompt), input/chat fields; 3: preference
# prompts rendered with data.template
MANIFEST = "manifest.json"
STALE_TEMP_S = 24 * 3600


def cache_root(cfg: DataConfig, output_dir: str | os.PathLike | None) -> Path:
    """`data.cache_dir`, else `<output_dir>/data_cache`, else a shared dir under the system temp dir (library use)."""
    if cfg.cache_dir:
        return Path(cfg.cache_dir)
    if output_dir is not None:
        return Path(output_dir) / "data_cache"
    import tempfile

    return Path(tempfile.gettempdir()) / "shardtune-data-cache"


def source_fingerprint(cfg: DataConfig, seed: int) -> list[Any]:
    """What identifies the raw rows: each file's relative name, size and mtime (a folder: every file in it)."""
    assert cfg.path is not None
    if cfg.path.startswith("builtin:"):
        return [cfg.path, cfg.num_samples, seed]  # generated from (name, count, seed) alone
    path = Path(cfg.path)
    if not path.exists():
        return [str(path), "missing"]  # the build reports it; the key only needs to differ
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out: list[Any] = [str(path.resolve())]
    for f in files:
        st = f.stat()
        out.append([str(f.relative_to(path)) if path.is_dir() else f.name, st.st_size, st.st_mtime_ns])
    return out


def tokenizer_fingerprint(tok: PreTrainedTokenizerBase) -> str:
    """A hash of the tokenizer's behaviour: the fast tokenizer's JSON (vocab, merges, normalizer, pre-tokenizer),
    the special tokens and the chat template. Two copies of the same tokenizer in different folders share a key."""
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps([type(tok).__name__, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, len(tok),
                         tok.chat_template or ""], default=str).encode())
    return h.hexdigest()


def cache_key(cfg: DataConfig, tok: PreTrainedTokenizerBase, seed: int) -> str:
    fields = {"version": CACHE_VERSION, "source": source_fingerprint(cfg, seed), "tokenizer": tokenizer_fingerprint(tok),
              "format": cfg.format, "fields": {k: getattr(cfg, k) for k in ENTRY_KEYS},
              "seq_len": cfg.seq_len, "packing": cfg.packing, "eval_fraction": cfg.eval_fraction, "seed": seed,
              # only when not the default: the caches built before this key keep their keys
              **({"long_docs": cfg.long_docs} if cfg.long_docs != "truncate" else {})}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()[:20]


def read_manifest(entry: Path) -> dict[str, Any] | None:
    """The entry's manifest, or None when the entry is absent (or was never completed)."""
    try:
        return json.loads((entry / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError):
        return None


def new_temp_dir(root: Path, key: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    _sweep_stale(root)
    tmp = root / f".tmp-{key}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def commit(tmp: Path, entry: Path, manifest: dict[str, Any]) -> Path:
    """Write the manifest last, then rename the temp dir into place. Loses a race gracefully: the winner's entry
    has the same key, hence the same content, so this builder's copy is deleted."""
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    try:
        os.rename(tmp, entry)
    except OSError:
        if read_manifest(entry) is None:  # something that is not a finished entry sits there: not ours to delete
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
    return entry


def _sweep_stale(root: Path) -> None:
    now = time.time()
    for p in root.glob(".tmp-*"):
        try:
            if now - p.stat().st_mtime > STALE_TEMP_S:
                shutil.rmtree(p, ignore_errors=True)
        except FileNotFoundError:
            pass
