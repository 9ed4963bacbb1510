"""A real, private SLURM cluster on this machine: one slurmctld and two fake nodes (n1, n2), each a slurmd.

Everything lives in one temporary directory: slurm.conf (clients find it through SLURM_CONF), state, spool, logs,
pid files, a private munged with its own key and socket (AuthInfo=socket=...), on free ports, and a hosts file that
names n1 and n2. Every daemon runs in a mount namespace of its own (`unshare --mount`) in which that file is
bind-mounted over /etc/hosts, so the nodes' names resolve for the daemons and the jobs they start (MASTER_ADDR is the
first node's name) and nowhere else. Nothing under /etc is written, and a SLURM or munge already on the machine is left
alone. The one change to the machine is the Debian packages (slurmctld slurmd slurm-client munge), installed when
missing: `install()` returns exactly the packages it added and `uninstall()` purges exactly those, so the machine ends
as it began.

`stop()` kills exactly the pids in this cluster's pid files. `unavailable()` says why the machine cannot run it
(not root, no apt-get, no unshare, not Linux); the tests skip with that reason, except in CI (CI=true), where they fail.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge"]
BINARIES = ["slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munged"]
NODES = ("n1", "n2")
HOSTS_LINE = "127.0.0.1 n1 n2  # trainer3d tests/helpers/slurm_cluster.py"
# Runs a command in a new mount namespace with $0 (the cluster's hosts file) over /etc/hosts; a daemon it starts stays
# in that namespace, and so do the jobs a slurmd forks.
IN_PRIVATE_HOSTS = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$0" /etc/hosts && exec "$@"']


class ClusterError(RuntimeError):
    pass


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def unavailable() -> str | None:
    """Why this machine cannot run the cluster, or None if it can (possibly after installing packages)."""
    if not sys.platform.startswith("linux"):
        return "SLURM tests need Linux"
    if os.geteuid() != 0:
        if all(shutil.which(b) for b in BINARIES):
            return "SLURM tests need root (the daemons run jobs as any user)"
        return "SLURM is not installed and installing it needs root"
    if not shutil.which("unshare"):
        return "SLURM tests need util-linux's unshare (each daemon gets a private /etc/hosts)"
    if not all(shutil.which(b) for b in BINARIES) and not shutil.which("apt-get"):
        return "SLURM is not installed and there is no apt-get to install it"
    return None


def _run(cmd: list[str], timeout: float, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and p.returncode != 0:
        raise ClusterError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return p


def installed_packages() -> set[str]:
    out = _run(["dpkg-query", "-W", "-f", "${Package} ${db:Status-Abbrev}\n"], 60).stdout
    return {line.split()[0] for line in out.splitlines() if line.split()[1:] and line.split()[1].startswith("ii")}


def install(timeout: float = 600) -> list[str]:
    """apt-get install the packages if a binary is missing (about 12 s; an `apt-get update` first if needed); returns
    the packages this added, their dependencies included (none when everything was there)."""
    if all(shutil.which(b) for b in BINARIES):
        return []
    before = installed_packages()
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    try:
        if _run(cmd, timeout, env, check=False).returncode != 0:
            _run(["apt-get", "update"], timeout, env)
            _run(cmd, timeout, env)
    finally:
        added = sorted(installed_packages() - before)
    missing = [b for b in BINARIES if not shutil.which(b)]
    if missing:
        uninstall(added)
        raise ClusterError(f"installed {PACKAGES} but {missing} are still not on PATH")
    return added


def uninstall(packages: list[str], timeout: float = 600) -> None:
    """Purge exactly `packages` (what install() added), configuration files included."""
    if packages:
        _run(["apt-get", "purge", "-y", *packages], timeout, {**os.environ, "DEBIAN_FRONTEND": "noninteractive"})


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return not re.search(r"^State:\s+Z", f.read(), re.M)  # a zombie has exited
    except OSError:
        return False


class SlurmCluster:
    def __init__(self, cpus_per_node: int = 2):
        # Not under pytest's tmp dirs: munged wants every parent of its socket world-executable (those are 0700).
        self.dir = Path(tempfile.mkdtemp(prefix="trainer3d-slurm-"))
        self.dir.chmod(0o755)
        self.conf = self.dir / "slurm.conf"
        self.cpus = cpus_per_node
        self.pid_files: list[Path] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.hosts = self.dir / "hosts"  # /etc/hosts as the daemons and their jobs see it
        self.hosts.write_text(Path("/etc/hosts").read_text().rstrip("\n") + "\n" + HOSTS_LINE + "\n")
        self.hosts.chmod(0o644)

    # ---- start / stop --------------------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> None:
        d = self.dir
        for sub in ("state", "spool", "log", "munge"):
            (d / sub).mkdir(mode=0o755)
        ctld_port, n1_port, n2_port = _free_ports(3)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        sock = d / "munge" / "munge.sock"
        self._daemon(
            ["munged", f"--socket={sock}", f"--key-file={key}", f"--pid-file={d / 'munge' / 'munged.pid'}",
             f"--log-file={d / 'log' / 'munged.log'}", f"--seed-file={d / 'munge' / 'munged.seed'}"],
            d / "munge" / "munged.pid", timeout,
        )
        nodes = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} RealMemory=4000 "
            "State=UNKNOWN"
            for n, p in zip(NODES, (n1_port, n2_port))
        )
        self.conf.write_text(f"""# trainer3d tests: a private two-node cluster on one machine
ClusterName=trainer3d
SlurmctldHost=localhost
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
StateSaveLocation={d / 'state'}
SlurmdSpoolDir={d / 'spool'}/%n
SlurmctldPidFile={d / 'slurmctld.pid'}
SlurmdPidFile={d / 'slurmd-%n.pid'}
SlurmctldLogFile={d / 'log' / 'slurmctld.log'}
SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
KillWait=10
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        self._daemon(["slurmctld", "-f", str(self.conf)], d / "slurmctld.pid", timeout)
        for n in NODES:
            (d / "spool" / n).mkdir(mode=0o755)
            self._daemon(["slurmd", "-f", str(self.conf), "-N", n], d / f"slurmd-{n}.pid", timeout)
        deadline = time.monotonic() + timeout
        while True:
            out = self.cmd(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], check=False).stdout.split()
            if set(NODES) <= set(out):
                return
            if time.monotonic() > deadline:
                raise ClusterError(f"nodes not idle after {timeout:.0f} s: {self.cmd(['sinfo', '-N'], check=False)}"
                                   f"\n{self.logs()}")
            time.sleep(0.5)

    def _daemon(self, cmd: list[str], pid_file: Path, timeout: float) -> None:
        """Start a self-daemonizing program, in a mount namespace of its own with the cluster's hosts file, and wait
        for its pid file (recorded for stop())."""
        self.pid_files.append(pid_file)
        _run([*IN_PRIVATE_HOSTS, str(self.hosts), *cmd], timeout, self.env)
        deadline = time.monotonic() + timeout
        while not (pid_file.exists() and pid_file.read_text().strip()):
            if time.monotonic() > deadline:
                raise ClusterError(f"{cmd[0]} wrote no pid file {pid_file}\n{self.logs()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 20) -> None:
        """Kill exactly the daemons this cluster started (SIGTERM, then SIGKILL), slurmds first."""
        pids = []
        for pid_file in reversed(self.pid_files):
            try:
                pids.append(int(pid_file.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                continue
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        self.pid_files = []

    def cleanup(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- using it ------------------------------------------------------------------------------------------
    def cmd(self, args: list[str], timeout: float = 30, check: bool = True, env: dict | None = None, cwd=None):
        p = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env or self.env, cwd=cwd)
        if check and p.returncode != 0:
            raise ClusterError(f"{' '.join(args)} failed ({p.returncode}): {p.stdout}{p.stderr}")
        return p

    def sbatch(self, args: list[str], cwd, env: dict | None = None) -> int:
        env = {**(env or os.environ), "SLURM_CONF": str(self.conf)}
        out = self.cmd(["sbatch", "--parsable", *args], cwd=cwd, env=env).stdout
        return int(out.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """`scontrol show job` as a dict (key=value pairs)."""
        out = self.cmd(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait(self, job_id: int, timeout: float, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                                                        "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE")) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            info = self.job(job_id)
            if info.get("JobState") in until:
                return info
            if time.monotonic() > deadline:
                self.cmd(["scancel", str(job_id)], check=False)
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout:.0f} s: {info}")
            time.sleep(1.0)

    def logs(self) -> str:
        parts = []
        for path in sorted((self.dir / "log").glob("*.log")):
            parts.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-20:]))
        return "\n".join(parts)
