#!/usr/bin/env bash
# The VM suite: boots real QEMU microVMs (KVM when it works here, TCG
# otherwise) from the Debian-built guest image.
#
#   sudo tests/run-vm.sh
#
# Needs root (the image build uses debootstrap, virtiofsd needs root),
# qemu-system-x86, debootstrap, busybox-static, cpio and openssh-client;
# .ci/run installs them. The image is built once into the cache
# (KEYSTONE_CACHE_DIR, default ~/.cache/keystone-agent).
set -euo pipefail
cd "$(dirname "$0")/.."

command -v qemu-system-x86_64 >/dev/null || { echo "run-vm: QEMU is missing (apt-get install qemu-system-x86)" >&2; exit 4; }
KEYSTONE_VM_IMAGE=$(guest-image/debian/build.sh | tail -n1)
export KEYSTONE_VM_IMAGE
echo "run-vm: guest image $KEYSTONE_VM_IMAGE" >&2
# One VM at a time: under TCG each one keeps a core busy while it boots.
exec cargo test --locked -p agentd --test vm --test vm_state --test vm_fast --test vm_disk "$@" -- --ignored --test-threads=1
