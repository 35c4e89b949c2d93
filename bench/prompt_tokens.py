"""A chat prompt's token ids whole (`Tokenizer.encode`) against piece by cached piece (gateway/prompt_tokens.py) on
the shipped checkpoint's tokenizer, in-process: a long system prompt with a new user turn each time (the pieces
cache starts empty), a short new one-turn prompt each time, and one short prompt repeated. Every cached result
is checked equal to the whole encode first.

    .venv/bin/python bench/prompt_tokens.py [--prompts 3000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from engines.tokenizer import Tokenizer  # noqa: E402
from gateway.prompt_tokens import PieceEncoder  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "prompt_tokens.json"
SYSTEM = "You are a careful assistant. Answer in plain English, cite sources, and keep answers short. " * 10


def _us_per_call(fn, texts: list[str]) -> float:
    t0 = time.perf_counter()
    for text in texts:
        fn(text)
    return 1e6 * (time.perf_counter() - t0) / len(texts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=3000)
    args = ap.parse_args(argv)
    tok = Tokenizer.from_pretrained(ROOT / "models" / "tandem-tiny-s")

    def turn(i: int) -> str:
        return f"Question number {i}: what is {i} plus {i * 3}?"

    cases = {
        "system prompt + new user turn": [tok.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                                    {"role": "user", "content": turn(i)}])
                                          for i in range(args.prompts)],
        "new one-turn prompt": [tok.apply_chat_template([{"role": "user", "content": turn(i)}])
                                for i in range(args.prompts)],
        "repeated one-turn prompt": [tok.apply_chat_template([{"role": "user", "content": "Say hello."}])]
        * args.prompts,
    }
    rows = {}
    print(f"{'case':<32}{'whole us':>10}{'pieces us':>11}   ({args.prompts} prompts; load average "
          f"{os.getloadavg()[0]:.1f})")
    for name, texts in cases.items():
        check = PieceEncoder(tok)
        assert all(check.encode(t) == tok.encode(t) for t in texts[:200]), name
        whole = _us_per_call(tok.encode, texts)
        pieces = _us_per_call(PieceEncoder(tok).encode, texts)  # a fresh cache: the first of each piece is encoded
        rows[name] = {"whole_us": whole, "pieces_us": pieces, "chars": sum(map(len, texts)) / len(texts)}
        print(f"{name:<32}{whole:>10.1f}{pieces:>11.1f}")
    write_results(RESULTS, {"bench": "prompt_tokens", "prompts": args.prompts, "load_average": os.getloadavg(),
                            "cases": rows}, indent=1)
    print(f"wrote {RESULTS.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
