#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, so that the launcher test can run a job with a
# real `srun` (tests/workers.rs, srun_launches_a_job_with_one_command). Debian's slurm-wlm with
# munge authentication; the node is this host with all its CPUs, and each CPU may take up to four
# tasks, since a dfc job's processes mostly wait on each other. Idempotent: a running controller
# is left alone. Run as root or with sudo.
set -euo pipefail

sudo=""
[ "$(id -u)" -eq 0 ] || sudo=sudo

if sinfo --noheader --states=idle,mix,alloc 2>/dev/null | grep -q .; then
    echo "slurm: already up"
    exit 0
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    $sudo apt-get update -qq
    $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge
fi

host=$(hostname -s)
conf=$(mktemp)
cat >"$conf" <<EOF
ClusterName=dfc
SlurmctldHost=$host
MpiDefault=none
ProctrackType=proctrack/linuxproc
ReturnToService=2
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/lib/slurm/slurmd
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmUser=root
SlurmdUser=root
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AuthType=auth/munge
CredType=cred/munge
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$host CPUs=$(nproc) State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
$sudo mkdir -p /etc/slurm /var/lib/slurm/slurmd /var/lib/slurm/slurmctld /var/log/slurm /run/munge
$sudo install -m 644 "$conf" /etc/slurm/slurm.conf
rm -f "$conf"

# munge: a key if the package did not make one, then the daemon (as its own user where it exists).
if [ ! -s /etc/munge/munge.key ]; then
    $sudo mkdir -p /etc/munge
    $sudo dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
if id munge >/dev/null 2>&1; then
    $sudo chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    $sudo chmod 400 /etc/munge/munge.key
    pgrep -x munged >/dev/null || $sudo su -s /bin/sh munge -c /usr/sbin/munged
else
    $sudo chmod 400 /etc/munge/munge.key
    pgrep -x munged >/dev/null || $sudo /usr/sbin/munged --force
fi

pgrep -x slurmctld >/dev/null || $sudo slurmctld
pgrep -x slurmd >/dev/null || $sudo slurmd

for _ in $(seq 60); do
    if sinfo --noheader --states=idle,mix,alloc 2>/dev/null | grep -q .; then
        sinfo
        exit 0
    fi
    sleep 1
done
echo "slurm: the node did not come up; logs in /var/log/slurm" >&2
sinfo >&2 || true
exit 1
