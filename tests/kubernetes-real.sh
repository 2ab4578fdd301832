#!/usr/bin/env bash
# The kubernetes backend's suite (agentd/tests/kubernetes.rs) against a real
# cluster instead of the fake API server. Needs root (as the suite does), a
# namespace `agent-sandboxes` on the cluster, and an image that meets the
# contract of docs/kubernetes.md ("The image").
#
#   KEYSTONE_KUBECONFIG=~/.kube/config \
#   KEYSTONE_KUBE_IMAGE=registry.example.org/keystone-sandbox:1 \
#   KEYSTONE_KUBE_STORAGE_CLASS=standard \
#   KEYSTONE_KUBE_ENFORCED=1 \      # only where NetworkPolicies are enforced
#   tests/kubernetes-real.sh [TEST-NAME-FILTER]
set -euo pipefail
cd "$(dirname "$0")/.."
: "${KEYSTONE_KUBECONFIG:?set KEYSTONE_KUBECONFIG to the kubeconfig of the cluster}"
export KEYSTONE_KUBECONFIG
cargo build -p agentd -p agentctl
# One test at a time: they share the cluster's namespace.
exec cargo test -p agentd --test kubernetes -- --test-threads=1 "$@"
