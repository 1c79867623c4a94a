"""A private Slurm cluster for the tests: one controller and two compute nodes on this host.

Debian's Slurm (22.05) runs two ``slurmd`` on one host when each has its own
``NodeName``, ``Port`` and spool/pid/log files; both nodes have ``NodeAddr``
127.0.0.1, the address a job's rendezvous is taken from. The cluster has its own
munge daemon and key, its own ports and state folder, and no accounting:
``squeue``/``scontrol`` answer what ``sacct`` would. Everything it starts is
stopped when the context ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

NODES = ("n1", "n2")
CONF = """\
ClusterName=astraitest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/sock
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdTimeout={slurmd_timeout}
KillWait=30
MinJobAge=600
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_port_1} CPUs=2 State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port={node_port_2} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""


def available() -> str | None:
    """Why no cluster can run here, or None when one can."""
    missing = [name for name in ("slurmctld", "slurmd", "sbatch", "munged") if shutil.which(name) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}; .ci/setup installs it)"
    if os.geteuid() != 0:
        return "the test cluster runs its daemons as root"
    return None


class Cluster:
    """``with Cluster(folder) as cluster:`` — ``cluster.env`` is the environment its commands need."""

    def __init__(self, root: Path, *, ctld_port: int = 16817, node_ports=(17001, 17002), slurmd_timeout: int = 300):
        self.root = Path(root)
        self.ports = dict(ctld_port=ctld_port, node_port_1=node_ports[0], node_port_2=node_ports[1])
        self.slurmd_timeout = slurmd_timeout
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def __enter__(self) -> Cluster:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *_exc) -> None:
        self.stop()

    def run(self, *command: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def _start(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(parents=True, mode=0o700)
        key = munge / "key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        for name in ("state", "spool"):
            (self.root / name).mkdir()
        (self.root / "slurm.conf").write_text(
            CONF.format(root=self.root, slurmd_timeout=self.slurmd_timeout, **self.ports), encoding="utf-8"
        )
        subprocess.run(
            [
                "munged",
                "--force",
                f"--socket={munge / 'sock'}",
                f"--key-file={key}",
                f"--log-file={munge / 'log'}",
                f"--pid-file={munge / 'pid'}",
                f"--seed-file={munge / 'seed'}",
            ],
            check=True,
            capture_output=True,
        )
        subprocess.run(["slurmctld", "-c"], env=self.env, check=True, capture_output=True)
        for node in NODES:
            subprocess.run(["slurmd", "-N", node], env=self.env, check=True, capture_output=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            states = self.run("sinfo", "--noheader", "--Node", "--format=%N %t", check=False).stdout.split()
            if states.count("idle") == len(NODES):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test cluster's nodes did not become idle: {states}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(
            f"--- {path.name}\n{path.read_text(errors='replace')[-3000:]}" for path in sorted(self.root.glob("*.log"))
        )

    def stop(self) -> None:
        """Cancel every job, then stop the daemons (by their pid files) and wait until they are gone."""
        if (self.root / "slurmctld.pid").exists():
            self.run("scancel", "--user", "root", check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.run("squeue", "--noheader", check=False).stdout.strip():
                time.sleep(0.5)
        pids = [self.root / f"slurmd-{node}.pid" for node in NODES]
        pids += [self.root / "slurmctld.pid", self.root / "munge" / "pid"]
        for pid_file in pids:
            try:
                pid = int(pid_file.read_text().strip())
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError):
                continue
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[-1][0] != "Z"
    except OSError:
        return False
