"""Adaptive k: how many draft tokens per sequence pay this step, from the measured acceptance and the measured
cost of target passes, draft passes and whole steps (`CostModel`s on the engine's step clock)."""

from __future__ import annotations

import time
from collections.abc import Callable

EXPLORE_SEQS = 4  # sequences that draft in a step that only measures acceptance and cost
# a sequence's own acceptance is the engine's, updated by its own windows as if the engine's were this many
# windows of its own (a new sequence has the engine's; a few windows of its own move it)
PRIOR_WINDOWS = 4.0
# an exploration's catch-ups may cost each sequence of the step at most this share of its remaining decode
# time at plain decoding's pace (at least one plain step): a measurement must not move anyone's tail
EXPLORE_STALL = 0.05
# a choice of plain decoding stands for this many more steps of that batch size without being weighed again
# (weighing every k costs ~40 us a step: 2% of a batch-8 step, and 8-15% of a batch-1 sampled step once the
# target's weights are read as bf16); explorations still come on time, a measured drafting step ends it, and a
# lone sequence's due probe waits for the next weighing
REUSE_PLAIN = 8
# drafting that wins by less than this predicted rate ratio is a close call: explorations of plain decoding
# stay every `explore_every` choices instead of ever rarer
CLOSE_CALL = 1.2
# probes of a k never measured at a batch size before it is judged by the cost model like the others
PROBE_TRIES = 2


class CostModel:
    """Seconds of one pass as a function of its size, learned online: an EMA per power-of-two size bucket (the
    plain mean of its first 1 / (1 - decay) observations, so one early outlier, such as a step on cold caches,
    does not stand for the bucket until ten more have come), read by linear interpolation between measured
    sizes; outside them it assumes no saving below and linear growth above (pessimistic, so an unmeasured
    large batch does not look cheap)."""

    def __init__(self, decay: float = 0.9, clock: Callable[[], float] = time.perf_counter):
        self.decay = decay
        self.clock = clock  # the engine's step clock (engines.step_timer.step_clock)
        self.points: dict[int, list[float]] = {}  # bucket -> [mean size, mean seconds]
        self.counts: dict[int, int] = {}  # bucket -> observations so far

    def observe(self, size: int, seconds: float) -> None:
        b = max(1, size).bit_length()
        n = self.counts[b] = self.counts.get(b, 0) + 1
        pt = self.points.get(b)
        if pt is None:
            self.points[b] = [float(size), seconds]
        else:
            w = max(1 - self.decay, 1 / n)
            pt[0] += w * (size - pt[0])
            pt[1] += w * (seconds - pt[1])

    def estimate(self, size: int) -> float | None:
        if not self.points:
            return None
        pts = sorted(self.points.values())
        if size <= pts[0][0]:
            return pts[0][1]
        for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
            if size <= x1:
                return y0 + (y1 - y0) * (size - x0) / max(x1 - x0, 1e-9)
        x, y = pts[-1]
        return y * size / x


class AdaptiveK:
    """Per engine: picks k in 0..k_max maximising expected tokens per second,
    B * E(k) / S(B, k), E(k) = (1 - a^(k+1)) / (1 - a) (Leviathan et al.), from the measured acceptance a
    and the step cost S: the measured whole step at this batch size and k once there is one, else the target
    pass (T, by tokens per step) plus k draft passes (D): T(B * (k + 1)) + k * D(B). k = 0
    is plain decoding;
    every `explore_every` choices it takes the other side so both cost estimates stay measured and a stale
    acceptance estimate can recover: plain decoding instead of k for 3 steps; drafting instead of plain
    decoding as the best k > 0 for 3 steps at batches of up to `explore_seqs` (every sequence drafts, so the
    whole step is measured), else k = 1 once for a few sequences (acceptance only), and not at all where
    drafting would lose even with every draft accepted. While the same side keeps winning, the interval
    doubles up to `explore_max` (each exploration costs a catch-up or a switch); a change of side resets it. Outside
    explorations a batch size leaves plain decoding only for a predicted `hysteresis` gain (the drafters
    catch up).

    Judged by the tail as well as the mean: given each sequence's own acceptance (`seq_acceptance`), a k > 0
    is a candidate only if the sequence that gains least from it (the lowest acceptance) still gets its
    tokens at least as fast as plain decoding would give them, E(a_min, k) / S(B, k) >= 1 / S(B, 0), so no
    sequence's time per token is raised for the others' gain; the rate it maximises is the batch's mean."""

    def __init__(self, k_max: int, explore_every: int = 32, decay: float = 0.95,
                 clock: Callable[[], float] = time.perf_counter, explore_max: int = 512,
                 explore_seqs: int = EXPLORE_SEQS):
        self.k_max = k_max
        self.explore_seqs = explore_seqs  # an exploring step drafts for this many sequences at most
        self.explore_every = explore_every
        self.explore_max = max(explore_max, explore_every)
        self._interval = explore_every
        self._last_best = 0  # the winner at the previous exploration (0: plain decoding)
        # leaving plain decoding for a k not yet measured at this batch size needs this predicted gain: the
        # switch makes every sequence's drafter catch up on the tokens it missed
        self.switch_margin = 1.2
        self.hysteresis = 1.1  # leaving plain decoding for a measured k needs this predicted gain
        self._side: dict[int, bool] = {}  # per batch-size bucket: whether its latest choice drafted
        self._next_explore = explore_every
        # the target step's cost by k, keyed by the number of decoding sequences: a verify step over k + 1
        # tokens per sequence costs more than plain decodes of as many tokens (rejection sampling,
        # per-window work), which a model keyed by tokens per step cannot tell apart
        self.step_cost: dict[int, CostModel] = {}
        self.decay = decay
        self.target = CostModel(clock=clock)
        self.draft = CostModel(clock=clock)
        self._accepted = 0.0  # EMA counts of the geometric model: accepted drafts and first rejections
        self._rejected = 0.0
        self._zeros = 0
        self._steps = 0
        self.k = k_max
        self.exploring = False  # the latest choice only measures: draft for a few sequences, not the batch
        self._hold_plain = 0  # steps left of an exploration of plain decoding (a short run, see observe_step)
        self._hold_draft = (0, 0)  # steps left of an exploration of drafting, and its k (small batches)
        self._prev_k: int | None = None  # k of the previous observed step
        self.fixed: int | None = None  # pin k (tests, benchmarks); None: adaptive
        # of the latest choice at a measured batch size: a plain step's seconds, and the seconds per token
        # that drafting with the chosen k saves each sequence (0: none or unknown); `catch_up_pays` reads them
        self.plain_step_s = 0.0
        self.saving_s = 0.0
        self._probe_k = 0  # of the latest choice of plain decoding: the k a probe of drafting would take
        self._probe_bucket = 0  # and the batch-size bucket it was made at
        self._probes: dict[tuple[int, int], int] = {}  # (batch-size bucket, k) -> probes of that k
        self._reuse = (0, 0)  # (batch size, steps left) of a choice of plain decoding that stands (REUSE_PLAIN)

    @property
    def acceptance(self) -> float | None:
        n = self._accepted + self._rejected
        return self._accepted / n if n > 0 else None

    def observe_window(self, num_drafts: int, num_accepted: int) -> None:
        self._accepted = self.decay * self._accepted + num_accepted
        self._rejected = self.decay * self._rejected + (1 if num_accepted < num_drafts else 0)

    def observe_step(self, batch: int, k: int, seconds: float) -> None:
        """A whole decode-only engine step where every sequence drafted k: drafting, its bookkeeping, the
        target forward, verification and sampling. That is what a step really costs; the target and draft
        models see only their passes, which undercount it. Only steady steps count: the first step after
        k changes pays for the switch (the other model's weights and K/V have just left the caches, the
        drafter catches up), and counting it would make plain decoding look slower than it is."""
        prev, self._prev_k = self._prev_k, k
        if k > 0:  # news of drafting at some batch size: a choice of plain decoding standing unweighed ends
            self._reuse = (0, 0)
        if prev == k:
            self.step_cost.setdefault(k, CostModel()).observe(batch, seconds)

    def unsteady(self) -> None:
        """The coming step pays for more than its k (the drafter caught up on a prompt or on tokens it missed):
        it is not counted, and the step after it is (if its k is the same)."""
        self._prev_k = None

    def step_seconds(self, batch: int, k: int, draft_seconds: float = 0.0) -> float:
        """Seconds of a whole step with k drafts for each of `batch` sequences: measured at this batch size
        and k when it has been, else the tokens-per-step model of the target pass plus k draft passes, scaled
        by the measured / modelled ratio of another k > 0 at this batch size when there is one (so one
        measured k corrects the others at once instead of each being tried in turn)."""
        bucket = max(1, batch).bit_length()
        if self._measured(k, bucket):
            return self.step_cost[k].estimate(batch)
        model = self.target.estimate(batch * (k + 1)) + k * draft_seconds
        if k > 0:  # another k measured at this batch size: scale the model by how far off it was there
            for j, mj in sorted(self.step_cost.items(), reverse=True):
                if j > 0 and bucket in mj.points:
                    return model * mj.estimate(batch) / (self.target.estimate(batch * (j + 1)) + j * draft_seconds)
        return model

    def _measured(self, k: int, bucket: int) -> bool:
        """Whether a whole step with k drafts was measured at this batch-size bucket."""
        m = self.step_cost.get(k)
        return m is not None and bucket in m.points

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    def seq_acceptance(self, accepted: float, rejected: float) -> float | None:
        """A sequence's acceptance from its own windows' counts (`Sequence.draft_accepted`, `draft_rejected`),
        shrunk toward the engine's by PRIOR_WINDOWS pseudo-windows; None before anything was measured."""
        a = self.acceptance
        if a is None:
            return None
        return (accepted + PRIOR_WINDOWS * a) / (accepted + rejected + PRIOR_WINDOWS)

    def catch_up_s(self, num_tokens: int) -> float | None:
        """Seconds the drafter takes to compute `num_tokens` it has not seen (a prompt, tokens decoded without
        it): the target's measured cost of a pass that size, scaled by the draft / target cost of one token."""
        t1, d1 = self.target.estimate(1), self.draft.estimate(1)
        if t1 is None or d1 is None or t1 <= 0:
            return None
        return self.target.estimate(num_tokens) * d1 / t1

    def catch_up_pays(self, lags: list[int], remaining: list[int]) -> bool:
        """Whether sequences whose drafters are `lags` tokens behind should draft now, with `remaining` tokens
        each still to decode: their catch-ups (one draft pass over the missed tokens, which every sequence of
        the step waits for) must be paid back to each of them by what drafting saves it (`saving_s` per token:
        the sequence that gains least) over its remaining tokens; a measuring choice (an exploration) may
        stall the step by at most EXPLORE_STALL of the fewest remaining tokens' plain decoding time, and by one
        plain step whatever they are. Drafters at most two tokens behind (the last draft and the bonus token)
        cost nothing to speak of."""
        behind = sum(lag for lag in lags if lag > 2)
        if not behind or self.fixed is not None:
            return True
        cost = self.catch_up_s(behind)
        if cost is None:  # nothing measured yet: the first drafts measure it
            return True
        left = min(remaining, default=0)
        if self.exploring:
            return cost <= self.plain_step_s * max(1.0, EXPLORE_STALL * left)
        return cost <= left * self.saving_s

    def choose(self, batch: int, accs: list[float] | None = None) -> int:
        """k for a step of `batch` decoding sequences; `accs`: their own acceptances (`seq_acceptance`), else
        all the engine's."""
        self.exploring = False
        self.saving_s = 0.0
        self._probe_k = 0
        if self._hold_plain > 0:  # the rest of a plain-decoding exploration
            self._hold_plain -= 1
            self.k = 0
            return 0
        if self._hold_draft[0] > 0:  # the rest of a drafting exploration
            self._hold_draft = (self._hold_draft[0] - 1, self._hold_draft[1])
            self.k = self._hold_draft[1]
            self.exploring = True
            return self.k
        if self.fixed is not None:
            self.k = min(self.fixed, self.k_max)
            return self.k
        if self.k_max == 0 or batch == 0:
            return 0
        self._steps += 1
        if self._reuse[1] > 0 and self._reuse[0] == batch and self._steps < self._next_explore:
            self._reuse = (batch, self._reuse[1] - 1)  # the plain decoding chosen a few steps ago stands
            self.k = 0
            return 0
        self._reuse = (0, 0)
        a = self.acceptance
        bucket = max(1, batch).bit_length()
        if bucket not in self.target.points:
            self.k = 0  # measure a plain step at this batch size first
            return 0
        self.plain_step_s = self.step_seconds(batch, 0)
        d = self.draft.estimate(batch)
        if a is None or d is None:
            self.k = min(2, self.k_max)  # nothing drafted yet: draft a little to learn
            self.exploring = True
            return self.k
        plain_rate = batch / self.plain_step_s
        accs = list(accs) if accs else [a]
        a_min = min(accs)
        best, best_rate = 0, plain_rate
        best_draft, best_draft_rate = 1, 0.0  # the best k > 0, what an exploration of drafting tries
        perfect_rate = 0.0  # the best k > 0 if every draft were accepted
        for k in range(1, self.k_max + 1):
            seconds = self.step_seconds(batch, k, d)
            rate = batch * sum(self.expected_tokens(x, k) for x in accs) / len(accs) / seconds
            perfect_rate = max(perfect_rate, batch * (k + 1) / seconds)
            # the tail: the sequence that gains least must not get its tokens slower than plain decoding
            if rate > best_rate and self.expected_tokens(a_min, k) * self.plain_step_s >= seconds:
                best, best_rate = k, rate
            if rate > best_draft_rate:
                best_draft, best_draft_rate = k, rate
        # the k > 0 whose whole step was never measured at this batch size, largest first (a probe's step pays
        # its drafter's catch-up and is never a measure: after PROBE_TRIES probes a k counts as tried)
        unmeasured = [k for k in range(self.k_max, 0, -1)
                      if not self._measured(k, bucket) and self._probes.get((bucket, k), 0) < PROBE_TRIES]
        side = self._side.get(bucket)
        if (best > 0 and not side and best_rate < self.switch_margin * plain_rate
                and not self._measured(best, bucket)):
            best = 0  # from plain decoding (or nothing yet) to a k never measured at this batch size: only for a
            # clear gain (the modelled cost of an unmeasured k is optimistic)
        if side is False and best > 0 and best_rate < self.hysteresis * plain_rate:
            # from plain decoding to drafting costs a catch-up of every sequence's drafter: near break-even stay.
            # The way back costs no catch-up and has no margin (a margin there keeps a losing k drafting).
            best = 0
        if side is not None and side != (best > 0):
            # a change of side outside explorations came from the estimates of one side only (the other's are
            # as old as its last use): look at the old side again soon, not after the interval it had earned
            self._next_explore = min(self._next_explore, self._steps + self.explore_every)
        self._side[bucket] = best > 0
        if self._steps >= self._next_explore:  # keep both sides measured: the other choice, once
            # while the same side keeps winning, explore ever more rarely; a change of side starts over, and so
            # does drafting that wins by less than CLOSE_CALL: its gain rests on a plain-step estimate only
            # these explorations refresh (one measured high, on cold caches, made drafting at break-even look
            # like a gain for hundreds of steps), and they cost no catch-up
            same = (best > 0) == (self._last_best > 0)
            close = best > 0 and best_rate < CLOSE_CALL * plain_rate
            self._interval = (min(2 * self._interval, self.explore_max) if same and not close
                              else self.explore_every)
            self._last_best = best
            self._next_explore = self._steps + self._interval
            self.exploring = best == 0
            if best > 0:  # plain decoding for 3 steps: the first after drafting pays the switch, the next two
                self._hold_plain = 2  # measure plain decoding (observe_step)
                best = 0
            elif batch <= self.explore_seqs and (unmeasured or perfect_rate >= self.switch_margin * plain_rate):
                # every sequence drafts: for 3 steps, so two steady ones measure the whole step at this batch
                # size (a single step pays the switch and is never counted), the largest k not measured here
                # yet, else the best k > 0: optimism where nothing is known (the modelled cost of an unmeasured
                # k, scaled by another k's, can rate it too dear to be ever tried, and then ever measured)
                best = unmeasured[0] if unmeasured else best_draft
                self._hold_draft = (2, best)
            elif batch > self.explore_seqs and perfect_rate >= self.switch_margin * plain_rate:
                best = 1  # a few sequences draft k = 1: it measures acceptance, not the cost of a whole step
            else:  # drafting would lose even if every draft were accepted: measuring acceptance cannot change
                self.exploring = False  # the choice, and the few sequences' catch-ups cost
        if best > 0:  # per token of the sequence that gains least: a plain step's time less a drafting step's
            # per token it yields that sequence
            seconds = self.step_seconds(batch, best, d)
            self.saving_s = max(0.0, self.plain_step_s - seconds / self.expected_tokens(a_min, best))
        self._probe_bucket = bucket
        if best == 0 and unmeasured:  # what `probe` drafts: a k never measured at this batch size, else the
            self._probe_k = unmeasured[0]  # best k > 0 where drafting could pay at some acceptance
        elif best == 0 and perfect_rate >= self.switch_margin * plain_rate:
            self._probe_k = best_draft
        if best == 0 and not self.exploring and not self._hold_plain:  # a choice, not an exploration of plain
            self._reuse = (batch, REUSE_PLAIN)
        self.k = best
        return best

    def reweigh(self) -> None:
        """The next `choose` weighs every k again, whatever choice of plain decoding stood."""
        self._reuse = (0, 0)

    def probe(self) -> int:
        """After a choice of plain decoding (`choose` returned 0), the k > 0 to draft with instead to measure a
        new sequence's own acceptance (the engine's is an average over sequences whose acceptance spreads
        from 0.4 to 0.9 on held-out code, and a sequence that never drafts never measures its own), or 0 where
        even perfect acceptance would lose or nothing is measured yet. Marks the choice as an exploration."""
        if self._probe_k:
            self.k, self.exploring = self._probe_k, True
            key = (self._probe_bucket, self._probe_k)
            self._probes[key] = self._probes.get(key, 0) + 1
        return self._probe_k

