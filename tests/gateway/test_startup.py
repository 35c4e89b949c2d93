"""What `tandem serve` imports on its way to /ready: not scikit-learn (the router hashes with its C helper), not
pydantic (no handler takes a pydantic model), not triton (a CPU server launches no Triton kernel). Each was a
tenth to a half of start-up (bench/startup.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from litestar import Litestar

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from gateway.server import build_parser, config_from_args
from gateway.app import create_app
from gateway.engine_setup import default_host_factory
cfg = config_from_args(build_parser().parse_args([]))
app = create_app(cfg, host_factory=lambda: None)
router = app.state.gateway.routes.strategies["auto"].router
score = float(router.score([{"role": "user", "content": "def add(a, b):"}]))
host = default_host_factory(cfg)()
engine = host.engine("tandem-small")
host.shutdown()
print(json.dumps({"score": score, "loaded": sorted(m for m in ("sklearn", "pydantic", "triton", "scipy.stats")
                                                   if m in sys.modules)}))
"""


def test_the_default_server_builds_its_app_routers_and_engines_without_sklearn_pydantic_or_triton():
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["loaded"] == []
    assert 0.0 <= seen["score"] <= 1.0
    # the same router in this process (where scikit-learn may be loaded) scores the prompt the same
    from gateway.app import create_app
    from gateway.server import build_parser, config_from_args

    app = create_app(config_from_args(build_parser().parse_args([])), host_factory=lambda: None)
    router = app.state.gateway.routes.strategies["auto"].router
    assert float(router.score([{"role": "user", "content": "def add(a, b):"}])) == seen["score"]


def test_the_gateway_app_drops_only_litestars_pydantic_and_attrs_plugins():
    from gateway.app import GatewayApp

    # the hook GatewayApp overrides is Litestar's own (a rename in an upgrade would bring pydantic back silently)
    assert isinstance(Litestar.__dict__["_get_default_plugins"], staticmethod)
    names = [type(p).__name__ for p in GatewayApp._get_default_plugins([])]
    assert names == ["MsgspecDIPlugin"]
    default = [type(p).__name__ for p in Litestar._get_default_plugins([])]
    assert set(default) - set(names) <= {"PydanticPlugin", "PydanticDIPlugin", "PydanticInitPlugin",
                                         "PydanticSchemaPlugin", "AttrsSchemaPlugin"}
