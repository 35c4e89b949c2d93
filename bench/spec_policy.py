"""Adaptive k replayed on recorded greedy traces: the policy's speedup at one greedy stream without this host's
timing noise, so that a change to the policy can be told from the machine's drift (the same engine moves
10-30% between runs here, and bench/speculative.py needs many pairs to show a 5% change).

Record (cached in ~/.cache/tandem/spec_policy/): for each prompt, tandem-tiny-l's greedy continuation, and at
every position of it tandem-tiny-s's (w8a8, as the drafter runs it) greedy next `k_max` tokens. A window of k
drafts at position t accepts the leading drafts that equal the target's tokens there: greedy verification is
a function of the two models, not of timing, so the replay knows each window's outcome exactly.

Costs: measured once in this process by the real speculative engine at batch 1 (its own cost models after
runs pinned at every k, and plain decoding's multi-step steps): a plain token, a whole drafting step at each k,
a draft pass, a target pass by tokens.

Replay: the real `SpeculativeDecoder._choose` / `_select` and `AdaptiveK` decide every step of each prompt, one
prompt after another on one decoder (as the engine serves them), fed the step costs above with seeded noise
(a slow drift, as this host shows, and per-step jitter) and the exact window outcomes. Reported per prompt
set: the geometric mean over prompts of plain time / speculative time, for adaptive k and for every pinned k.
"bench" prompts are bench/speculative.py's batch-1 prompts; "fresh" prompts are other held-out windows that
no setting was tuned on.

    .venv/bin/python bench/spec_policy.py [--prompts 24] [--max-tokens 128] [--noise 0.1] [--seeds 3]
        [--draft-step-scale 1.0 0.8]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.results_meta import write_results  # noqa: E402
from bench.speculative import LARGE, SMALL, prompts_from_heldout  # noqa: E402
from engines import LLM, SamplingParams  # noqa: E402
from engines.spec.decoder import SpeculativeDecoder  # noqa: E402

CACHE = Path.home() / ".cache" / "tandem" / "spec_policy"
MULTI_STEP = 4  # plain greedy decoding takes this many tokens per step (engines.step_plan.MULTI_STEP_TOKENS)


def record(prompts: list[list[int]], max_tokens: int, k_max: int) -> list[dict]:
    """Per prompt: the target's greedy output and the draft's greedy k_max tokens at each output position."""
    key = hashlib.sha256(json.dumps([prompts, max_tokens, k_max]).encode()).hexdigest()[:16]
    path = CACHE / f"traces-{key}.json"
    if path.exists():
        return json.loads(path.read_text())
    target = LLM(LARGE, max_num_seqs=64)
    draft = LLM(SMALL, max_num_seqs=64, quantization="w8a8")
    out = []
    for p in prompts:
        res = target.generate([{"prompt_token_ids": p}],
                              SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        toks = list(res[0].outputs[0].token_ids)
        ctxs = [{"prompt_token_ids": p + toks[:t]} for t in range(1, max_tokens)]
        wins = draft.generate(ctxs, SamplingParams(temperature=0, max_tokens=k_max, ignore_eos=True))
        out.append({"prompt": p, "output": toks, "windows": [list(w.outputs[0].token_ids) for w in wins]})
    CACHE.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out))
    return out


def measure_costs(prompts: list[list[int]], max_tokens: int, k_max: int, repeats: int = 4) -> dict:
    """Batch-1 greedy costs on the engine's step clock, from the real speculative engine pinned at each k in
    turn (interleaved, so that the host's drift moves every k alike): the median thread time of a steady step
    at each k (k = 0: a plain multi-step step, per token), of a draft pass, and of the target's pass by tokens
    (its own cost model). Medians of many steps: this host moves single runs by 10-30%."""
    spec = LLM(LARGE, draft_model=SMALL, num_speculative_tokens=k_max, max_num_seqs=64,
               draft_options={"quantization": "w8a8"})
    eng = spec.engine
    ad = eng.speculator.adaptive
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    samples: dict[int, list[float]] = {k: [] for k in range(k_max + 1)}
    for rep in range(repeats + 1):
        for p in prompts:
            for k in range(k_max + 1):
                ad.fixed = k
                eng.add_request(p, params, f"cost-{rep}-{k}-{len(samples[k])}")
                while eng.has_work():
                    t0 = time.thread_time()
                    n = eng.step()
                    dt = time.thread_time() - t0
                    if not rep:  # warm-up
                        continue
                    if k == 0 and n == MULTI_STEP:
                        samples[0].append(dt / n)
                    elif k and n == k + 1 and not eng.speculator.drafter.caught_up:
                        samples[k].append(dt)
    ad.fixed = None
    return {"step": [statistics.median(samples[k]) for k in range(k_max + 1)],
            "target": {int(round(x)): y for x, y in sorted(ad.target.points.values())},
            "draft": ad.draft.estimate(1), "samples": {k: len(v) for k, v in samples.items()}}


@dataclass(eq=False)
class _Params:
    speculative: bool | None = None


@dataclass(eq=False)
class _Request:
    params: _Params


@dataclass(eq=False)
class _Seq:
    """What `_choose` and `_select` read of a Sequence."""
    seq_id: int
    num_tokens: int
    max_len: int
    computed_by_draft: int = 0
    draft_accepted: float = 0.0
    draft_rejected: float = 0.0
    draft_seen_at: int = 0
    draft_probes: int = 0
    probe_idle_until: int = 0

    def __post_init__(self):
        self.request = _Request(_Params())


class _Drafter:
    @staticmethod
    def lag(seq: _Seq) -> int:
        return seq.num_tokens - seq.computed_by_draft


class _Noise:
    """A multiplicative factor per observation: a slow AR(1) drift in log space, and per-step jitter."""

    def __init__(self, sigma: float, seed: int):
        self.rng = random.Random(seed)
        self.sigma = sigma
        self.drift = 0.0

    def __call__(self) -> float:
        self.drift = 0.98 * self.drift + self.rng.gauss(0.0, self.sigma * 0.2)
        return math.exp(self.drift + self.rng.gauss(0.0, self.sigma))


def replay(traces: list[dict], costs: dict, k_max: int, fixed: int | None, noise: _Noise) -> list[float]:
    """Speculative over plain time per trace: one decoder serving the traces one after another."""
    dec = SpeculativeDecoder(_Drafter(), k_max, set(), clock=lambda: 0.0, on_error=lambda *a: None)
    ad = dec.adaptive
    ad.fixed = fixed
    step, draft = costs["step"], costs["draft"]
    tpts = sorted(costs["target"].items())

    def target_s(n: int) -> float:  # the target pass by tokens, interpolated as the engine's model reads it
        for (x0, y0), (x1, y1) in zip(tpts, tpts[1:]):
            if n <= x1:
                return y0 + (y1 - y0) * (n - x0) / max(x1 - x0, 1)
        return tpts[-1][1] * n / tpts[-1][0]

    ratios = []
    for i, tr in enumerate(traces):
        out, wins, plen = tr["output"], tr["windows"], len(tr["prompt"])
        n_out = len(out)
        # the prefill step gave the first token (the same for both); the drafter has seen nothing of this prompt
        seq = _Seq(seq_id=i, num_tokens=plen + 1, max_len=plen + n_out)
        ad.target.observe(plen, target_s(plen) * noise())
        spent = 0.0
        while seq.num_tokens < seq.max_len:
            t = seq.num_tokens - plen  # output tokens so far; a window drafts out[t:]
            left = seq.max_len - seq.num_tokens
            k = dec._choose([seq])
            picked = dec._select([seq], k) if k else []
            if picked:
                k = picked[0][1]
                lag = _Drafter.lag(seq)
                s = step[k] + (target_s(lag) * draft / target_s(1) if lag > 2 else 0.0)
                f = noise()
                spent += s * f
                if lag > 2:
                    ad.unsteady()
                else:
                    for _ in range(k):
                        ad.draft.observe(1, draft * f)
                ad.target.observe(k + 1, target_s(k + 1) * f)
                ad.observe_step(1, k, s * f)
                w = wins[t - 1]
                acc = 0
                while acc < k and w[acc] == out[t + acc]:
                    acc += 1
                seq.num_tokens += acc + 1
                a0, r0 = dec.own_counts(seq)
                seq.draft_accepted, seq.draft_rejected = a0 + acc, r0 + (acc < k)
                seq.draft_seen_at = seq.num_tokens
                dec._record(k, acc, True)
                seq.computed_by_draft = seq.num_tokens - 1
            else:  # plain decoding: a multi-step step (a single one for the last token)
                n = min(MULTI_STEP, left)
                f = noise()
                spent += n * step[0] * f
                dec.observe_plain_steps(1, n, n * target_s(1) * f, n * step[0] * f)
                seq.num_tokens += n
        ratios.append((n_out - 1) * step[0] / spent)
    return ratios


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24, help="fresh prompts (bench's 6 come besides)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--noise", type=float, default=0.1, help="per-step jitter sigma (log space); drift is a fifth")
    ap.add_argument("--seeds", type=int, default=3, help="noise seeds per replay")
    ap.add_argument("--draft-step-scale", type=float, nargs="+", default=[1.0],
                    help="what if a drafting step cost this share of the measured one (plain decoding unchanged)")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "spec_policy.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    tok = LLM(LARGE, max_num_seqs=1).tokenizer
    sets = {"bench": prompts_from_heldout(tok, 6, args.prompt_tokens, seed=1),
            "fresh": prompts_from_heldout(tok, args.prompts, args.prompt_tokens, seed=7001)}
    traces = {name: record(ps, args.max_tokens, args.k) for name, ps in sets.items()}
    costs = measure_costs(sets["bench"][:2], args.max_tokens, args.k)
    print("costs (ms): plain token {:.3f}, step by k {}, draft pass {:.3f}".format(
        costs["step"][0] * 1e3, [round(x * 1e3, 3) for x in costs["step"][1:]], costs["draft"] * 1e3))
    rows = []
    for scale in args.draft_step_scale:
        scaled = dict(costs, step=[costs["step"][0]] + [s * scale for s in costs["step"][1:]])
        for name, trs in traces.items():
            for fixed in [None] + list(range(1, args.k + 1)):
                per_seed = [replay(trs, scaled, args.k, fixed, _Noise(args.noise, seed)) for seed in range(args.seeds)]
                gm = [statistics.geometric_mean(r) for r in per_seed]
                rows.append({"draft_step_scale": scale, "prompts": name, "k": "adaptive" if fixed is None else fixed,
                             "speedup": round(statistics.mean(gm), 3), "seeds": [round(g, 3) for g in gm]})
                r = rows[-1]
                print(f"drafting step x{scale:<4} {name:>5} k={r['k']!s:>8}: {r['speedup']:.3f}x  "
                      f"(per noise seed {r['seeds']})", flush=True)
    write_results(args.out, {"config": vars(args), "costs": costs, "rows": rows})
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
