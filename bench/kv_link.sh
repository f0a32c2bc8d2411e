#!/usr/bin/env bash
# bench/kv_link.sh (scripts/bench kv-link [bench_kv_transfer options]): the KV
# transfer library (kv/) against raw TCP between two hosts over one link, at
# each rate of RATES (default "unshaped 10gbit 1gbit"; tc's units), the
# receiver on a host of its own.
#
# Safety first: the script re-runs itself under `unshare --net --mount` and checks
# that its network namespace is no longer the one it started in before it
# runs any `ip` or `tc`; the far host is a namespace inside that one, held by
# a bounded `sleep`. Nothing touches the machine's own network, and when the
# script ends (however) the link and its shaping go with the namespaces.
#
#   this namespace: the sender, h1 10.77.1.1 ── veth ── net0 10.77.1.2: the receiver
#
# Each rate limits both directions with a token bucket (tbf); no delay (this
# kernel has no netem; a delaying relay is not in yet).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${DISAGG_KV_LINK_INSIDE:-}" != 1 ]; then
  machine=$(readlink /proc/self/ns/net)
  if ! unshare --net true 2>/dev/null; then
    echo "kv-link: cannot make a network namespace (unshare --net needs CAP_NET_ADMIN): not run" >&2
    exit 1
  fi
  DISAGG_KV_LINK_INSIDE=1 DISAGG_MACHINE_NETNS=$machine exec unshare --net --mount --propagation private -- "$0" "$@"
fi
if [ "$(readlink /proc/self/ns/net)" = "${DISAGG_MACHINE_NETNS:-}" ] || [ -z "${DISAGG_MACHINE_NETNS:-}" ]; then
  echo "kv-link: not in a network namespace of its own; nothing done" >&2
  exit 1
fi

# UCX finds interfaces in /sys/class/net: a sysfs of this network's, in this
# script's own mount namespace (the far host gets one of its own too).
mount -t sysfs sysfs /sys
ip link set lo up
unshare --net --mount --propagation private sh -c 'mount -t sysfs sysfs /sys && exec sleep 1800' &
# (the far host's namespaces; bounded: gone within 30 min whatever happens)
holder=$!
trap 'kill $holder 2>/dev/null || true' EXIT
for _ in $(seq 100); do  # (until the holder has its own namespace: at most 1 s)
  [ "$(readlink /proc/$holder/ns/net 2>/dev/null)" != "$(readlink /proc/self/ns/net)" ] && break
  sleep 0.01
done
far="nsenter --net=/proc/$holder/ns/net --mount=/proc/$holder/ns/mnt"
ip link add h1 type veth peer name net0 netns "$holder"
ip addr add 10.77.1.1/24 dev h1
ip link set h1 up
$far sh -c 'ip link set lo up && ip addr add 10.77.1.2/24 dev net0 && ip link set net0 up && ip route add default via 10.77.1.1'
ip route add default via 10.77.1.2


# Both ends up before anything looks for them: the kernel reports a new
# link's carrier up to a second later, and UCX leaves out an interface that
# is not running when its context starts.
for _ in $(seq 300); do  # (at most 3 s)
  [ "$(cat /sys/class/net/h1/operstate)" = up ] && [ "$($far cat /sys/class/net/net0/operstate)" = up ] && break
  sleep 0.01
done

echo "# kv-link: $(date -u +%Y-%m-%dT%H:%MZ), CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores"
for rate in ${RATES:-unshaped 10gbit 1gbit}; do
  if [ "$rate" = unshaped ]; then
    tc qdisc del dev h1 root 2>/dev/null || true
    $far tc qdisc del dev net0 root 2>/dev/null || true
  else
    # A bucket of at least one kernel tick's bytes at this rate (HZ 250: 4 ms).
    qdisc="root tbf rate $rate burst 8mb latency 50ms"
    tc qdisc replace dev h1 $qdisc
    $far tc qdisc replace dev net0 $qdisc
  fi
  echo "# link: $rate"
  build/bin/bench_kv_transfer --modes=tcp --peer-pid="$holder" --peer-host=10.77.1.2 "$@"
done
