"""The gloo test launcher (tests/_dist.py) itself: a worker that dies, exits non-zero, hangs or raises
fails `run_distributed` with the rank and what happened (exit code, traceback, timeout), never a pass.

The worker functions are module-level so that the workers (forked from the session's fork server, or spawned
with fresh=True) can import them."""

import os
import time

import pytest

from _dist import run_distributed


def _ok(rank, world_size):
    return rank * 10


def _exit3_before_result(rank, world_size):
    if rank == 1:
        os._exit(3)  # dies without reporting (as a segfault or abort would)
    return rank


def _exit3_after_result(rank, world_size):
    if rank == 1:
        import atexit

        # the result is reported, then the process ends with 3 in its teardown (as an abort of a gloo thread in
        # interpreter finalisation would)
        atexit.register(os._exit, 3)
    return rank


def _exit0_without_result(rank, world_size):
    if rank == 1:
        os._exit(0)
    return rank


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


def _hang_on_rank1(rank, world_size):
    if rank == 1:
        time.sleep(3600)
    return rank


def _segfault_on_rank1_while_rank0_waits(rank, world_size):
    import torch.distributed as dist

    if rank == 1:
        import signal

        os.kill(os.getpid(), signal.SIGSEGV)  # dies in the middle of the job (a segfault in a kernel)
    dist.barrier()  # rank 0: gloo raises "Connection closed by peer" once rank 1 is gone
    return rank


@pytest.mark.parametrize("fresh", [False, True])
def test_all_ranks_ok(fresh):
    """Forked from the fork server (the tests' default) and spawned (`run_gloo`'s default, the demo's)."""
    assert run_distributed(_ok, 3, timeout=120, fresh=fresh) == [0, 10, 20]


def test_worker_exit_code_before_result_fails():
    with pytest.raises(AssertionError) as e:
        run_distributed(_exit3_before_result, 2, timeout=120)
    msg = str(e.value)
    assert "rank 1" in msg and "exit code 3" in msg, msg


@pytest.mark.parametrize("worker, needles, fresh", [
    # an atexit handler runs only in a spawned interpreter's finalisation (a forked worker ends with os._exit)
    (_exit3_after_result, ("exit code 3",), True),
    (_exit0_without_result, ("exit code 0", "without reporting"), False),
    (_raise_on_rank1, ("boom on rank 1",), False),
])
def test_worker_failure_after_or_instead_of_result_fails(worker, needles, fresh):
    """exit 3 after reporting (passed before), exit 0 without reporting, an exception on rank 1: the launcher
    fails naming rank 1 and what happened."""
    with pytest.raises(AssertionError) as e:
        run_distributed(worker, 2, timeout=120, fresh=fresh)
    msg = str(e.value)
    assert "rank 1" in msg and all(n in msg for n in needles), msg


def test_rank_that_dies_is_named_when_a_peer_fails_because_of_it():
    """Rank 1 segfaults while rank 0 waits in a collective; rank 0 then raises gloo's "Connection closed by peer"
    and reports it, usually before rank 1's missing report is noticed. The launcher named only rank 0 and its
    connection error (the segfault, the cause, appeared nowhere; adversarial finding, session 9): it must name
    rank 1 and its signal too."""
    with pytest.raises(AssertionError) as e:
        run_distributed(_segfault_on_rank1_while_rank0_waits, 2, timeout=120)
    msg = str(e.value)
    assert "rank 1" in msg and "SIGSEGV" in msg, msg


def test_worker_hang_fails_with_timeout():
    # 15 s: forked ranks start in about a second (rank 0 reports at once), so only rank 1 is missing then
    with pytest.raises(AssertionError) as e:
        run_distributed(_hang_on_rank1, 2, timeout=15)
    msg = str(e.value)
    assert "rank 1" in msg and "15" in msg and "did not finish" in msg, msg


def test_demo_fails_fast_with_the_rank_error(tmp_path):
    """`examples/op_demo.py` uses the same launcher (`tools.launch.run_gloo`):
    a rank that raises ends the demo at once, exit status 1, with that rank's error (it waited 600 s on its
    result queue). Here every rank raises: a `sitecustomize` on the path (imported by every process, the spawned
    ranks too) makes the op's input check fail with a ValueError of its own."""
    import subprocess
    import sys

    (tmp_path / "sitecustomize.py").write_text(
        "import megatron_splitkv.ops.prepare as m\n"
        "def _bad(*a, **k):\n"
        "    raise ValueError('injected: num_chunks must be a positive int')\n"
        "m.check_tensors = _bad\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root, os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, os.path.join(root, "examples", "op_demo.py"), "--ctx", "64", "--blocks", "2"],
                       env=env,
                       cwd=root, capture_output=True, text=True, timeout=240)
    assert p.returncode == 1, (p.returncode, p.stderr[-3000:])
    assert "op_demo: error: rank 0 of 2 failed" in p.stderr, p.stderr[-3000:]
    assert "injected: num_chunks must be a positive int" in p.stderr, p.stderr[-3000:]
    assert "DFlash attention" not in p.stdout


def _sleep_with_pid(rank, world_size, pid_dir):
    with open(os.path.join(pid_dir, f"rank{rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)
    return rank


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (dead, not reaped yet) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.exists("/proc"), reason="Linux: the ranks' parent-death signal (prctl)")
def test_ranks_die_with_a_killed_launcher(tmp_path):
    """kill -9 of the launcher's process (as a user killing a demo run) ends its ranks too: none goes on training
    and writing checkpoints beside a resumed run (tools/launch.py `_die_with_parent`)."""
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = ("import sys; sys.path[:0] = [%r, %r]\n"
            "from tools.launch import run_gloo\n"
            "from test_dist_launcher import _sleep_with_pid\n"
            "run_gloo(_sleep_with_pid, 2, %r, timeout=300)\n") % (root, os.path.join(root, "tests"), str(tmp_path))
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=root)
    pids = {}
    deadline = time.monotonic() + 120
    while len(pids) < 2 and time.monotonic() < deadline and parent.poll() is None:
        for r in range(2):
            p = tmp_path / f"rank{r}"
            if p.exists() and p.read_text():
                pids[r] = int(p.read_text())
        time.sleep(0.2)
    assert len(pids) == 2, f"ranks did not start (launcher exit {parent.poll()})"
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [r for r, p in pids.items() if _alive(p)]
    for r in left:
        os.kill(pids[r], signal.SIGKILL)
    assert not left, f"ranks {left} outlived the killed launcher"
