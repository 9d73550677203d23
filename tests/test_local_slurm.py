"""scripts/local_slurm.sh: `down` undoes what `up` did (issue 33). Before, `down` left the /etc/hosts lines, munged
and the slurm.conf it wrote (having overwritten an existing one without a copy), and signalled whatever process a
stale pid file named.

The script runs for real against stub daemons (bash scripts named slurmctld, slurmd, munged: their process name is
what the script checks) with its paths moved into a sandbox (LOCAL_SLURM_*), so the host's cluster and files are
never touched. Root only (the script refuses otherwise)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="scripts/local_slurm.sh needs root")

DAEMON = """#!/bin/bash
# A stub daemon: forks into the background (as the real ones do), writes its pid file, runs until signalled.
if [[ ${1:-} != --foreground ]]; then
  "$0" --foreground "$@" >/dev/null 2>&1 &
  exit 0
fi
shift
%s
echo $$ > "$pidfile"
while true; do sleep 0.2; done
"""
STUBS = {
    "slurmctld": DAEMON % 'pidfile=$(sed -n "s/^SlurmctldPidFile=//p" "$SLURM_CONF")',
    "slurmd": DAEMON % 'node=$2; pidfile=$(sed -n "s/^SlurmdPidFile=//p" "$SLURM_CONF"); pidfile=${pidfile//%n/$node}',
    "munged": DAEMON % 'pidfile=$LOCAL_SLURM_MUNGE_RUN/munged.pid',
    "munge": '#!/bin/bash\npid=$(cat "$LOCAL_SLURM_MUNGE_RUN/munged.pid" 2>/dev/null) && [[ -d /proc/$pid ]] '
             '&& echo CRED\n',
    "unmunge": '#!/bin/bash\ngrep -q CRED\n',
    # As the real ones: no answer until slurmctld runs, a node idle once its slurmd runs (has written its pid file)
    "sinfo": '#!/bin/bash\n[[ -s $(sed -n "s/^SlurmctldPidFile=//p" "$SLURM_CONF") ]] || exit 1\n'
             'pidfile=$(sed -n "s/^SlurmdPidFile=//p" "$SLURM_CONF")\n'
             'for n in n1 n2; do if [[ -s ${pidfile//%n/$n} ]]; then echo "$n idle"; else echo "$n down"; fi; done\n',
    "scontrol": "#!/bin/bash\nexit 0\n",
    "sbatch": "#!/bin/bash\nexit 0\n",
}


@pytest.fixture
def sandbox(tmp_path):
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in STUBS.items():
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    paths = {name: tmp_path / name for name in ("etc", "state", "log", "run", "munge_etc", "munge_run")}
    (tmp_path / "etc").mkdir()
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost\n10.0.0.5 fileserver\n")
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "LOCAL_SLURM_HOSTS": str(hosts),
           **{f"LOCAL_SLURM_{name.upper()}": str(path) for name, path in paths.items()}}
    started = []

    def script(action: str) -> subprocess.CompletedProcess:
        proc = subprocess.run(["bash", str(ROOT / "scripts" / "local_slurm.sh"), action], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc

    def pid(name: str) -> int:
        return int(Path(name).read_text())

    script.paths, script.hosts, script.env, script.pid, script.started = paths, hosts, env, pid, started
    yield script
    # Whatever a failed test left running: the stub daemons named by their pid files (checked to be ours).
    for pidfile in [*paths["run"].glob("*.pid"), paths["munge_run"] / "munged.pid"] if paths["run"].exists() else []:
        if pidfile.exists():
            pid = int(pidfile.read_text())
            cmdline = Path(f"/proc/{pid}/cmdline")
            if cmdline.exists() and str(stubs) in cmdline.read_text():
                os.kill(pid, 9)
    for process in started:
        process.kill()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not _alive(pid)


def test_down_puts_back_the_hosts_file_the_config_and_munged_and_never_signals_a_stranger(sandbox):
    p = sandbox.paths
    before_hosts = sandbox.hosts.read_bytes()
    theirs = b"# the site's own slurm.conf\nClusterName=site\n"
    (p["etc"] / "slurm.conf").write_bytes(theirs)

    up = sandbox("up")
    assert "local_slurm: up: n1 idle n2 idle" in up.stdout
    added = sandbox.hosts.read_text().splitlines()[-2:]
    assert added == ["127.0.0.1 n1", "127.0.0.1 n2"]
    assert (p["etc"] / "slurm.conf").read_text().startswith("# Written by scripts/local_slurm.sh")
    assert (p["munge_etc"] / "munge.key").stat().st_size == 1024
    daemons = {"slurmctld": sandbox.pid(p["run"] / "slurmctld.pid"), "n1": sandbox.pid(p["run"] / "slurmd-n1.pid"),
               "n2": sandbox.pid(p["run"] / "slurmd-n2.pid"), "munged": sandbox.pid(p["munge_run"] / "munged.pid")}
    assert all(_alive(pid) for pid in daemons.values())
    ours = (p["etc"] / "slurm.conf").read_bytes()
    assert "local_slurm: up:" in sandbox("up").stdout  # up again: only a check
    assert (p["etc"] / "slurm.conf").read_bytes() == ours and sandbox.hosts.read_text().count("127.0.0.1 n1") == 1
    assert (p["state"] / "undo" / "slurm.conf.before").read_bytes() == theirs

    # slurmd n2 died and its pid now belongs to an unrelated process: down must leave that process alone.
    os.kill(daemons["n2"], 15)
    assert _wait_dead(daemons["n2"])
    stranger = subprocess.Popen(["sleep", "600"])
    sandbox.started.append(stranger)
    (p["run"] / "slurmd-n2.pid").write_text(f"{stranger.pid}\n")

    down = sandbox("down")
    assert f"{p['run'] / 'slurmd-n2.pid'} does not name a running slurmd (-N n2): nothing signalled" in down.stdout
    assert _alive(stranger.pid)
    assert all(_wait_dead(daemons[name]) for name in ("slurmctld", "n1", "munged"))
    assert sandbox.hosts.read_bytes() == before_hosts
    assert (p["etc"] / "slurm.conf").read_bytes() == theirs
    assert not (p["munge_etc"] / "munge.key").exists()
    assert not p["state"].exists() and not p["run"].exists()


def test_down_leaves_what_was_there_before_up(sandbox):
    """munged already running and a munge key already there (another user of munge): up uses them and down leaves
    them; no slurm.conf before: down removes the one up wrote; hosts lines present before are kept."""
    p = sandbox.paths
    sandbox.hosts.write_text(sandbox.hosts.read_text() + "127.0.0.1 n1\n")
    before_hosts = sandbox.hosts.read_bytes()
    p["munge_etc"].mkdir()
    (p["munge_etc"] / "munge.key").write_bytes(b"k" * 1024)
    p["munge_run"].mkdir()
    subprocess.run([str(Path(sandbox.env["PATH"].split(":")[0]) / "munged"), "--force"], env=sandbox.env, check=True)
    deadline = time.monotonic() + 10
    while not (p["munge_run"] / "munged.pid").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    munged = sandbox.pid(p["munge_run"] / "munged.pid")

    sandbox("up")
    assert sandbox.hosts.read_text().count("127.0.0.1 n1") == 1 and "127.0.0.1 n2" in sandbox.hosts.read_text()
    sandbox("down")
    assert _alive(munged) and (p["munge_etc"] / "munge.key").read_bytes() == b"k" * 1024
    assert sandbox.hosts.read_bytes() == before_hosts
    assert not (p["etc"] / "slurm.conf").exists()
    os.kill(munged, 15)
