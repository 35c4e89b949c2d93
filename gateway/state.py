"""What one gateway holds while it runs: its configuration, routing table, policies (admission, SLO accounting,
autoscaling), telemetry and the engines once loaded. One `GatewayState` per app, reached from a request as
`request.app.state.gateway`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from gateway.admission import AdmissionController
from gateway.auth import KeyRing
from gateway.autoscale import Autoscaler
from gateway.config import TandemConfig
from gateway.routes import Routes
from gateway.slo import SLOAccounting
from gateway.telemetry import Telemetry


class EngineHost(Protocol):
    """What the app needs from `engines.EngineCore` (the benchmark's fake engine implements it too)."""

    def start(self) -> None: ...
    def shutdown(self) -> None: ...
    def engine(self, name: str) -> Any: ...
    def stats(self) -> dict: ...


@dataclass
class GatewayState:
    cfg: TandemConfig
    routes: Routes
    keyring: KeyRing
    telemetry: Telemetry
    slo: SLOAccounting
    autoscaler: Autoscaler
    admission: AdmissionController | None = None  # None: [admission] enabled = false
    host: EngineHost | None = None
    engines: dict[str, Any] = field(default_factory=dict)
    load_error: str | None = None
    inflight: int = 0
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def ready(self) -> bool:
        return self.host is not None and bool(self.engines)

    def engine_stats(self) -> dict[str, dict]:
        """Every engine's stats, with its busy seconds fed to the cost accounting on the way."""
        stats = {name: engine.stats() for name, engine in self.engines.items()}
        for name, s in stats.items():
            if "busy_s" in s:
                self.slo.observe_engine_busy(name, float(s["busy_s"]))
        return stats
