"""bench/gpu_check.sh, the one script a GPU check runs, stays runnable from the CPU suite: every path it names
exists, its pytest selections collect (`--collect-only`, as the script itself runs them), and its time limits
add up to under 8 minutes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def test_every_path_the_script_names_exists():
    named = set(re.findall(r"\b((?:tests|bench)/[\w/.-]+\.(?:py|sh|json))", SCRIPT.read_text()))
    assert "tests/kernels/test_kernels_attention.py" in named and "bench/gpu_kernels.py" in named
    missing = sorted(p for p in named if not p.startswith("bench/results/") and not (ROOT / p).is_file())
    assert missing == []


def test_the_time_limits_fit_in_eight_minutes():
    text = SCRIPT.read_text()
    limits = dict(re.findall(r"\[(\w+)\]=(\d+)", re.search(r"declare -A LIMIT_S=\((.*)\)", text).group(1)))
    selections = re.findall(r'^  "(\w+) ', text, re.M)
    assert sorted(limits) == sorted(selections) == ["cuda_graphs", "kernels"]
    bench_until = int(re.search(r"left=\$\(\( (\d+) - ", text).group(1))
    assert sum(map(int, limits.values())) < bench_until <= 480 - 30  # 30 s for start-up and the JSON


def test_its_pytest_selections_collect():
    run = subprocess.run(["bash", str(SCRIPT), "--collect-only"], cwd=ROOT, capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable}, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    counts = dict(re.findall(r"^(\w+): rc=0, (\d+) tests collected$", run.stdout, re.M))
    assert set(counts) == {"kernels", "cuda_graphs"} and int(counts["kernels"]) >= 20
    graphs = re.findall(r"^(tests/engines/test_engine_quant.py::\S+)$", run.stdout, re.M)
    assert len(graphs) == int(counts["cuda_graphs"]) >= 1
    assert all("cuda_graph" in g for g in graphs)
