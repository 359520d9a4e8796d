#!/usr/bin/env bash
# A pretend cluster of N nodes on one Linux machine (root), for trainrun's multi-node tests.
#
# Node nK is a network namespace (eth0 = 10.77.0.K/24) plus a holder process (PID 1 of fresh UTS,
# mount, IPC and PID namespaces: hostname nK, its own /dev/shm tmpfs and /etc/hosts), pinned to its own
# core(s). The nodes meet on a bridge in a namespace of its own; "login" (10.77.0.254) is where mpirun
# runs, launching across the nodes through hydra's ssh launcher with `ssh` replaced by `node-ssh`
# (nsenter into the node, pinned to its cores). The rest of the filesystem (/tmp, the checkout, the
# venv) is the machine's: the cluster's shared filesystem. Addresses exist only inside the namespaces
# made here; the machine's own network is never touched.
#
#   cluster.sh up [N]            build N nodes (default 2); idempotent (an old cluster is taken down first)
#   cluster.sh down              remove everything `up` made (holders by PID, then its namespaces); safe to repeat
#   cluster.sh rate RATE|off     tc tbf on every node's link (e.g. 1gbit)
#   cluster.sh shm NODE SIZE     resize NODE's /dev/shm (e.g. n2 16m)
#   cluster.sh exec NODE CMD...  run CMD on NODE
#   cluster.sh mpirun ARGS...    the venv's mpirun on login, across the nodes (e.g. -hosts n1,n2 -ppn 1 ...)
#   cluster.sh ompi ARGS...      Open MPI's mpirun (OMPIRUN, default .venv-elastic's: `make setup-elastic`) on login,
#                                across the nodes, PRRTE's ssh launcher replaced by node-ssh (--prtemca
#                                plm_ssh_agent), as root (OMPI_ALLOW_RUN_AS_ROOT); e.g. `--with-ft ulfm
#                                --host n1:1,n2:1,n3:1 -np 3 -x PYTHONPATH ...`: Open MPI forwards no variable
#                                to the ranks unless named with -x
#   cluster.sh kill NODE [WORD]  SIGKILL to every process on NODE (its PID namespace's, all but the holder), or
#                                to those whose command line holds WORD (e.g. trainrun: the node's ranks, not
#                                mpirun's daemon there); the node itself (namespaces, address) stays, as a
#                                machine that comes back; what it killed, by PID, on stdout
#   cluster.sh slurm-up          a real SLURM on the nodes (Debian's slurm-wlm, started by hand, no systemd):
#                                munged with a socket of its own, slurmctld on login, slurmd on each node;
#                                partition "nodes" (jobs share cores); task/affinity; KillWait KILL_WAIT
#                                (default 30 s, SLURM's); a requeued job waits CRED_EXPIRE (default 10) s.
#                                `down` stops it too
#   cluster.sh slurm CMD...      a SLURM client command (sbatch, squeue, scontrol, srun...) on login
#   cluster.sh install-slurm     as root, apt-get install slurmctld slurmd slurm-client munge where missing;
#                                elsewhere says why not (and exits 0: the SLURM tests then skip saying so)
#
# TRAINRUN_CLUSTER_DIR (default /tmp/trainrun-cluster) holds its state; TRAINRUN_CLUSTER_PREFIX (default
# trc) prefixes its namespace names, so that two checkouts' clusters do not meet. SHM_SIZE (default 256m)
# is each node's /dev/shm.
set -euo pipefail

D=${TRAINRUN_CLUSTER_DIR:-/tmp/trainrun-cluster}
P=${TRAINRUN_CLUSTER_PREFIX:-trc}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
MPIRUN=${MPIRUN:-$ROOT/.venv/bin/mpirun}
SUBNET=10.77.0
SHM_SIZE=${SHM_SIZE:-256m}
N_DIR=$D/nodes

S=$D/slurm
CRED_EXPIRE=${CRED_EXPIRE:-10}
KILL_WAIT=${KILL_WAIT:-30}

die() { echo "cluster.sh: $*" >&2; exit 1; }
holder() { cat "$N_DIR/$1.pid" 2>/dev/null || die "no node $1 (cluster.sh up first)"; }

node_exec() {  # node_exec NODE CMD...: CMD in every namespace of NODE, on NODE's cores
    local n=$1; shift
    taskset -c "$(cat "$N_DIR/$n.cpus")" \
        nsenter --target "$(holder "$n")" --net --uts --mount --ipc --pid --wd="$PWD" -- "$@"
}

write_node_ssh() {  # hydra's "ssh": node-ssh [ssh options] HOST COMMAND... -> COMMAND on HOST, as sshd would
    cat > "$D/node-ssh" <<EOF
#!/usr/bin/env bash
while [ \$# -gt 0 ]; do
    case "\$1" in
        -[bcDEeFIiJLlmOoPpQRSWw]) shift 2 ;;
        -*) shift ;;
        *) break ;;
    esac
done
host=\$1; shift
pid=\$(cat "$N_DIR/\$host.pid" 2>/dev/null) || { echo "ssh: Could not resolve hostname \$host" >&2; exit 255; }
exec taskset -c "\$(cat "$N_DIR/\$host.cpus")" nsenter --target "\$pid" --net --uts --mount --ipc --pid --wd=/ -- \\
    env -i HOME=/root USER=root LOGNAME=root SHELL=/bin/sh PATH=/usr/local/bin:/usr/bin:/bin /bin/sh -c "\$*"
EOF
    chmod +x "$D/node-ssh"
    # Open MPI's (PRRTE's): a daemon killed with its node ends its ssh session, which PRRTE takes for a daemon
    # that failed to start and aborts the job; a dead machine's ssh session would hang until a keepalive gave up
    # instead, while the daemons' own failure detector reports the node lost: the session ends quietly (0)
    # where the remote side died of a signal (a start that failed keeps its status)
    cat > "$D/node-ssh-ft" <<EOF
#!/usr/bin/env bash
"$D/node-ssh" "\$@"
rc=\$?
[ \$rc -gt 128 ] && [ \$rc -lt 255 ] && exit 0
exit \$rc
EOF
    chmod +x "$D/node-ssh-ft"
}

add_netns() { ip netns add "$1" && echo "$1" >> "$N_DIR/netns"; }

wait_for() {  # wait_for PID HOSTNAME: until PID is in its namespaces (hostname, /etc/hosts, /dev/shm mounted)
    local i
    for i in $(seq 100); do
        if [ "$(nsenter -t "$1" -u hostname 2>/dev/null)" = "$2" ] && grep -q " /etc/hosts " "/proc/$1/mounts"; then
            return 0
        fi
        sleep 0.1
    done
    return 1
}

up() {
    local count=${1:-2} cores i n pid child
    down >/dev/null
    cores=$(nproc)
    mkdir -p "$N_DIR"
    write_node_ssh
    [ -e /run/netns ] || touch "$N_DIR/run-netns"          # `ip netns add` creates /run/netns: remove it on down
    { echo "127.0.0.1 localhost"; for i in $(seq 1 "$count"); do echo "$SUBNET.$i n$i"; done
      echo "$SUBNET.254 login"; } > "$N_DIR/hosts"
    add_netns "$P-sw"
    ip -n "$P-sw" link add br0 type bridge
    ip -n "$P-sw" link set br0 up
    for i in $(seq 1 "$count") login; do
        n=n$i; [ "$i" = login ] && n=login
        add_netns "$P-$n"
        ip -n "$P-sw" link add "$n" type veth peer name eth0 netns "$P-$n"
        ip -n "$P-sw" link set "$n" master br0 up
        ip -n "$P-$n" addr add "$SUBNET.$([ "$n" = login ] && echo 254 || echo "$i")/24" dev eth0
        ip -n "$P-$n" link set eth0 up
        ip -n "$P-$n" link set lo up
    done
    for i in $(seq 1 "$count"); do
        n=n$i
        echo "$(( (i - 1) % cores ))" > "$N_DIR/$n.cpus"     # one core per node (shared when nodes > cores)
        taskset -c "$(cat "$N_DIR/$n.cpus")" ip netns exec "$P-$n" \
            unshare --uts --mount --ipc --pid --fork --kill-child --mount-proc --propagation private \
            sh -c "hostname $n && mount -t tmpfs -o size=$SHM_SIZE,mode=1777 tmpfs /dev/shm &&
                   mount --bind $N_DIR/hosts /etc/hosts && exec python3 -c 'import os, time
while True:
    try: os.wait()
    except ChildProcessError: time.sleep(0.5)'" >"$N_DIR/$n.log" 2>&1 &
        pid=$!
        echo "$pid" > "$N_DIR/$n.unshare"
        child=
        for _ in $(seq 100); do       # the process to enter: unshare's child, PID 1 of the node
            child=$(cat "/proc/$pid/task/$pid/children" 2>/dev/null | awk '{print $1}')
            [ -n "$child" ] && wait_for "$child" "$n" && grep -q " /dev/shm tmpfs" "/proc/$child/mounts" && break
            child=; sleep 0.1
        done
        [ -n "$child" ] || die "node $n did not come up: $(cat "$N_DIR/$n.log")"
        echo "$child" > "$N_DIR/$n.pid"
    done
    ip netns exec "$P-login" unshare --uts --mount --propagation private \
        sh -c "hostname login && mount --bind $N_DIR/hosts /etc/hosts && exec sleep infinity" >/dev/null 2>&1 &
    pid=$!
    echo "$pid" > "$N_DIR/login.pid"
    wait_for "$pid" login || die "login did not come up"
    echo "$count" > "$N_DIR/count"
    echo "up: n1..n$count and login, /dev/shm $SHM_SIZE each, node nK on core (K-1) mod $cores"
}

down() {  # holders by PID (each takes its PID namespace's processes along), then the namespaces made here
    local f n
    slurm_down >/dev/null
    [ -d "$N_DIR" ] || { rm -f "$D/node-ssh" "$D/node-ssh-ft"; rmdir "$D" 2>/dev/null || true; echo "down: nothing to remove"; return 0; }
    for f in "$N_DIR"/*.pid "$N_DIR"/*.unshare; do
        [ -e "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null || true
    done
    if [ -e "$N_DIR/netns" ]; then
        while read -r n; do
            for _ in $(seq 20); do ip netns del "$n" 2>/dev/null && break; sleep 0.1; done
        done < "$N_DIR/netns"
    fi
    if [ -e "$N_DIR/run-netns" ] && [ -z "$(ip netns list)" ]; then
        umount /run/netns 2>/dev/null || true; rmdir /run/netns 2>/dev/null || true
    fi
    rm -rf "$N_DIR" "$D/node-ssh" "$D/node-ssh-ft"
    rmdir "$D" 2>/dev/null || true
    echo "down: removed"
}

rate() {  # tbf on each node's eth0 egress (no netem in every kernel: rates, not delays)
    local i
    for i in $(seq 1 "$(cat "$N_DIR/count")"); do
        tc -n "$P-n$i" qdisc del dev eth0 root 2>/dev/null || true
        [ "$1" = off ] || tc -n "$P-n$i" qdisc add dev eth0 root tbf rate "$1" burst 1mb latency 50ms
    done
}

slurm_conf() {  # the cluster's slurm.conf: the controller on login, nodes n1..nN at their addresses
    local count=$1 i
    cat <<EOF
ClusterName=trainrun
SlurmctldHost=login($SUBNET.254)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (SLURM's default: 120 s)
AuthInfo=socket=$S/munge/socket,cred_expire=$CRED_EXPIRE
StateSaveLocation=$S/state
SlurmdSpoolDir=$S/spool/%n
SlurmctldPidFile=$S/slurmctld.pidfile
SlurmdPidFile=$S/slurmd-%n.pidfile
SlurmctldLogFile=$S/slurmctld.log
SlurmdLogFile=$S/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$S/jobcomp.txt
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=$KILL_WAIT
OverTimeLimit=0
MinJobAge=600
EOF
    for i in $(seq 1 "$count"); do
        echo "NodeName=n$i NodeAddr=$SUBNET.$i CPUs=$(nproc) RealMemory=1000 State=UNKNOWN"
    done
    # jobs may share cores (up to 3 a core): a test's jobs that wait for their time limit run side by side
    echo "PartitionName=nodes Nodes=n[1-$count] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:3"
}

slurm_up() {  # munged, slurmctld on login, slurmd on each node, each in the foreground of a background job
    local count i t
    count=$(cat "$N_DIR/count" 2>/dev/null) || die "no cluster (cluster.sh up first)"
    for t in munged slurmctld slurmd sbatch squeue scontrol srun; do
        command -v "$t" >/dev/null || [ -x "/usr/sbin/$t" ] || die "SLURM needs $t (apt-get install slurmctld slurmd slurm-client munge)"
    done
    slurm_down >/dev/null
    mkdir -p "$S/state" "$S/spool" "$S/munge"
    chown munge: "$S/munge"; chmod 755 "$S/munge"
    slurm_conf "$count" > "$S/slurm.conf"
    # munged as the munge user with a socket of its own (the machine's munged, if any, is left alone); the
    # cluster's filesystem is shared, so the nodes reach it by path
    setsid runuser -u munge -- /usr/sbin/munged --foreground --socket="$S/munge/socket" \
        --pid-file="$S/munge/pid" --log-file="$S/munge/log" --seed-file="$S/munge/seed" \
        --key-file=/etc/munge/munge.key >"$S/munged.out" 2>&1 &
    echo $! > "$S/munged.pid"
    for t in $(seq 50); do [ -S "$S/munge/socket" ] && break; sleep 0.1; done
    [ -S "$S/munge/socket" ] || die "munged did not start: $(cat "$S/munged.out" "$S/munge/log" 2>/dev/null)"
    setsid nsenter --target "$(holder login)" --net --uts --mount -- \
        /usr/sbin/slurmctld -D -i -f "$S/slurm.conf" >"$S/slurmctld.out" 2>&1 &
    echo $! > "$S/slurmctld.pid"
    # slurmd needs the cgroup hierarchies, which the node's /sys (its network namespace's sysfs) lacks:
    # the machine's v1 controllers mounted again inside the node's mount namespace (they go with it)
    for i in $(seq 1 "$count"); do
        mkdir -p "$S/spool/n$i"
        setsid taskset -c "$(cat "$N_DIR/n$i.cpus")" \
            nsenter --target "$(holder "n$i")" --net --uts --mount --ipc --pid --wd=/ -- sh -c '
                mountpoint -q /sys/fs/cgroup || mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup || exit 1
                for c in cpuset memory freezer devices cpu cpuacct pids; do
                    mountpoint -q /sys/fs/cgroup/$c || { mkdir -p /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c; } || exit 1
                done
                mountpoint -q /sys/fs/cgroup/systemd || { mkdir -p /sys/fs/cgroup/systemd &&
                    mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd; } || exit 1
                exec /usr/sbin/slurmd -D -f "$0" -N "$1"' "$S/slurm.conf" "n$i" >"$S/slurmd-n$i.out" 2>&1 &
    done
    for t in $(seq 100); do
        [ "$(slurm_client sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$')" = "$count" ] && break
        sleep 0.3
    done
    [ "$(slurm_client sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$')" = "$count" ] ||
        die "SLURM did not come up: $(slurm_client sinfo -N 2>&1; tail -n 5 "$S"/*.log)"
    echo "slurm-up: slurmctld on login, slurmd on n1..n$count (partition nodes), conf $S/slurm.conf"
}

slurm_down() {  # slurmctld and munged by PID (slurmd and the jobs' processes end with their node's holder)
    local f
    [ -d "$S" ] || { echo "slurm-down: nothing to stop"; return 0; }
    for f in "$S"/slurmctld.pid "$S"/munged.pid; do
        [ -e "$f" ] && kill -TERM "$(cat "$f")" 2>/dev/null || true
    done
    sleep 0.5
    for f in "$S"/slurmctld.pid "$S"/munged.pid; do
        [ -e "$f" ] && kill -KILL "$(cat "$f")" 2>/dev/null || true
    done
    rm -rf "$S"
    echo "slurm-down: stopped"
}

install_slurm() {
    local t missing=
    for t in munged slurmctld slurmd sbatch; do
        command -v "$t" >/dev/null || [ -x "/usr/sbin/$t" ] || missing="$missing $t"
    done
    [ -z "$missing" ] && return 0
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "install-slurm: SLURM missing ($missing) and not root with apt-get: the SLURM tests will skip"
        return 0
    fi
    echo "install-slurm: apt-get install slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null ||
        { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null; } ||
        echo "install-slurm: apt-get failed: the SLURM tests will skip (or fail under TRAINRUN_REQUIRE_CLUSTER=1)"
    return 0
}

slurm_client() {  # a SLURM client command on login
    [ -e "$S/slurm.conf" ] || die "no SLURM (cluster.sh slurm-up first)"
    SLURM_CONF=$S/slurm.conf nsenter --target "$(holder login)" --net --uts --mount --wd="$PWD" -- "$@"
}

cluster_ompi() {
    local ompirun=${OMPIRUN:-$ROOT/.venv-elastic/bin/mpirun}
    [ -x "$ompirun" ] || die "no Open MPI mpirun at $ompirun (make setup-elastic, or OMPIRUN=...)"
    OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        exec nsenter --target "$(holder login)" --net --uts --mount --wd="$PWD" -- \
        "$ompirun" --prtemca plm_ssh_agent "$D/node-ssh-ft" "$@"
}

kill_node() {  # inside the node's PID and mount namespaces (its own /proc): all but PID 1 and this shell
    node_exec "$1" sh -c 'for d in /proc/[0-9]*; do p=${d#/proc/}
        [ "$p" = 1 ] || [ "$p" = $$ ] || { [ -n "$0" ] && ! tr "\\0" " " < "$d/cmdline" 2>/dev/null | grep -qF -- "$0"; } ||
            { kill -KILL "$p" 2>/dev/null && echo "$p"; }
    done; true' "${2:-}"
}

cluster_mpirun() {
    exec nsenter --target "$(holder login)" --net --uts --mount --wd="$PWD" -- \
        "$MPIRUN" -launcher ssh -launcher-exec "$D/node-ssh" "$@"
}

cmd=${1:-}; shift || true
case "$cmd" in
    up) trap 'down >/dev/null' ERR; trap 'down >/dev/null; exit 130' INT TERM; up "$@"; trap - ERR INT TERM ;;
    down) down ;;
    rate) rate "$1" ;;
    shm) node_exec "$1" mount -o "remount,size=$2" /dev/shm ;;
    exec) node_exec "$@" ;;
    mpirun) cluster_mpirun "$@" ;;
    ompi) cluster_ompi "$@" ;;
    kill) kill_node "$@" ;;
    slurm-up) slurm_up ;;
    slurm-down) slurm_down ;;
    slurm) slurm_client "$@" ;;
    install-slurm) install_slurm ;;
    *) sed -n '2,37p' "$0" >&2; exit 2 ;;
esac
