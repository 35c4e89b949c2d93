"""Every example a `--help` shows runs as written. The examples are read from the parsers' own epilogs
(`tandem serve`: gateway/server.py, `tandem loadtest`: traces/cli.py; `tandem router` and `tandem generate` show
none), and each is run from the project root with two substitutions only, so that runs cannot collide: a port an
example names is a free one, and an `--out` folder is under the test's temporary folder. A serve example
must come up (`/ready`), list its models and drain on SIGTERM with exit 0; a loadtest example runs against
`tandem serve` on the embedded default (what its help says it expects) and must exit 0 and write its report.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from live_server import start_serve  # conftest puts tests/ on the path

from gateway.server import build_parser as serve_parser
from gateway.server import free_port
from traces.cli import build_parser as loadtest_parser

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def examples(epilog: str, command: str) -> list[list[str]]:
    """The `tandem <command> ...` lines of a help epilog (backslash continuations joined, comments dropped)."""
    joined = re.sub(r"\\\n\s*", " ", epilog)
    found = []
    for line in joined.splitlines():
        line = line.split("  #")[0].strip()
        if line.startswith(f"tandem {command}"):
            found.append(shlex.split(line)[1:])
    return found


SERVE = examples(serve_parser().epilog, "serve")
LOADTEST = examples(loadtest_parser().epilog, "loadtest")


def test_the_help_texts_have_examples_to_run():
    assert len(SERVE) >= 2 and len(LOADTEST) >= 2
    for argv in SERVE:  # each parses as written
        serve_parser().parse_args(argv[1:])
    for argv in LOADTEST:
        loadtest_parser().parse_args(argv[1:])


def _env() -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TANDEM_LOG_LEVEL": "warning"}
    env.pop("TANDEM_CONFIG", None)
    return env


def _start(argv: list[str]) -> tuple[subprocess.Popen, str]:
    """`tandem serve ...` as written, on a free port (substituted, or added where the example uses 8000)."""
    port = str(free_port())
    argv = list(argv)
    if "--port" in argv:
        argv[argv.index("--port") + 1] = port
    else:
        argv += ["--port", port]
    assert argv[0] == "serve", argv
    return start_serve(argv[1:], _env(), int(port), timeout_s=120)


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    return proc.returncode


def _check_serving(url: str, argv: list[str]) -> None:
    models = [m["id"] for m in httpx.get(url + "/v1/models", timeout=10).json()["data"]]
    if "--served-model-name" in argv:
        assert models == [argv[argv.index("--served-model-name") + 1]]
    elif len(argv) > 1 and not argv[1].startswith("-"):
        assert models == [argv[1]]  # MODEL as given is the model's name; a --draft is not a model
    else:
        assert {"fast", "best", "tandem-small", "tandem-large"} <= set(models)
    r = httpx.post(url + "/v1/completions", json={"model": models[0], "prompt": "Hello", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def default_server():
    """The bare `tandem serve` example (the embedded default), shared with the loadtest examples."""
    assert ["serve"] in SERVE
    proc, url = _start(["serve"])
    yield url
    assert _stop(proc) == 0  # it drains and exits 0


def test_the_bare_serve_example_runs(default_server):
    _check_serving(default_server, ["serve"])


OTHER_SERVE = [argv for argv in SERVE if argv != ["serve"]]


@pytest.mark.parametrize("argv", OTHER_SERVE, ids=[" ".join(a) for a in OTHER_SERVE])
def test_serve_example_runs(argv):
    proc, url = _start(argv)
    try:
        _check_serving(url, argv)
    finally:
        assert _stop(proc) == 0


@pytest.mark.parametrize("argv", LOADTEST, ids=[f"loadtest-{i}" for i in range(len(LOADTEST))])
def test_loadtest_example_runs(argv, default_server, tmp_path):
    argv = [a.replace("http://127.0.0.1:8000", default_server) for a in argv]
    out = tmp_path / argv[argv.index("--out") + 1]
    argv[argv.index("--out") + 1] = str(out)
    run = subprocess.run([sys.executable, "-m", "gateway.cli", *argv], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    if "--sweep" in argv:
        sweep = json.loads((out / "sweep.json").read_text())
        assert sweep and (out / "sweep.md").is_file()
    else:
        records = json.loads((out / "report.json").read_text())["records"]
        completed = [r for r in records if r["outcome"] == "completed"]
        assert records and len(completed) >= len(records) // 2 and all(r["status_code"] == 200 for r in completed)
