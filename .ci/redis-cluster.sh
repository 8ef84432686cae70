#!/usr/bin/env bash
# Starts (or reuses) a local 3-node Redis Cluster for the cluster tests of the Redis
# governance (SPEC §14.10): redis-server in cluster mode on 127.0.0.1:7001-7003 (override
# with POLYGW_CLUSTER_PORTS="p1 p2 p3"), data and logs under a temp dir, then
# `redis-cli --cluster create … --cluster-replicas 0`. A cluster already up on those ports
# is reused. Exits non-zero when the cluster cannot be brought up (.ci/run decides
# whether that is fatal). The tests find it through POLYGW_TEST_REDIS_CLUSTER_URL
# (default redis+cluster://127.0.0.1:7001,127.0.0.1:7002,127.0.0.1:7003).
set -euo pipefail
read -r -a PORTS <<< "${POLYGW_CLUSTER_PORTS:-7001 7002 7003}"
DIR=${POLYGW_CLUSTER_DIR:-${TMPDIR:-/tmp}/polygw-redis-cluster}

tcp_up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

cluster_ok() {
  local info
  info=$(redis-cli -p "${PORTS[0]}" cluster info 2>/dev/null) || return 1
  grep -q '^cluster_state:ok' <<< "$info" &&
    grep -q "^cluster_known_nodes:${#PORTS[@]}" <<< "$info" &&
    grep -q '^cluster_slots_assigned:16384' <<< "$info"
}

if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  echo "redis cluster: redis-server/redis-cli not installed" >&2
  exit 1
fi

if cluster_ok; then
  echo "redis cluster: up on ports ${PORTS[*]} (reused)"
  exit 0
fi

for p in "${PORTS[@]}"; do
  if tcp_up "$p"; then continue; fi
  mkdir -p "$DIR/$p"
  redis-server --port "$p" --bind 127.0.0.1 --protected-mode no \
    --cluster-enabled yes --cluster-config-file nodes.conf --cluster-node-timeout 5000 \
    --save "" --appendonly no --dir "$DIR/$p" --logfile "$DIR/$p/redis.log" --daemonize yes
done
for p in "${PORTS[@]}"; do
  for _ in $(seq 1 50); do tcp_up "$p" && break; sleep 0.1; done
  tcp_up "$p" || { echo "redis cluster: node $p did not start (see $DIR/$p/redis.log)" >&2; exit 1; }
done

# Restarted nodes rejoin from their nodes.conf; give them a moment before creating anew.
for _ in $(seq 1 30); do cluster_ok && break; sleep 0.2; done
if ! cluster_ok; then
  # Start from empty nodes: a half-formed cluster (stale nodes.conf) cannot be created over.
  for p in "${PORTS[@]}"; do
    redis-cli -p "$p" flushall >/dev/null 2>&1 || true
    redis-cli -p "$p" cluster reset hard >/dev/null 2>&1 || true
  done
  nodes=()
  for p in "${PORTS[@]}"; do nodes+=("127.0.0.1:$p"); done
  redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >/dev/null
  for _ in $(seq 1 100); do cluster_ok && break; sleep 0.1; done
fi
if cluster_ok; then
  echo "redis cluster: started on ports ${PORTS[*]} (data in $DIR)"
else
  echo "redis cluster: not ready on ports ${PORTS[*]} (see $DIR/*/redis.log)" >&2
  exit 1
fi
