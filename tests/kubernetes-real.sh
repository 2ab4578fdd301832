#!/usr/bin/env bash
# The kubernetes backend's suite (agentd/tests/kubernetes.rs) against a real
# cluster instead of the fake API server.
#
#   KEYSTONE_KUBECONFIG=~/.kube/config \
#   KEYSTONE_KUBE_IMAGE=registry.example.org/keystone-sandbox:1 \
#   KEYSTONE_KUBE_STORAGE_CLASS=standard \
#   KEYSTONE_KUBE_ENFORCED=1 \      # only where NetworkPolicies are enforced
#   tests/kubernetes-real.sh [TEST-NAME-FILTER]
#
# What it needs (docs/kubernetes.md, "Tests"):
#
# - root on this machine, as the suite does (the workspace helpers run as
#   the sandbox's uid);
# - a namespace `agent-sandboxes`;
# - an image that meets the contract of docs/kubernetes.md ("The image")
#   and also has `curl` and `python3`, which the tests run in the Pod (the
#   gateway, secret and kill -9 tests use curl, the dev-server test
#   `python3 -m http.server`); a test whose tool is missing fails and says
#   so;
# - a StorageClass (KEYSTONE_KUBE_STORAGE_CLASS, else the cluster's default)
#   whose claims the image's `agent` uid (1000) can write: the Pod asks for
#   `fsGroup`, which a provisioner of plain host directories may not apply,
#   and a claim only root may write fails every start (in its init
#   container);
# - a kubeconfig whose identity may do what the documented Role grants
#   agentd, and, for the suite's own setup and cleanup, in the namespace:
#     pods: create (a stray Pod), deletecollection
#     persistentvolumeclaims, networkpolicies: list, deletecollection
#     secrets: get, list
set -euo pipefail
case "${1:-}" in
  -h | --help)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 0
    ;;
esac
cd "$(dirname "$0")/.."
: "${KEYSTONE_KUBECONFIG:?set KEYSTONE_KUBECONFIG to the kubeconfig of the cluster (see tests/kubernetes-real.sh --help)}"
[ -r "$KEYSTONE_KUBECONFIG" ] || {
  echo "kubernetes-real: cannot read the kubeconfig $KEYSTONE_KUBECONFIG" >&2
  exit 2
}
# The suite skips every test when not root: that would pass and test nothing.
[ "$(id -u)" = 0 ] || {
  echo "kubernetes-real: run it as root (the workspace helpers run as the sandbox's uid): sudo -E $0 $*" >&2
  exit 2
}
export KEYSTONE_KUBECONFIG
cargo build -p agentd -p agentctl
# One test at a time: they share the cluster's namespace.
exec cargo test -p agentd --test kubernetes -- --test-threads=1 "$@"
