"""A /dev/shm too small for braid (a container's default is 64 MB) must give a clear error, never
a SIGBUS: the collectives' part of a rank's segment is backed when the communicator is built,
and a point-to-point mailbox when a rank first sends to that peer.

The ranks run in a private mount namespace with a tmpfs of a few MiB over /dev/shm, which needs
``unshare`` and the right to mount (root in CI); elsewhere the test is skipped.
"""
import json
import os
import shutil
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "helpers", "small_shm_ranks.py")


def _run_with_shm(size: str, tmp_path) -> dict:
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1)")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"],
                           capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot mount a private /dev/shm here (needs root or CAP_SYS_ADMIN)")
    out = tmp_path / "result.json"
    cmd = f"mount -t tmpfs -o size={size} tmpfs /dev/shm && exec {sys.executable} {SCRIPT} {out}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", cmd], capture_output=True, text=True, timeout=240)
    assert out.exists(), done.stderr[-3000:]
    return json.loads(out.read_text())


def _steps(result: dict, rank: int) -> dict:
    rank_result = result["ranks"][rank]
    assert rank_result["exit"] == 0, rank_result  # -7 would be SIGBUS
    return {s["step"]: s for s in rank_result["steps"]}


@pytest.mark.slow
def test_too_small_for_the_collectives_fails_at_init_on_every_rank(tmp_path):
    # 2 ranks need about 4.1 MiB each for header, one-shot buffers and slots.
    result = _run_with_shm("6m", tmp_path)
    seen = [_steps(result, r)["init"] for r in range(2)]
    assert all(s["error"] == "CommError" for s in seen), seen
    assert any("shared memory is full" in s["message"] and "/dev/shm" in s["message"] for s in seen), seen
    # The rank that could not build its segment tells the other, which raises at once.
    assert all("shared memory is full" in s["message"] or "could not join" in s["message"]
               for s in seen), seen
    # The ranks' deadline is 30 s: well under it means the failure was published, not waited out.
    assert all(s["seconds"] < 10 for s in seen), seen


@pytest.mark.slow
def test_too_small_for_the_mailboxes_fails_at_the_first_send(tmp_path):
    # Room for both collective parts and part of one 4 MiB mailbox.
    result = _run_with_shm("12m", tmp_path)
    steps = [_steps(result, r) for r in range(2)]
    for s in steps:
        assert s["init"]["error"] is None and s["all_reduce"] == {"step": "all_reduce", "error": None,
                                                                   "value": 2.0}, s
    errors = [s["uneven_all_to_all"] for s in steps]
    assert all(e["error"] in ("CommError", "PeerError") for e in errors), errors
    assert any("shared memory is full" in e["message"] for e in errors), errors
