#!/usr/bin/env bash
# A real Slurm 22.05 test cluster on this machine, as close to a centre's GPU partition as one host
# allows: munge, slurmctld and four slurmd "virtual nodes" n[1-4], each one
#   - in its own network namespace (exaserve-nX) with its own address 10.77.0.X on a bridge
#     (exa-br0, 10.77.0.254 = the slurmctld host), its name in /etc/hosts, its own hostname (UTS
#     namespace), so whatever a job publishes under the node's name is that node's address;
#   - in its own mount namespace with a private /tmp and /dev/shm (tmpfs), so L2 weight caches and
#     PMIx's per-job directories are per node, as on real nodes;
#   - with GRES gpu:4 backed by character devices this script makes (c 195 N, the NVIDIA major), so
#     Slurm grants GPUs, sets CUDA_VISIBLE_DEVICES / SLURM_STEP_GPUS and confines steps to them;
#   - under proctrack/cgroup + task/cgroup (cgroup v1), each node with its own hierarchy slurm_nX.
# No traffic leaves the machine: the 10.77.0.0/24 network exists only on the bridge and in the
# namespaces (no default route, no forwarding, no NAT).
#
#   tests/slurm/cluster.sh up               start (idempotent: a healthy cluster is left as it is)
#   tests/slurm/cluster.sh munge            start munged only (idempotent; accounting.sh uses it)
#   tests/slurm/cluster.sh down             stop everything; remove namespaces, bridge, hosts entries, cgroups
#   tests/slurm/cluster.sh status           sinfo; exit 1 if the cluster is not up
#   tests/slurm/cluster.sh kill-node NAME   cut NAME's link and kill every process of NAME (slurmd, steps, tasks)
#   tests/slurm/cluster.sh revive-node NAME link up, start NAME's slurmd again (ReturnToService=2 brings it back)
#   tests/slurm/cluster.sh exec NAME CMD..  run CMD on NAME (its network, mount and UTS namespaces)
#   tests/slurm/cluster.sh shm NAME         print the root-namespace path of NAME's /dev/shm
#   tests/slurm/cluster.sh env              print `export SLURM_CONF=...` for a shell
#   tests/slurm/cluster.sh logs             print the tail of every daemon log
#
# Needs root and Debian's slurm-wlm, munge and iproute2 (tests/run.sh installs them).
# State, logs and configuration live in $EXASERVE_SLURM_DIR (default /var/tmp/exaserve-slurm);
# clients find the cluster through SLURM_CONF=$EXASERVE_SLURM_DIR/slurm.conf (or /etc/slurm/slurm.conf,
# a link to it). Jobs' shared files (site file, job directories) must live outside /tmp, which is
# private per node: under $EXASERVE_SLURM_DIR/shared, say (as on a real cluster's shared filesystem).
set -euo pipefail

STATE="${EXASERVE_SLURM_DIR:-/var/tmp/exaserve-slurm}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)"
CONF="$STATE/slurm.conf"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
NODES=(n1 n2 n3 n4)
NET="${EXASERVE_SLURM_NET:-10.77.0}"   # /24; nodes .1-.4, the slurmctld host .254
BRIDGE=exa-br0
CTLD_ADDR="$NET.254"
CTLD_PORT="${EXASERVE_SLURMCTLD_PORT:-16817}"
NODE_PORT_BASE="${EXASERVE_SLURMD_PORT_BASE:-16820}"
CPUS=4
MEMORY_MB=4000
GPUS=4
SHM_SIZE=1g
HOSTS_MARK="# exaserve-test-cluster"
LAYOUT="layout v3 (netns, gres, cgroup v1, task exit codes logged)"  # a conf without this line is from an older script: rebuilt
CGROUP_ROOT=/sys/fs/cgroup
export SLURM_CONF="$CONF"

die() { echo "cluster.sh: $*" >&2; exit 1; }
[ "$(id -u)" -eq 0 ] || die "must run as root (the test cluster's daemons and namespaces need it)"

is_node() { [[ " ${NODES[*]} " == *" $1 "* ]] || die "unknown node $1; nodes: ${NODES[*]}"; }
node_port() { echo $((NODE_PORT_BASE + ${1#n})); }
node_addr() { echo "$NET.${1#n}"; }
netns() { echo "exaserve-$1"; }
veth() { echo "exa-$1"; }

logs() {
    for f in "$STATE"/log/*.log; do
        [ -e "$f" ] || continue
        echo "=== $f (last 40 lines)"
        tail -n 40 "$f"
    done
}

# --- network: a bridge in the root namespace, one namespace + veth pair per node ---------------
net_up() {
    if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
        ip link add "$BRIDGE" type bridge
    fi
    ip addr replace "$CTLD_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for n in "${NODES[@]}"; do node_net_up "$n"; done
}

node_net_up() {
    local n="$1" ns veth
    ns="$(netns "$n")" veth="$(veth "$n")"
    [ -e "/var/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
        ip link add "$veth" type veth peer name eth0 netns "$ns"
        ip link set "$veth" master "$BRIDGE"
    fi
    ip link set "$veth" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr replace "$(node_addr "$n")/24" dev eth0
    ip -n "$ns" link set eth0 up
}

net_down() {
    for n in "${NODES[@]}"; do
        ip link del "$(veth "$n")" 2>/dev/null || true
        ip netns del "$(netns "$n")" 2>/dev/null || true
    done
    ip link del "$BRIDGE" 2>/dev/null || true
}

# /etc/hosts may be a bind mount (containers): rewrite it in place, never replace the file.
hosts_up() {
    local kept
    kept="$(grep -v "$HOSTS_MARK" /etc/hosts || true)"
    {
        printf '%s\n' "$kept"
        for n in "${NODES[@]}"; do echo "$(node_addr "$n") $n $HOSTS_MARK"; done
    } >/etc/hosts
}

hosts_down() {
    local kept
    grep -q "$HOSTS_MARK" /etc/hosts 2>/dev/null || return 0
    kept="$(grep -v "$HOSTS_MARK" /etc/hosts || true)"
    printf '%s\n' "$kept" >/etc/hosts
}

# --- per-node files: GPU device nodes, private /tmp and /dev/shm ---------------------------------
node_files_up() {
    mkdir -p "$STATE/dev"
    for g in $(seq 0 $((GPUS - 1))); do
        # Slurm refuses regular files as GRES ("not a valid character or block device"); 195 is
        # the NVIDIA major, so the devices cgroup rules Slurm writes are the ones a real node gets.
        [ -c "$STATE/dev/gpu$g" ] || { rm -f "$STATE/dev/gpu$g"; mknod "$STATE/dev/gpu$g" c 195 "$g"; }
    done
    for n in "${NODES[@]}"; do
        mkdir -p "$STATE/nodes/$n/tmp" "$STATE/nodes/$n/shm" "$STATE/spool/$n"
        chmod 1777 "$STATE/nodes/$n/tmp"
        # The node's /dev/shm is a tmpfs mounted here, in the root namespace, so tests and `shm NAME`
        # can look into it; the node's mount namespace binds it over /dev/shm.
        mountpoint -q "$STATE/nodes/$n/shm" ||
            mount -t tmpfs -o "size=$SHM_SIZE,mode=1777,huge=within_size" tmpfs "$STATE/nodes/$n/shm" 2>/dev/null ||
            mount -t tmpfs -o "size=$SHM_SIZE,mode=1777" tmpfs "$STATE/nodes/$n/shm"
    done
}

node_files_down() {
    for n in "${NODES[@]}"; do
        mountpoint -q "$STATE/nodes/$n/shm" && umount -l "$STATE/nodes/$n/shm" || true
        rm -rf "$STATE/nodes/$n"
    done
}

# --- configuration ----------------------------------------------------------------------------
write_conf() {
    mkdir -p "$STATE"/{ctld,log,spool,shared}
    chmod 1777 "$STATE/shared"
    local tmp="$CONF.tmp"
    cat >"$tmp" <<EOF
# Written by tests/slurm/cluster.sh, $LAYOUT: four virtual nodes, one network namespace each.
ClusterName=exaserve-test
SlurmctldHost=$(hostname)($CTLD_ADDR)
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
# verbose: slurmstepd logs every task's exit code ("task N (PID) exited with exit code C"), which
# the tests read per rank (no accounting database here, so no sacct).
SlurmdDebug=verbose
# /tmp is private per node (each slurmd runs in its own mount namespace).
TmpFS=/tmp
# Production defaults: cgroup process tracking and confinement (cgroup.conf beside this file).
ProctrackType=proctrack/cgroup
TaskPlugin=task/cgroup
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
SlurmdParameters=config_overrides
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
# The admins' epilog shipped in sbatch/ (removes leftover L2 files); it logs what it removed.
Epilog=$STATE/epilog.sh
# A dead node is noticed in about 10 s (default 300 s); it returns when its slurmd registers again.
SlurmdTimeout=10
ReturnToService=2
JobRequeue=1
InactiveLimit=0
# Grace between a job's SIGTERM and its SIGKILL (scancel, time limit, preemption).
KillWait=30
MinJobAge=600
MessageTimeout=10
NodeName=DEFAULT CPUs=$CPUS RealMemory=$MEMORY_MB Gres=gpu:$GPUS State=UNKNOWN
EOF
    for n in "${NODES[@]}"; do
        echo "NodeName=$n NodeHostname=$n NodeAddr=$(node_addr "$n") Port=$(node_port "$n")" >>"$tmp"
    done
    echo "PartitionName=debug Nodes=n[1-4] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$tmp"
    # Every node names the same four device files: the devices cgroup works on major:minor numbers.
    echo "NodeName=n[1-4] Name=gpu File=$STATE/dev/gpu[0-$((GPUS - 1))]" >"$STATE/gres.conf"
    # The four virtual nodes share this machine's cores and memory, so no cpuset confinement (it would
    # pin each node's "CPUs 0-3" to the same real cores, some of which may not exist); memory and
    # devices are confined as on a production node.
    cat >"$STATE/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=yes
ConstrainDevices=yes
EOF
    # PMIx keeps per-job directories here; /tmp is per node, so they never collide between nodes.
    echo "PMIxCliTmpDirBase=/tmp" >"$STATE/mpi.conf"
    cat >"$STATE/epilog.sh" <<EOF
#!/bin/sh
EXASERVE_EPILOG_LOG=$STATE/log/epilog.log exec $ROOT/sbatch/exaserve-epilog.sh
EOF
    chmod 0755 "$STATE/epilog.sh"
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

# Start node $1's slurmd inside its network namespace, in a new mount and UTS namespace where /tmp
# and /dev/shm are the node's own and the hostname is the node's name. `nsenter --net`, not
# `ip netns exec`: the latter remounts /sys, and slurmd then finds no cgroup filesystem.
# munge's socket (/run/munge) is shared with the root namespace, as a node's munged would answer.
slurmd_up() {
    local n="$1"
    if pid_alive "$(pidfile_pid "$STATE/slurmd-$n.pid")"; then return 0; fi
    mkdir -p "$STATE/spool/$n"
    # The jobs run this checkout's own install: a checkout under /tmp (a CI clone, say) stays visible at
    # its path inside the node's private /tmp, as a home or project directory would on a real cluster.
    local repo=""
    case "$REPO_ROOT/" in /tmp/*) repo="$REPO_ROOT"; mkdir -p "$STATE/nodes/$n/tmp${repo#/tmp}" ;; esac
    EXASERVE_VNODE="$n" nsenter --net="/var/run/netns/$(netns "$n")" -- \
        unshare --mount --uts --propagation private -- sh -c '
            set -e
            hostname "$1"
            [ -z "$4" ] || mount --bind "$4" "$2/nodes/$1/tmp${4#/tmp}"
            mount --rbind "$2/nodes/$1/tmp" /tmp
            mount --bind "$2/nodes/$1/shm" /dev/shm
            exec /usr/sbin/slurmd -N "$1" -f "$3"' slurmd-up "$n" "$STATE" "$CONF" "$repo"
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

# --- which processes are a node's ------------------------------------------------------------
# Every process of node $1 lives in its network namespace (slurmd was started there; steps and tasks
# inherit it), so the namespace's inode names them all, whatever their cgroup or environment. The
# EXASERVE_VNODE/SLURMD_NODENAME scan is a backstop for daemons an older layout started.
node_pids() {
    local n="$1" pid env ns_inode=""
    [ -e "/var/run/netns/$(netns "$n")" ] && ns_inode="$(stat -L -c %i "/var/run/netns/$(netns "$n")")"
    for dir in /proc/[0-9]*; do
        pid="${dir#/proc/}"
        { [ "$pid" = "$$" ] || [ "$pid" = "$BASHPID" ]; } && continue
        if [ -n "$ns_inode" ] && [ "$(stat -L -c %i "$dir/ns/net" 2>/dev/null)" = "$ns_inode" ]; then
            echo "$pid"
            continue
        fi
        env="$( { tr '\0' '\n' <"$dir/environ"; } 2>/dev/null)" || continue
        if grep -qxE "(EXASERVE_VNODE|SLURMD_NODENAME)=$n" <<<"$env"; then
            echo "$pid"
        fi
    done
}

# The node's cgroup directories (proctrack/cgroup + task/cgroup make slurm_<node> in each controller).
node_cgroups() { ls -d "$CGROUP_ROOT"/*/"slurm_$1" 2>/dev/null || true; }

freeze_node() {
    local f="$CGROUP_ROOT/freezer/slurm_$1"
    # Freezing the whole subtree first means no task can fork while we kill it.
    [ -e "$f/freezer.state" ] && echo "$2" >"$f/freezer.state" 2>/dev/null || true
}

remove_cgroups() {
    local dir
    for dir in $(node_cgroups "$1"); do
        find "$dir" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
}

kill_node() {
    local n="$1" pids
    is_node "$n"
    # A dead node answers nothing: take its link down first, so peers see silence, not resets.
    ip link set "$(veth "$n")" down 2>/dev/null || true
    freeze_node "$n" FROZEN
    # Repeat: a process outside the freezer (slurmd, its stepd) may fork while we kill its parent.
    for _ in $(seq 30); do
        pids="$(node_pids "$n")"
        [ -z "$pids" ] && break
        kill -9 $pids 2>/dev/null || true
        freeze_node "$n" THAWED  # SIGKILL is delivered to frozen tasks only once thawed
        sleep 0.1
    done
    rm -f "$STATE/slurmd-$n.pid"
    pids="$(node_pids "$n")"
    [ -z "$pids" ] || die "processes of $n survived: $pids"
    remove_cgroups "$n"
    echo "killed node $n"
}

revive_node() {
    local n="$1"
    is_node "$n"
    ip link show "$BRIDGE" >/dev/null 2>&1 || die "the cluster is not up (no bridge $BRIDGE): run $0 up"
    node_net_up "$n"
    slurmd_up "$n"
    echo "revived node $n"
}

healthy() {
    grep -qF "$LAYOUT" "$CONF" 2>/dev/null && pid_alive "$(pidfile_pid "$STATE/slurmctld.pid")" &&
        ip link show "$BRIDGE" >/dev/null 2>&1
}

up() {
    command -v slurmctld >/dev/null || die "slurmctld not found; apt-get install slurm-wlm munge"
    command -v ip >/dev/null || die "ip not found; apt-get install iproute2"
    munge_up
    if ! healthy; then
        down >/dev/null  # whatever an older or half-started cluster left
        write_conf
    fi
    net_up
    hosts_up
    node_files_up
    slurmctld_up
    for _ in $(seq 100); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.1; done
    scontrol ping 2>/dev/null | grep -q UP || { logs >&2; die "slurmctld did not answer scontrol ping"; }
    for n in "${NODES[@]}"; do slurmd_up "$n"; done
    wait_idle 60
    sinfo -N
}

down() {
    local pid
    if pid_alive "$(pidfile_pid "$STATE/slurmctld.pid")"; then
        scancel --full $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    fi
    for n in "${NODES[@]}"; do
        kill_node "$n" >/dev/null 2>&1 || true
        remove_cgroups "$n"
    done
    pid="$(pidfile_pid "$STATE/slurmctld.pid")"
    if pid_alive "$pid"; then
        kill "$pid"
        for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.1; done
        pid_alive "$pid" && kill -9 "$pid" || true
    fi
    rm -f "$STATE/slurmctld.pid"
    net_down
    hosts_down
    node_files_down
    echo "cluster down"
}

case "${1:-}" in
    up) up ;;
    munge) munge_up ;;
    down) down ;;
    status) scontrol ping | grep -q UP && sinfo -N ;;
    kill-node) kill_node "${2:?node name}" ;;
    revive-node) revive_node "${2:?node name}" ;;
    exec)
        n="${2:?node name}"; shift 2
        is_node "$n"
        pid="$(pidfile_pid "$STATE/slurmd-$n.pid")"
        pid_alive "$pid" || die "node $n is not up"
        exec nsenter --target "$pid" --net --mount --uts -- "$@"
        ;;
    shm) is_node "${2:?node name}"; echo "$STATE/nodes/$2/shm" ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    logs) logs ;;
    *) sed -n '2,30p' "$0"; exit 2 ;;
esac
