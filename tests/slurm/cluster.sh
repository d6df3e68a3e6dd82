#!/usr/bin/env bash
# A real Slurm 22.05 test cluster on this machine: munge, slurmctld and four
# slurmd "virtual nodes" n[1-4] (slurmd -N nX, one port each) on localhost.
#
#   tests/slurm/cluster.sh up               start (idempotent: a healthy cluster is left as it is)
#   tests/slurm/cluster.sh down             stop every daemon and every job process
#   tests/slurm/cluster.sh status           sinfo; exit 1 if the cluster is not up
#   tests/slurm/cluster.sh kill-node NAME   kill NAME's slurmd and every process running for it
#   tests/slurm/cluster.sh revive-node NAME start NAME's slurmd again (ReturnToService=2 brings it back)
#   tests/slurm/cluster.sh env              print `export SLURM_CONF=...` for a shell
#   tests/slurm/cluster.sh logs             print the tail of every daemon log
#
# Needs root (the daemons run as root here) and Debian's slurm-wlm and munge.
# State, logs and slurm.conf live in $EXASERVE_SLURM_DIR (default /var/tmp/exaserve-slurm);
# clients find the cluster through SLURM_CONF=$EXASERVE_SLURM_DIR/slurm.conf.
#
# Which processes belong to a virtual node: every slurmd is started with
# EXASERVE_VNODE=<name> in its environment, which its slurmstepd processes inherit,
# and Slurm gives every task (and so its children) SLURMD_NODENAME=<name>.
# kill-node scans /proc for either; that works with proctrack/linuxproc and
# without cgroups, which several slurmd on one host cannot share.
set -euo pipefail

STATE="${EXASERVE_SLURM_DIR:-/var/tmp/exaserve-slurm}"
CONF="$STATE/slurm.conf"
NODES=(n1 n2 n3 n4)
CTLD_PORT="${EXASERVE_SLURMCTLD_PORT:-16817}"
NODE_PORT_BASE="${EXASERVE_SLURMD_PORT_BASE:-16820}"
CPUS=4
export SLURM_CONF="$CONF"

die() { echo "cluster.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "must run as root (the test cluster's daemons run as root)"

node_port() { echo $((NODE_PORT_BASE + ${1#n})); }

logs() {
    for f in "$STATE"/log/*.log; do
        [ -e "$f" ] || continue
        echo "=== $f (last 40 lines)"
        tail -n 40 "$f"
    done
}

write_conf() {
    mkdir -p "$STATE"/{ctld,log,spool,tmp}
    local tmp="$CONF.tmp"
    cat >"$tmp" <<EOF
# Written by tests/slurm/cluster.sh; four virtual nodes on localhost.
ClusterName=exaserve-test
SlurmctldHost=localhost
SlurmctldPort=$CTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd-%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
TmpFS=$STATE/tmp
# Several slurmd share one host: no cgroups, tasks tracked by process tree.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
# A dead node is noticed in about 10 s (default 300 s); it returns when its slurmd registers again.
SlurmdTimeout=10
ReturnToService=2
JobRequeue=1
InactiveLimit=0
KillWait=5
MinJobAge=600
MessageTimeout=10
NodeName=DEFAULT CPUs=$CPUS RealMemory=4000 State=UNKNOWN
EOF
    for n in "${NODES[@]}"; do
        echo "NodeName=$n NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(node_port "$n")" >>"$tmp"
    done
    echo "PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$tmp"
    mv "$tmp" "$CONF"
    # A plain shell (and the lmod test's login shell) finds the cluster without SLURM_CONF.
    mkdir -p /etc/slurm
    if [ ! -e /etc/slurm/slurm.conf ] || [ -L /etc/slurm/slurm.conf ]; then
        ln -sfn "$CONF" /etc/slurm/slurm.conf
    fi
}

munge_up() {
    if munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
        return 0
    fi
    [ -s /etc/munge/munge.key ] || {
        if command -v mungekey >/dev/null; then mungekey --create --keyfile=/etc/munge/munge.key
        else dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null; fi
    }
    chown munge:munge /etc/munge/munge.key /etc/munge
    chmod 0600 /etc/munge/munge.key
    chmod 0700 /etc/munge
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge
    chmod 0755 /run/munge
    rm -f /run/munge/munged.pid /run/munge/munge.socket.2*
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    die "munged did not start; see /var/log/munge/munged.log"
}

pid_alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pidfile_pid() { [ -s "$1" ] && cat "$1" || true; }

slurmctld_up() {
    if pid_alive "$(pidfile_pid "$STATE/slurmctld.pid")"; then return 0; fi
    # -i: ignore state files a previous, different configuration may have left.
    /usr/sbin/slurmctld -i -f "$CONF"
}

slurmd_up() {
    local n="$1"
    if pid_alive "$(pidfile_pid "$STATE/slurmd-$n.pid")"; then return 0; fi
    mkdir -p "$STATE/spool/$n"
    EXASERVE_VNODE="$n" /usr/sbin/slurmd -N "$n" -f "$CONF"
}

wait_idle() {
    # Every node must register and be usable (idle/mixed/alloc), else fail with the logs.
    local deadline=$((SECONDS + ${1:-60})) states
    while ((SECONDS < deadline)); do
        states="$(sinfo -h -N -o '%N %T' 2>/dev/null || true)"
        if [ "$(echo "$states" | grep -cE ' (idle|mixed|allocated)$')" -eq "${#NODES[@]}" ]; then
            return 0
        fi
        # A node left DOWN by an earlier kill comes back once resumed.
        for n in $(echo "$states" | awk '$2 ~ /down|drain|fail/ {print $1}'); do
            scontrol update nodename="$n" state=resume 2>/dev/null || true
        done
        sleep 1
    done
    echo "cluster.sh: nodes not ready after ${1:-60}s:" >&2
    echo "$states" >&2
    logs >&2
    exit 1
}

# Every process that belongs to virtual node $1 (its slurmd, slurmstepd and tasks), except ourselves.
node_pids() {
    local n="$1" pid env
    for dir in /proc/[0-9]*; do
        pid="${dir#/proc/}"
        [ "$pid" = "$$" ] || [ "$pid" = "$BASHPID" ] && continue
        env="$( { tr '\0' '\n' <"$dir/environ"; } 2>/dev/null)" || continue
        if grep -qxE "(EXASERVE_VNODE|SLURMD_NODENAME)=$n" <<<"$env"; then
            echo "$pid"
        fi
    done
}

kill_node() {
    local n="$1" pids
    [[ " ${NODES[*]} " == *" $n "* ]] || die "unknown node $n; nodes: ${NODES[*]}"
    local slurmd_pid
    slurmd_pid="$(pidfile_pid "$STATE/slurmd-$n.pid")"
    pid_alive "$slurmd_pid" && kill -9 "$slurmd_pid" 2>/dev/null || true
    # Repeat: a process may fork while we kill its parent.
    for _ in $(seq 20); do
        pids="$(node_pids "$n")"
        [ -z "$pids" ] && break
        kill -9 $pids 2>/dev/null || true
        sleep 0.1
    done
    rm -f "$STATE/slurmd-$n.pid"
    pids="$(node_pids "$n")"
    [ -z "$pids" ] || die "processes of $n survived: $pids"
    echo "killed node $n"
}

up() {
    command -v slurmctld >/dev/null || die "slurmctld not found; apt-get install slurm-wlm munge"
    munge_up
    if [ ! -s "$CONF" ] || ! pid_alive "$(pidfile_pid "$STATE/slurmctld.pid")"; then
        write_conf
    fi
    slurmctld_up
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
    scontrol ping 2>/dev/null | grep -q UP || { logs >&2; die "slurmctld did not answer scontrol ping"; }
    for n in "${NODES[@]}"; do slurmd_up "$n"; done
    wait_idle 60
    sinfo -N
}

down() {
    scancel --full $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    local pid
    for n in "${NODES[@]}"; do
        kill_node "$n" >/dev/null 2>&1 || true
    done
    pid="$(pidfile_pid "$STATE/slurmctld.pid")"
    if pid_alive "$pid"; then
        kill "$pid"
        for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
        pid_alive "$pid" && kill -9 "$pid" || true
    fi
    rm -f "$STATE/slurmctld.pid"
    echo "cluster down"
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) scontrol ping | grep -q UP && sinfo -N ;;
    kill-node) kill_node "${2:?node name}" ;;
    revive-node)
        n="${2:?node name}"
        slurmd_up "$n"
        echo "revived node $n"
        ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    logs) logs ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
esac
