"""Text documents of realistic length for bench/gpu_session.sh: a jsonl of {"text": ...} rows whose lengths follow a
log-normal around ~600 characters, clipped to [120, 3,000]. With the recipes' default tokenizer (builtin:char, one
token per character) that is hundreds of tokens a document, so a packed 4,096-token row holds ~6 documents, as
instruction data does, not the ~97 of builtin:reverse's 21-token documents (the per-document attention work and
the varlen call's document count are those of real data). Random words, seeded: nothing downloaded.

    python bench/gpu_data.py OUT.jsonl --docs 3000
"""
from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "so", "ta", "vi", "ze", "pu", "ran", "dor", "sel", "tum", "qua", "bex"]
MEDIAN_CHARS, SIGMA, MIN_CHARS, MAX_CHARS = 600, 0.6, 120, 3000


def document(rng: random.Random) -> str:
    target = min(MAX_CHARS, max(MIN_CHARS, int(rng.lognormvariate(math.log(MEDIAN_CHARS), SIGMA))))
    words: list[str] = []
    size = 0
    while size < target:
        word = "".join(rng.choices(SYLLABLES, k=rng.randint(1, 4)))
        words.append(word)
        size += len(word) + 1
    sentences = [" ".join(words[i:i + 12]).capitalize() + "." for i in range(0, len(words), 12)]
    return " ".join(sentences)


def write(path: Path, num_docs: int, *, seed: int = 0) -> Path:
    rng = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for _ in range(num_docs):
            f.write(json.dumps({"text": document(rng)}) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--docs", type=int, default=3000)
    args = parser.parse_args()
    write(args.out, args.docs)
    lengths = [len(json.loads(x)["text"]) for x in args.out.read_text().splitlines()]
    lengths.sort()
    print(f"{args.out}: {len(lengths)} documents, {sum(lengths):,} characters, median {lengths[len(lengths) // 2]}, "
          f"min {lengths[0]}, max {lengths[-1]}")


if __name__ == "__main__":
    main()
