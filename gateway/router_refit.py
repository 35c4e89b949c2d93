"""The optional periodic refit of a router route (`router.refit_interval_s`, off by default): a daemon thread that,
once `refit_min_labels` new shadow labels are on disk, refits the route's router from them with the shipped rows
as a prior (router_model.adapt, the same code as `tandem router adapt`), validates on held-back labels and, only
when better, installs the new artifact into `refit_dir` (the previous one kept as `<refit_dir>.previous`) and
swaps it into the route in one assignment. Every decision is logged (tandem.routing) and appended to
`<refit_dir>/adapt_log.jsonl` with both artifact versions.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

from router_model import Router
from router_model.adapt import AdaptOptions, Traffic, decide, holdout_split, refit
from router_model.data import read_rows
from router_model.self_labels import LabelModel

log = logging.getLogger("tandem.routing")


def shadow_traffic(paths: list[Path], label_model: LabelModel) -> Traffic:
    """The shadow records of these files (the rotated one first) as self-labelled rows (stored features)."""
    t = Traffic()
    for path in paths:
        if not path.is_file():
            continue
        for i, rec in enumerate(read_rows(path)):
            label = {k: rec[k] for k in ("first_line_exact", "exact", "edit_similarity")}
            conv = rec.get("prompt", rec.get("messages"))
            t.add(conv, label_model.label(rec | {"agreement": label}), f"{path.name}:{i}",
                  features=None if conv is not None else rec.get("features"))
    return t


class PeriodicRefit:
    """Refits `strategy.router` every `interval_s` from its shadow labels; `run_once` is one such pass."""

    def __init__(self, strategy: Any, *, labels: str, out: str, interval_s: float, min_labels: int,
                 current_dir: str, prior_data: str | None = None, options: AdaptOptions | None = None):
        self.strategy, self.labels, self.out = strategy, Path(labels), Path(out)
        self.interval_s, self.min_labels = interval_s, min_labels
        self.current_dir = current_dir
        self.prior_data = prior_data
        self.options = options or AdaptOptions()
        self.seen = 0  # labels on disk at the last refit
        self.decisions: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name=f"refit-{self.strategy.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.run_once()
            except Exception as exc:  # a failed refit leaves the route as it was
                log.warning("route %s: periodic refit failed: %s", self.strategy.name, exc)

    def run_once(self) -> dict | None:
        """One refit if enough new labels arrived; returns the decision (None when it waited)."""
        paths = [self.labels.with_name(self.labels.name + ".1"), self.labels]
        current: Router = self.strategy.router
        prior_path = self.prior_data or current.metadata.get("data")
        if not prior_path or not Path(prior_path).is_file():
            raise FileNotFoundError(f"the prior data {prior_path!r} of the route's artifact is not there")
        prior = read_rows(prior_path)
        traffic = shadow_traffic(paths, LabelModel.fit(prior))
        if len(traffic) - self.seen < self.min_labels:
            return None
        self.seen = len(traffic)
        fit_idx, val_idx = holdout_split(traffic.groups, self.options.holdout, self.options.seed)
        new = refit(current, prior, traffic.subset(fit_idx), self.options, log=log.info)
        new.metadata["data"] = str(prior_path)  # the next refit finds the same prior
        record = decide(current, self.current_dir, new, traffic.subset(val_idx), self.out, self.options,
                        self.out / "adapt_log.jsonl", log=log.info,
                        extra={"route": self.strategy.name, "traffic": {"shadow": len(traffic)}})
        if record["decision"] == "swapped":
            self.strategy.swap(Router.load(self.out), str(self.out))
            self.current_dir = str(self.out)
        self.decisions.append(record)
        return record
