#!/bin/sh
# exaserve-hpc: Slurm epilog snippet for administrators. Removes what an exaserve job may have left
# on a node when it did not stop cleanly (a node agent killed before it could clean up, a job
# killed after its grace time): the L2 weight cache in host shared memory, which otherwise holds
# the next job's memory, and the job's etcd member data (ha.etcd.members) under /tmp.
#
# Install: call it from the cluster's Epilog (slurm.conf `Epilog=/etc/slurm/epilog.d/*` or an
# existing epilog script):   /path/to/exaserve-epilog.sh
# Environment (optional, set in the calling epilog):
#   EXASERVE_L2_PATHS   space-separated weight_cache.l2_path values of the sites run here
#                       (default: /dev/shm /dev/shm/exaserve)
#   EXASERVE_ETCD_PATHS space-separated parents of etcd members' data (ha.etcd.data_dir's, or the
#                       default $TMPDIR of the jobs; default: /tmp)
#   EXASERVE_EPILOG_LOG a file to append what was removed to (default: syslog through logger)
#
# Safety: only directories named exaserve-l2-<uid of the job's user> are touched, and only when
# that user has no other job still running on this node (a shared node may hold a second job of
# the same user); etcd data only under exaserve-etcd-<uid>/<this job's id>-<restart>, which no other
# job uses. Exits 0 always: a failing epilog drains the node.

uid="${SLURM_JOB_UID:-}"
job="${SLURM_JOB_ID:-?}"
node="${SLURMD_NODENAME:-$(hostname)}"
[ -n "$uid" ] || exit 0

say() {
    if [ -n "${EXASERVE_EPILOG_LOG:-}" ]; then
        echo "$(date '+%Y-%m-%dT%H:%M:%S') $node job $job: $*" >>"$EXASERVE_EPILOG_LOG"
    else
        logger -t exaserve-epilog "$node job $job: $*" 2>/dev/null || true
    fi
}

removed=0
# This job's etcd members' data (a member killed with its job leaves it: ~100 MB of WAL and snapshots)
for base in ${EXASERVE_ETCD_PATHS:-/tmp}; do
    for dir in "$base/exaserve-etcd-$uid/$job"-*; do
        [ -d "$dir" ] || continue
        bytes="$(du -sb "$dir" 2>/dev/null | cut -f1)"
        rm -rf -- "$dir"
        say "removed leftover etcd data $dir (${bytes:-0} bytes)"
        removed=1
    done
    rmdir "$base/exaserve-etcd-$uid" 2>/dev/null || true
done

# Another job of the same user still on this node keeps its cache.
if command -v squeue >/dev/null 2>&1; then
    others="$(squeue -h -u "$uid" -w "$node" -t RUNNING,COMPLETING -o %i 2>/dev/null | grep -vx "$job" || true)"
    if [ -n "$others" ]; then
        say "kept L2 of uid $uid: other jobs on this node ($(echo $others))"
        exit 0
    fi
fi

for base in ${EXASERVE_L2_PATHS:-/dev/shm /dev/shm/exaserve}; do
    dir="$base/exaserve-l2-$uid"
    [ -d "$dir" ] || continue
    files="$(find "$dir" -type f 2>/dev/null | wc -l)"
    bytes="$(du -sb "$dir" 2>/dev/null | cut -f1)"
    rm -rf -- "$dir"
    # Only empty directories (an L2 directory per run: a killed run's agent leaves its own, empty when it
    # served no weights): nothing held the node's memory
    [ "$files" -eq 0 ] && continue
    say "removed leftover L2 $dir ($files files, ${bytes:-0} bytes)"
    removed=1
done
[ "$removed" = 1 ] || say "nothing left over"
exit 0
