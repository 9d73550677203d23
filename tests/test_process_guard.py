"""No process of a run outlives it: the watchdog (parallel/process_guard.py) after any death of its owner, kill -9
included; graceful stop on SIGTERM / SIGINT (parallel/stop_signals.py), forwarded to spawned ranks; and end to end
with `dynamo train` on the CPU default (SIGTERM -> checkpoint + exit 143; kill -9 -> no orphans)."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from hf_reference import REPO

GUARD_PY = os.path.join(REPO, "megatron_dynamo", "parallel", "process_guard.py")
SIGNALS_PY = os.path.join(REPO, "megatron_dynamo", "parallel", "stop_signals.py")
# Scripts load these modules by path: importing the package would import torch (~5 s per process).
LOAD = textwrap.dedent("""
    import importlib.util, sys
    def load(name, path):
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module
""")


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_gone(procs, timeout: float) -> list:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in procs if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in procs if _alive(p)]


def _kill_all(procs) -> None:
    """Test hygiene: nothing a failed test recorded stays behind."""
    for p in procs:
        if _alive(p):
            try:
                p.kill()
            except psutil.Error:
                pass


DUMMY_TRAINER = LOAD + textwrap.dedent("""
    import json, os, subprocess, sys, time
    guard = load("process_guard", sys.argv[1]).start_guard()
    py = sys.executable
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"
    # a plain child, and a child that ignores SIGTERM with a grandchild of its own
    plain = subprocess.Popen(["sleep", "300"])
    stubborn = subprocess.Popen([py, "-c", "import subprocess, signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); subprocess.Popen(['sleep', '300']); time.sleep(300)"])
    # a child that escapes into its own session, starts a grandchild that ignores SIGTERM, and exits: the
    # grandchild is reparented (to init or a subreaper) and is no longer a descendant of this process
    escaper = subprocess.Popen([py, "-c", "import os, subprocess, sys, time; os.setsid(); "
                                f"p = subprocess.Popen([sys.executable, '-c', {ignore_term!r}]); print(p.pid, flush=True); "
                                "time.sleep(2)"], stdout=subprocess.PIPE, text=True)
    orphan = int(escaper.stdout.readline())
    escaper.wait()
    time.sleep(0.5)
    print(json.dumps({"guard": guard.pid, "orphan": orphan}), flush=True)
    time.sleep(300)
""")


def test_kill_9_of_the_owner_leaves_no_descendant(tmp_path):
    script = tmp_path / "dummy_trainer.py"
    script.write_text(DUMMY_TRAINER)
    owner = subprocess.Popen([sys.executable, str(script), GUARD_PY], stdout=subprocess.PIPE, text=True)
    recorded = []
    try:
        info = json.loads(owner.stdout.readline())
        me = psutil.Process(owner.pid)
        recorded = me.children(recursive=True)
        orphan = psutil.Process(info["orphan"])
        assert orphan not in recorded and orphan.ppid() != owner.pid  # reparented: found by the record only
        assert psutil.Process(info["guard"]) in recorded
        assert os.getsid(info["guard"]) == info["guard"]  # its own session: group signals miss it
        recorded.append(orphan)
        assert len(recorded) >= 5 and all(_alive(p) for p in recorded)
        owner.kill()
        owner.wait()
        start = time.monotonic()
        left = _wait_gone(recorded, timeout=15)
        assert not left, f"survived: {left}"
        # poll 0.5 s + settle 1 s + SIGTERM grace 3 s (two of them ignore SIGTERM) + SIGKILL
        assert time.monotonic() - start < 10
    finally:
        owner.kill()
        _kill_all(recorded)


def test_guard_exits_with_its_owner_and_on_stop(tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(LOAD + textwrap.dedent("""
        import sys, time
        guard_module = load("process_guard", sys.argv[1])
        guard = guard_module.start_guard()
        assert guard_module.start_guard() is guard  # one per owner
        if sys.argv[2] == "stop":
            guard_module.stop_guard()
            assert guard.poll() is not None
        print(guard.pid, flush=True)
        time.sleep(1)  # the guard records nothing: it had no descendant but itself
    """))
    for mode in ("exit", "stop"):
        proc = subprocess.run([sys.executable, str(script), GUARD_PY, mode], capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stderr
        guard_pid = int(proc.stdout)
        deadline = time.monotonic() + 5
        while psutil.pid_exists(guard_pid) and time.monotonic() < deadline:  # reparented: init reaps it
            time.sleep(0.1)
        assert not psutil.pid_exists(guard_pid) or psutil.Process(guard_pid).status() == psutil.STATUS_ZOMBIE
        assert "left behind" not in proc.stderr


def test_first_signal_asks_to_stop_second_kills(tmp_path):
    script = tmp_path / "signals.py"
    script.write_text(LOAD + textwrap.dedent("""
        import os, signal, sys, time
        stop = load("stop_signals", sys.argv[1])
        with stop.stop_on_signals("got {signal}"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
            assert stop.received() == signal.SIGTERM
            assert signal.getsignal(signal.SIGINT) == signal.SIG_DFL
            assert stop.agreed_stop_signal() == signal.SIGTERM  # no process group: this process's own
            print("stopping", flush=True)
            os.kill(os.getpid(), signal.SIGINT)  # the second one: the default action, at once
            time.sleep(5)
        print("not reached", flush=True)
    """))
    proc = subprocess.run([sys.executable, str(script), SIGNALS_PY], capture_output=True, text=True, timeout=60)
    assert proc.stdout == "stopping\n" and "got SIGTERM" in proc.stderr, proc.stderr
    assert proc.returncode == -signal.SIGINT


@pytest.mark.slow
def test_spawned_children_start_in_their_own_session(tmp_path):
    script = tmp_path / "session.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp, os, signal, sys, time
        sys.path.insert(0, sys.argv[1])
        from megatron_dynamo.parallel.process_guard import children_in_own_session

        def child(q):
            q.put((os.getpid(), os.getsid(0)))
            time.sleep(1)  # a signal to the parent's process group must not reach this process
            q.put("alive")

        if __name__ == "__main__":
            os.setpgid(0, 0)
            ctx = mp.get_context("spawn")
            q = ctx.Queue()
            executable = mp.spawn.get_executable()
            with children_in_own_session():
                p = ctx.Process(target=child, args=(q,))
                p.start()
            pid, sid = q.get(timeout=60)
            assert pid == p.pid and sid == pid, (pid, p.pid, sid)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            os.killpg(0, signal.SIGINT)
            assert q.get(timeout=30) == "alive"
            p.join()
            assert p.exitcode == 0 and mp.spawn.get_executable() == executable
            print("ok")
    """))
    proc = subprocess.run([sys.executable, str(script), REPO], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _stop_worker(rank, world_size, ready_dir):
    from megatron_dynamo.parallel.stop_signals import agreed_stop_signal, stop_on_signals

    with stop_on_signals():
        steps = 0
        while True:
            steps += 1
            signum = agreed_stop_signal()
            if signum:
                return {"signum": signum, "steps": steps, "own_session": os.getsid(0) == os.getpid()}
            open(os.path.join(ready_dir, f"rank{rank}"), "w").close()
            time.sleep(0.2)


@pytest.mark.distributed
def test_signal_to_the_launcher_reaches_the_ranks_and_they_stop_together(tmp_path):
    script = tmp_path / "launcher.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        sys.path.insert(0, {REPO!r})
        from megatron_dynamo.parallel.spawn import run_on_ranks
        from megatron_dynamo.parallel.stop_signals import STOP_SIGNALS, received
        from test_process_guard import _stop_worker

        if __name__ == "__main__":
            results = run_on_ranks(_stop_worker, 2, sys.argv[1], forward=STOP_SIGNALS)
            print(json.dumps({{"results": results, "launcher": received()}}))
    """))
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[1][-3000:]
            time.sleep(0.2)
        launcher.send_signal(signal.SIGTERM)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, err[-3000:]
    report = json.loads(out)
    assert report["launcher"] == signal.SIGTERM
    first, second = report["results"]
    assert first["signum"] == second["signum"] == signal.SIGTERM
    assert first["steps"] == second["steps"]  # the same boundary on both ranks
    assert first["own_session"] and second["own_session"]


# ------------------------------------------------------------------------------ end to end: dynamo train on CPU
def _start_run(out_dir):
    """`dynamo train --nproc 2` on the CPU default, small and long (it must still be running when killed): two ranks,
    each hosting a vLLM engine in process, the engine leaders' reward workers. Returns the process once step 1 is
    logged and its descendants recorded then (pid + create time)."""
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", os.path.join(REPO, "configs", "cpu_default.yaml"),
           "--nproc", "2", f"trainer.output_dir={out_dir}", "trainer.steps=500", "trainer.sft_warmup_steps=2",
           "data.prompts_per_step=8", "trainer.mini_batch_prompts=4", "dynamo.allocation.n_avg=4",
           "dynamo.allocation.n_min=2", "dynamo.allocation.n_max=6", "data.synthetic_problems=16",
           "checkpoint.every=1000", "logging.tensorboard=false", "logging.plot=false"]
    os.makedirs(out_dir, exist_ok=True)
    stdout = open(os.path.join(out_dir, "stdout.txt"), "w")
    stderr = open(os.path.join(out_dir, "stderr.txt"), "w")
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=REPO)
    metrics = os.path.join(out_dir, "metrics.jsonl")
    deadline = time.monotonic() + 240
    while not (os.path.exists(metrics) and os.path.getsize(metrics) > 0):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the run did not reach step 1:\n" + open(stderr.name).read()[-3000:])
        time.sleep(0.5)
    return proc, psutil.Process(proc.pid).children(recursive=True)


def _rows(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.mark.slow
def test_sigterm_saves_the_step_and_kill_9_leaves_no_process(tmp_path):
    # (i) SIGTERM: the step in progress finishes, its checkpoint is saved, exit status 143, nothing survives.
    out = str(tmp_path / "term")
    proc, recorded = _start_run(out)
    try:
        ranks = [p for p in recorded if _alive(p) and p.ppid() == proc.pid and "python" in p.name().lower()]
        assert len(ranks) >= 2, recorded  # both ranks (and with them their engines) are up and recorded
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 143
        err = open(os.path.join(out, "stderr.txt")).read()
        step = _rows(out)[-1]["step"]
        assert step >= 1
        message = (f"dynamo train: stopped by SIGTERM after step {step}: its checkpoint is saved "
                   f"({out}/checkpoints/step_{step:06d}); run the same command with --resume to continue")
        assert message in err.splitlines(), err[-3000:]
        assert os.path.isdir(os.path.join(out, "checkpoints", f"step_{step:06d}"))
        assert open(os.path.join(out, "checkpoints", "latest")).read().strip() == f"step_{step:06d}"
        left = _wait_gone(recorded, timeout=15)
        assert not left, f"survived SIGTERM: {left}"
    finally:
        proc.kill()
        _kill_all(recorded)

    # (ii) kill -9: no handler runs; the watchdog stops everything the run started.
    out = str(tmp_path / "kill")
    proc, recorded = _start_run(out)
    try:
        proc.kill()
        proc.wait()
        left = _wait_gone(recorded, timeout=15)
        assert not left, f"survived kill -9: {[(p.pid, p.name()) for p in left]}"
    finally:
        _kill_all(recorded)


@pytest.mark.slow
def test_a_stop_during_a_long_warm_up_ends_it_after_its_step_with_nothing_saved(tmp_path):
    """Ctrl-C in a warm-up of minutes (`dynamo ablate`'s shared one is 800 steps) stops it after the warm-up step in
    progress on both ranks, not at its end: exit 130, one line that says nothing was saved, no process left."""
    out = str(tmp_path / "warmup")
    cmd = [sys.executable, "-m", "megatron_dynamo.cli", "train", os.path.join(REPO, "configs", "cpu_default.yaml"),
           "--nproc", "2", f"trainer.output_dir={out}", "trainer.sft_warmup_steps=100000", "trainer.steps=2",
           "logging.tensorboard=false", "logging.plot=false"]
    os.makedirs(out)
    stdout, stderr = open(os.path.join(out, "stdout.txt"), "w"), open(os.path.join(out, "stderr.txt"), "w")
    proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, cwd=REPO)
    recorded = []
    try:
        deadline = time.monotonic() + 240
        while "SFT warm-up: 100000 steps" not in open(stdout.name).read():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("the warm-up did not start:\n" + open(stderr.name).read()[-3000:])
            time.sleep(0.2)
        recorded = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 130
        err = open(stderr.name).read()
        stopped = [line for line in err.splitlines() if "during the SFT warm-up" in line]
        assert len(stopped) == 1 and stopped[0].startswith("dynamo train: stopped by SIGINT during the SFT warm-up, "
                                                           "after its step "), err[-3000:]
        assert "of 100000: nothing was saved (a warm-up is saved only whole)" in stopped[0]
        assert not os.path.exists(os.path.join(out, "checkpoints", "latest"))
        assert not _wait_gone(recorded, timeout=15)
    finally:
        proc.kill()
        _kill_all(recorded)
