"""Greedy outputs of the default pair (plain, speculative batched, speculative one by one, small), written to
JSON so two checkouts can be compared token for token (the redesign's parity check). Prints a summary.

    .venv/bin/python bench/greedy_parity.py [OUT.json, default bench/results/greedy_parity.json] [--against OTHER.json]

The comparison takes the token lists only (the machine / commit / date stamp differs between checkouts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.results_meta import write_results  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402

PROMPTS = ["def read_config(path):\n", "import json\n\ndef load(path):", "class Engine:\n    def step(self):",
           "for i in range(10):\n    print(", "def main():\n    args = ", "x = [i * i for i in"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", default=str(ROOT / "bench" / "results" / "greedy_parity.json"))
    ap.add_argument("--against", help="a file written by another checkout: exit 1 unless equal")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    large, small = ROOT / "models" / "tandem-tiny-l", ROOT / "models" / "tandem-tiny-s"
    out = {"plain": [o.outputs[0].token_ids for o in LLM(large).generate(PROMPTS, params)]}
    spec = LLM(large, draft_model=small, num_speculative_tokens=4)
    out["spec_batch"] = [o.outputs[0].token_ids for o in spec.generate(PROMPTS, params)]
    out["spec_single"] = [spec.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    out["small"] = [o.outputs[0].token_ids for o in LLM(small).generate(PROMPTS, params)]
    write_results(args.out, out, indent=None)
    print({k: sum(map(len, v)) for k, v in out.items()}, "tokens;", "speculative equals plain:",
          out["spec_batch"] == out["plain"] == out["spec_single"])
    if args.against:
        other = json.loads(Path(args.against).read_text())
        same = {k: other.get(k) for k in out} == out
        print("identical to", args.against, ":", same)
        return 0 if same else 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
