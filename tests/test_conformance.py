"""PyTorch's own distributed test suite on braid: a share of it (tests/conformance/run.py
--quick: a few tests of each area at 2 ranks, on braid and on gloo, the tests the suite gates on
gloo's name run on braid under gloo's gates), in the slow tier (``make test-slow``). Every test
that passes on gloo must pass on braid. ``make conformance`` runs the whole selection at 2 and 3
ranks."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

RUN = Path(__file__).resolve().parent / "conformance" / "run.py"


@pytest.mark.slow
def test_what_passes_on_gloo_passes_on_braid(tmp_path):
    out = tmp_path / "conformance.json"
    proc = subprocess.run([sys.executable, str(RUN), "--quick", "--world-sizes", "2", "--timeout", "120",
                           "--json", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    assert out.exists(), proc.stdout[-4000:]
    (report,) = json.loads(out.read_text())
    braid, gloo = report["results"]["braid"], report["results"]["gloo"]
    passed_on_gloo = {t for t, (outcome, _) in gloo.items() if outcome == "passed"}
    # The selection is not vacuous: each side ran tests, and the name-gated ones ran on braid.
    assert len(passed_on_gloo) >= 20 and report["gated"], proc.stdout[-4000:]
    assert all(report["gated_results"][t][0] == "passed" for t in report["gated"]), proc.stdout[-4000:]
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert sum(outcome == "passed" for outcome, _ in braid.values()) >= 10
