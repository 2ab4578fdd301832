#!/usr/bin/env bash
# Build the Debian guest image of the `vm` backend (docs/guest-image.md) and
# print the directory that holds it:
#
#   guest-image/debian/build.sh      # e.g. ~/.cache/keystone-agent/guest-image/debian-1a2b3c4d5e6f
#
# The directory has vmlinux, initrd, rootfs.img and image.json. It is keyed
# by every input (this directory, the kernel package's version, the package
# list, Zellij and its config), so a second call returns at once. Needs root,
# debootstrap, busybox-static, cpio, e2fsprogs, xz-utils and network access
# to a Debian mirror; takes about a minute.
#
# KEYSTONE_CACHE_DIR overrides the cache directory
# (default: ${XDG_CACHE_HOME:-~/.cache}/keystone-agent).
# KEYSTONE_DEBIAN_MIRROR overrides the mirror (default: deb.debian.org).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
suite=bookworm
mirror="${KEYSTONE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
packages=systemd-sysv,udev,openssh-server,git,ca-certificates,iproute2,procps,less,busybox,socat,curl
# Drivers the initramfs loads (with what they depend on): the virtio-mmio
# bus, the root disk, both share protocols, virtio-serial (the control
# channel) and fw_cfg.
modules="virtio_mmio virtio_blk crc32c_generic ext4 overlay virtiofs 9p 9pnet_virtio virtio_console qemu_fw_cfg"
cache="${KEYSTONE_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/keystone-agent}"

say() { echo "guest-image: $*" >&2; }
need() { command -v "$1" >/dev/null || { say "$1 is missing (apt-get install $2)"; exit 4; }; }

[ "$(id -u)" = 0 ] || { say "run as root (debootstrap needs it)"; exit 4; }
need debootstrap debootstrap
need busybox busybox-static
need cpio cpio
need mke2fs e2fsprogs
need xz xz-utils
zellij="${KEYSTONE_ZELLIJ:-$("$repo/tests/install-zellij.sh")}"

# The kernel: the newest linux-image-<abi>-amd64 that linux-image-amd64 names.
kpkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-/ {print $2; exit}')
[ -n "$kpkg" ] || { say "apt knows no linux-image-amd64 (run apt-get update)"; exit 4; }
kver=$(apt-cache policy "$kpkg" | awk '/Candidate:/ {print $2}')
kabi=${kpkg#linux-image-}

key=$( {
  echo "$suite $mirror $packages $modules $kpkg $kver"
  (cd "$here" && find . -type f | LC_ALL=C sort | xargs sha256sum)
  sha256sum < "$zellij"
  cat "$repo"/agentd/share/zellij/*.kdl
} | sha256sum | cut -c1-16)
out="$cache/guest-image/debian-$key"
if [ -f "$out/image.json" ]; then
  echo "$out"
  exit 0
fi

mkdir -p "$cache/guest-image"
work=$(mktemp -d "$cache/guest-image/.build-XXXXXX")
trap 'rm -rf "$work"' EXIT
say "building into $out (kernel $kpkg $kver, Debian $suite)"

# Kernel: the uncompressed vmlinux (QEMU boots it directly, PVH) and modules.
(cd "$work" && apt-get download -q "$kpkg=$kver" >&2 2>/dev/null) ||
  (cd "$work" && apt-get download "$kpkg=$kver" >&2)
dpkg-deb -x "$work"/linux-image-*.deb "$work/kernel"
vmlinuz="$work/kernel/boot/vmlinuz-$kabi"
offset=$( (LC_ALL=C grep -aobP '\xfd7zXZ\x00' "$vmlinuz" || true) | head -n1 | cut -d: -f1)
[ -n "$offset" ] || { say "$vmlinuz is not xz-compressed"; exit 1; }
tail -c +"$((offset + 1))" "$vmlinuz" | xz -dcq > "$work/vmlinux" 2>/dev/null || true
[ "$(head -c4 "$work/vmlinux" | od -An -c | tr -d ' ')" = '177ELF' ] ||
  { say "cannot extract vmlinux from $vmlinuz"; exit 1; }

# Initramfs: busybox, the module closure and our /init.
busybox depmod -b "$work/kernel" "$kabi"
moddir="$work/kernel/lib/modules/$kabi"
closure() { # module names -> their .ko paths with dependencies, deps first
  local m path deps
  for m in "$@"; do
    path=$(awk -F: -v m="/$m.ko" 'index($1, m) && substr($1, length($1) - length(m) + 1) == m {print $1; exit}' "$moddir/modules.dep")
    [ -n "$path" ] || { say "kernel $kabi has no module $m"; exit 1; }
    deps=$(awk -F: -v p="$path" '$1 == p {print $2}' "$moddir/modules.dep")
    for d in $deps; do echo "$d"; done
    echo "$path"
  done
}
ird="$work/initramfs"
mkdir -p "$ird"/{bin,dev,proc,sys,newroot,etc} "$ird/lib/modules/$kabi"
cp /bin/busybox "$ird/bin/busybox"
cp "$here/init" "$ird/init"
echo "$modules" | tr ' ' '\n' > "$ird/etc/keystone-modules"
for ko in $(closure $modules | awk '!seen[$0]++'); do
  mkdir -p "$ird/lib/modules/$kabi/$(dirname "$ko")"
  cp "$moddir/$ko" "$ird/lib/modules/$kabi/$ko"
done
cp "$moddir"/modules.{order,builtin} "$ird/lib/modules/$kabi/"
busybox depmod -b "$ird" "$kabi"
(cd "$ird" && find . | LC_ALL=C sort | cpio -o -H newc --quiet | gzip -9) > "$work/initrd"

# Root filesystem: Debian minbase with sshd, git and our units.
root="$work/rootfs"
debootstrap --variant=minbase --include="$packages" "$suite" "$root" "$mirror" >&2
cp -a "$here/overlay/." "$root/"
mkdir -p "$root/opt/keystone/bin" "$root/opt/keystone/share/zellij"
cp "$zellij" "$root/opt/keystone/bin/zellij"
cp "$repo"/agentd/share/zellij/*.kdl "$root/opt/keystone/share/zellij/"
rm -f "$root"/etc/ssh/ssh_host_*
# No resolver: the guest has no network; the gateway resolves names.
: > "$root/etc/resolv.conf"
: > "$root/etc/fstab"
chroot "$root" /bin/sh -eu <<'SETUP'
useradd --create-home --uid 1000 --user-group --shell /bin/bash agent
# No passwords anywhere; '*' (not '!') so key logins are not "locked".
usermod -p '*' agent
usermod -p '*' root
systemctl enable keystone-control@root.service keystone-control@agent.service \
  keystone-egress.socket keystone-ready.service >/dev/null 2>&1
systemctl disable ssh.service >/dev/null 2>&1 || true
systemctl mask ssh.service ssh.socket serial-getty@.service getty@.service \
  apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer >/dev/null 2>&1
# What a sandbox never needs; each unit costs a tenth of a second or more
# in an emulated guest. The initramfs loads every driver and mounts / read-write.
systemctl mask getty-static.service e2scrub_reap.service systemd-modules-load.service \
  modprobe@configfs.service modprobe@dm_mod.service modprobe@drm.service \
  modprobe@efi_pstore.service modprobe@fuse.service modprobe@loop.service \
  systemd-remount-fs.service systemd-sysusers.service systemd-network-generator.service \
  systemd-pstore.service sys-kernel-debug.mount sys-kernel-tracing.mount \
  sys-fs-fuse-connections.mount dev-hugepages.mount systemd-update-utmp.service \
  systemd-update-utmp-runlevel.service >/dev/null 2>&1
apt-get clean
rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /usr/share/doc/* /usr/share/man/*
SETUP
mkdir -p "$root/workspace"
size=$(( $(du -sm "$root" | cut -f1) * 2 + 512 ))
mke2fs -q -t ext4 -L keystone-root -d "$root" "$work/rootfs.img" "${size}M" >&2

cat > "$work/image.json" <<JSON
{
  "recipe": "debian",
  "suite": "$suite",
  "kernel": "$kpkg $kver",
  "key": "$key",
  "fast_start": true,
  "built": "$(date -u +%Y-%m-%dT%H:%M:%SZ)"
}
JSON
mkdir -p "$out.tmp"
mv "$work/vmlinux" "$work/initrd" "$work/rootfs.img" "$work/image.json" "$out.tmp/"
rm -rf "$out"
mv "$out.tmp" "$out"
say "done: $(du -sh "$out" | cut -f1) in $out"
echo "$out"
