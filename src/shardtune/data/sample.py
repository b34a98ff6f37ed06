"""Reading the head of a data file without `datasets`: what `validate` checks and what a failed load explains.

`read_sample` reads at most SAMPLE_BYTES of a file (a few rows of a 1 GB jsonl cost the same as of a small one)
and returns its first rows with their line (text formats) or row (parquet) numbers. Problems are UserErrors
naming the file and the line, e.g. a truncated JSON line, an empty file, a row that is not an object.

The text formats may be compressed (`rows.jsonl.gz`, `.bz2`, `.xz`): large datasets are often shipped so, and
`datasets` reads them as they are. Here they are read through their codec; the suffix before the codec's names the
format (`data_suffix`).
"""
from __future__ import annotations

import bz2
import codecs
import csv
import gzip
import io
import json
import lzma
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from shardtune.errors import UserError

SUFFIX_TO_BUILDER = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".csv": "csv"}
SAMPLE_ROWS = 64
SAMPLE_BYTES = 4 << 20
BOM = b"\xef\xbb\xbf"
TEXT_SUFFIXES = (".jsonl", ".json", ".txt", ".csv")
COMPRESSION = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # what `datasets` decompresses itself
_TESTER = {".gz": "gzip", ".bz2": "bzip2", ".xz": "xz"}
KNOWN = ".jsonl, .json, .parquet, .txt or .csv (the text ones may end in .gz, .bz2 or .xz)"


def data_suffix(path: Path) -> str:
    """The suffix that names the format: '.jsonl' for rows.jsonl and rows.jsonl.gz; '' for an unknown one (a
    compressed parquet too: parquet compresses inside the file)."""
    if path.suffix in COMPRESSION:
        inner = Path(path.stem).suffix
        return inner if inner in TEXT_SUFFIXES else ""
    return path.suffix if path.suffix in SUFFIX_TO_BUILDER else ""


def open_data(file: Path) -> BinaryIO:
    """The file's bytes, decompressed when its suffix names a codec."""
    return COMPRESSION[file.suffix](file, "rb") if file.suffix in COMPRESSION else open(file, "rb")  # noqa: SIM115


def read_head(f: BinaryIO, file: Path, n: int) -> bytes:
    """Up to n bytes from an `open_data` stream; a broken compressed file is one line."""
    try:
        return f.read(n)
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise UserError(f"data.path: '{file}' cannot be decompressed ({str(e)[:120] or type(e).__name__}): "
                        f"check the file (`{_TESTER[file.suffix]} -t` tests it)") from None


@dataclass
class Sample:
    file: Path
    columns: list[str]
    rows: list[tuple[int, dict[str, Any]]]  # (line or row number, 1-based; the row)
    unit: str  # "line" or "row"


def data_files(path: Path) -> list[Path]:
    """The files `data.path` names: itself, or a folder's data files (recursively, sorted)."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if data_suffix(p) and p.is_file())
        if not files:
            raise UserError(f"data.path: no data files in '{path}': give files ending in {KNOWN}")
        if len({SUFFIX_TO_BUILDER[data_suffix(f)] for f in files}) > 1:  # one folder is read by one reader
            kinds = ", ".join(sorted({data_suffix(f) for f in files}))
            raise UserError(f"data.path: '{path}' mixes file types ({kinds}): keep one type per folder, or list the "
                            "files in data.path as a mix (a list of {path, format, weight})")
        return files
    if not data_suffix(path):
        raise UserError(f"data.path: '{path.name}' has an unknown suffix: use {KNOWN}")
    return [path]


def is_saved_dataset(path: Path) -> bool:
    """A folder `save_to_disk` wrote: a Dataset, or a DatasetDict (its splits in subfolders; training reads "train")."""
    return path.is_dir() and any((path / f).exists() for f in ("dataset_info.json", "state.json", "dataset_dict.json"))


def check_not_empty(file: Path) -> None:
    """An empty (or whitespace-only) file: one clear line instead of datasets' StopIteration."""
    size = file.stat().st_size
    empty = size == 0
    if not empty and data_suffix(file) != ".parquet" and (size <= SAMPLE_BYTES or file.suffix in COMPRESSION):
        with open_data(file) as f:
            head = read_head(f, file, SAMPLE_BYTES + 1)
        empty = len(head) <= SAMPLE_BYTES and not head.strip()
    if empty:
        raise UserError(f"data.path: '{file}' is empty: give a file with at least one row")


def read_sample(file: Path, limit: int = SAMPLE_ROWS) -> Sample:
    check_not_empty(file)
    kind = data_suffix(file)
    if kind == ".parquet":
        return _parquet(file, limit)
    with open_data(file) as f:
        head = read_head(f, file, SAMPLE_BYTES)
        # jsonl: a first line longer than the sample is one row, read whole. (A .json array written on one line is
        # parsed object by object from the sample instead: it may be the whole file.)
        while kind == ".jsonl" and b"\n" not in head and (more := read_head(f, file, SAMPLE_BYTES)):
            head += more
        at_end = not read_head(f, file, 1)
    skipped = len(BOM) if head.startswith(BOM) else 0  # what Notepad and Excel put first: every reader skips it
    head = head[skipped:]
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as e:
        if at_end or e.start < len(head) - 4:  # not just a character cut at the end of the sample
            raise not_utf8(file, head, e.start, offset=skipped) from None
        text = head[: e.start].decode("utf-8")
    if not at_end:  # the sample ends inside a line: drop that partial line
        text = text[: text.rfind("\n") + 1] if "\n" in text else text
    if kind in (".jsonl", ".json"):
        return _json(file, text, limit, complete=at_end)
    if kind == ".csv":
        reader = csv.DictReader(io.StringIO(text))
        rows = [(i + 2, dict(r)) for i, r in zip(range(limit), reader)]  # line 1 is the header
        return Sample(file, list(reader.fieldnames or []), rows, "line")
    lines = text.splitlines()[:limit]
    return Sample(file, ["text"], [(i + 1, {"text": ln}) for i, ln in enumerate(lines)], "line")


def not_utf8(file: Path, data: bytes, start: int, *, offset: int = 0, lines_before: int = 0) -> UserError:
    """The one line for a byte that is not UTF-8 at data[start] (`offset`: bytes of the file before `data`)."""
    line = lines_before + data.count(b"\n", 0, start) + 1
    hint = " (UTF-16: its byte-order mark)" if offset + start < 2 and data[:2] in (b"\xff\xfe", b"\xfe\xff") else ""
    return UserError(f"data.path: '{file}' line {line}, byte {offset + start}: not UTF-8 (byte {data[start]:#04x})"
                     f"{hint}: save the file as UTF-8")


def check_utf8(file: Path, chunk_bytes: int = 16 << 20) -> None:
    """The whole of a text data file decodes as UTF-8 (a leading BOM allowed). One pass at the speed of the disk
    (the decode is C): paid once per `prepare`, before datasets' reader, which would otherwise fail deep inside
    tokenization with a traceback or read a UTF-16 file as one invalid JSON line."""
    if data_suffix(file) not in TEXT_SUFFIXES:
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = lines = 0
    with open_data(file) as f:
        while chunk := read_head(f, file, chunk_bytes):
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as e:  # e.object: the bytes held from the last chunk (part of a character) + chunk
                held = len(e.object) - len(chunk)
                raise not_utf8(file, e.object, e.start, offset=offset - held, lines_before=lines) from None
            offset += len(chunk)
            lines += chunk.count(b"\n")
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise UserError(f"data.path: '{file}' line {lines + 1}, byte {offset}: not UTF-8 (the file ends inside a "
                            "character): save the file as UTF-8") from None


def _json(file: Path, text: str, limit: int, *, complete: bool) -> Sample:
    stripped = text.lstrip()
    if stripped.startswith("["):  # one JSON array of objects
        return _json_array(file, text, limit, complete=complete)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rows.append((n, parse_json_line(file, n, line)))
        if len(rows) == limit:
            break
    return Sample(file, _columns(r for _, r in rows), rows, "line")


def parse_json_line(file: Path, n: int, line: str) -> dict[str, Any]:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise UserError(f"data.path: '{file}' line {n}, column {e.colno}: invalid JSON ({e.msg}): fix or remove "
                        "that line (jsonl: one JSON object per line)") from None
    if not isinstance(row, dict):
        raise UserError(f"data.path: '{file}' line {n}: a row must be a JSON object {{...}}, got "
                        f"{type(row).__name__}")
    return row


def _json_array(file: Path, text: str, limit: int, *, complete: bool) -> Sample:
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    rows = []
    while len(rows) < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            break
        try:
            row, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if not complete and e.pos >= len(text) - 1:
                break  # the sample ends inside this object
            raise UserError(f"data.path: '{file}' line {e.lineno}, column {e.colno}: invalid JSON ({e.msg}): fix "
                            "the file") from None
        if not isinstance(row, dict):
            raise UserError(f"data.path: '{file}' line {text.count(chr(10), 0, pos) + 1}: each element of the JSON "
                            f"array must be an object {{...}}, got {type(row).__name__}")
        rows.append((text.count("\n", 0, pos) + 1, row))
        pos = end
    return Sample(file, _columns(r for _, r in rows), rows, "line")


def _parquet(file: Path, limit: int) -> Sample:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for a broken file
        raise UserError(f"data.path: '{file}' is not a readable parquet file ({str(e).splitlines()[0][:120]})") from None
    if pf.metadata.num_rows == 0:
        raise UserError(f"data.path: '{file}' is empty (0 rows): give a file with at least one row")
    batch = next(pf.iter_batches(batch_size=limit))
    return Sample(file, list(pf.schema_arrow.names), [(i + 1, r) for i, r in enumerate(batch.to_pylist())], "row")


def _columns(rows: Any) -> list[str]:
    seen: dict[str, None] = {}
    for r in rows:
        seen.update(dict.fromkeys(r))
    return list(seen)


def find_bad_json_line(file: Path) -> UserError | None:
    """The first line of a jsonl file that does not parse (a full scan: only after a load has failed)."""
    with io.TextIOWrapper(open_data(file), encoding="utf-8-sig", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    parse_json_line(file, n, line.rstrip("\r\n"))
                except UserError as e:
                    return e
    return None
