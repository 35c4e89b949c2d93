"""How corpus.json was drawn: a seeded random sample of SchemaStore's catalog (src/schemas/json/*.json at
the commit named in README.md), files of at most 16 KB that parse as JSON objects. Run against a clone:

    python tests/data/schemastore/sample.py /path/to/schemastore > tests/data/schemastore/corpus.json
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED, COUNT, MAX_BYTES = 38, 120, 16 * 1024


def main(root: str) -> None:
    files = sorted(Path(root, "src", "schemas", "json").glob("*.json"))
    small = [f for f in files if f.stat().st_size <= MAX_BYTES]
    corpus = {}
    for f in random.Random(SEED).sample(small, len(small)):
        try:
            schema = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(schema, dict):
            corpus[f.name] = schema
        if len(corpus) == COUNT:
            break
    json.dump(dict(sorted(corpus.items())), sys.stdout, separators=(",", ":"), ensure_ascii=False)


if __name__ == "__main__":
    main(sys.argv[1])
