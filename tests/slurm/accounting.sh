#!/bin/bash
# Slurm accounting for tests: MariaDB and slurmdbd on this machine, in a private state directory, with a
# slurm.conf of their own that sacctmgr reads (SLURM_CONF). Independent of the test cluster (cluster.sh):
# its slurmctld keeps AccountingStorageType=none; only sacctmgr, as the quota check runs it, talks to this.
#
#   tests/slurm/accounting.sh up      start MariaDB and slurmdbd (idempotent); prints SLURM_CONF=...
#   tests/slurm/accounting.sh down    stop both and wait until they have exited (the database is kept in
#                                     the state directory); munged is the test cluster's and stays
#   tests/slurm/accounting.sh env     print SLURM_CONF=... when up
#
# Needs root and Debian's slurmdbd, mariadb-server and munge (`cluster.sh munge` starts munged when it is not running).
# Its daemons use their own ports and directory: it runs beside the test cluster (cluster.sh).
set -euo pipefail

STATE=${EXASERVE_ACCOUNTING_STATE:-/tmp/exaserve-slurm-accounting}
DB_PORT=${EXASERVE_ACCOUNTING_DB_PORT:-3417}
DBD_PORT=${EXASERVE_ACCOUNTING_DBD_PORT:-6929}
CLUSTER=exaacct
DB_PASS=exaserve-accounting-test

db_up() {
    mkdir -p "$STATE/db" "$STATE/run" "$STATE/log"
    if [ ! -d "$STATE/db/mysql" ]; then
        mariadb-install-db --user=root --datadir="$STATE/db" --auth-root-authentication-method=socket \
            >"$STATE/log/install-db.log" 2>&1
    fi
    if ! mariadb-admin --socket="$STATE/run/mysqld.sock" ping >/dev/null 2>&1; then
        mariadbd --user=root --datadir="$STATE/db" --socket="$STATE/run/mysqld.sock" --port="$DB_PORT" \
            --bind-address=127.0.0.1 --pid-file="$STATE/run/mariadb.pid" --log-error="$STATE/log/mariadb.log" \
            --skip-name-resolve --innodb-buffer-pool-size=64M >/dev/null 2>&1 &
        for _ in $(seq 100); do
            mariadb-admin --socket="$STATE/run/mysqld.sock" ping >/dev/null 2>&1 && break
            sleep 0.2
        done
    fi
    mariadb --socket="$STATE/run/mysqld.sock" -e "
        CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$DB_PASS';
        GRANT ALL ON exaserve_acct.* TO 'slurm'@'127.0.0.1';
        GRANT ALL ON \`exaserve_acct%\`.* TO 'slurm'@'127.0.0.1';"
}

confs() {
    cat >"$STATE/slurm.conf" <<CONF
ClusterName=$CLUSTER
SlurmctldHost=localhost
AuthType=auth/munge
CredType=cred/munge
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=$DBD_PORT
NodeName=localhost CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES State=UP
CONF
    cat >"$STATE/slurmdbd.conf" <<CONF
AuthType=auth/munge
DbdHost=localhost
DbdPort=$DBD_PORT
SlurmUser=root
PidFile=$STATE/run/slurmdbd.pid
LogFile=$STATE/log/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=exaserve_acct
CONF
    chmod 600 "$STATE/slurmdbd.conf"  # slurmdbd refuses a readable one: it holds the database password
}

dbd_up() {
    export SLURM_CONF="$STATE/slurm.conf"
    if ! sacctmgr --noheader list cluster >/dev/null 2>&1; then
        slurmdbd  # reads slurmdbd.conf beside SLURM_CONF; daemonises
        for _ in $(seq 100); do
            sacctmgr --noheader list cluster >/dev/null 2>&1 && break
            sleep 0.2
        done
    fi
    sacctmgr --noheader list cluster >/dev/null || { echo "slurmdbd did not come up; see $STATE/log" >&2; exit 1; }
    if ! sacctmgr --noheader --parsable2 list cluster format=cluster | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null
    fi
}

# stop NAME PIDFILE: the daemon the pid file names, only if it is that daemon (a stale file's pid may be
# another process's by now), waiting until it has exited so the next `up` never meets a half-stopped one.
stop() {
    local name=$1 pidfile=$2 pid
    [ -s "$pidfile" ] || return 0
    pid=$(cat "$pidfile")
    if [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 150); do  # up to 30 s: MariaDB writes its buffers out before it exits
            running "$pid" || break
            sleep 0.2
        done
        if running "$pid"; then
            echo "$name (pid $pid) still running 30 s after SIGTERM; see $STATE/log" >&2
            return 1
        fi
    fi
    rm -f "$pidfile"
}

# running PID: alive and not a zombie (our daemons are reparented, and whoever adopts them may not reap them).
running() { [ -e "/proc/$1" ] && ! grep -q '^State:[[:space:]]*Z' "/proc/$1/status" 2>/dev/null; }

case "${1:-}" in
    up)
        "$(dirname "$0")/cluster.sh" munge  # the same munged the test cluster uses; started if it is not running
        db_up
        confs
        dbd_up
        echo "SLURM_CONF=$STATE/slurm.conf"
        ;;
    down)
        rc=0
        stop slurmdbd "$STATE/run/slurmdbd.pid" || rc=1  # first: it writes to the database until it exits
        stop mariadbd "$STATE/run/mariadb.pid" || rc=1
        exit $rc
        ;;
    env)
        echo "SLURM_CONF=$STATE/slurm.conf"
        ;;
    *)
        echo "usage: $0 up|down|env" >&2
        exit 2
        ;;
esac
