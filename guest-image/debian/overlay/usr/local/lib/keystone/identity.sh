# A sandbox's identity (docs/guest-image.md), sourced by the initramfs's
# /init at a cold boot (busybox, the root disk at $root): mount the
# sandbox's disks and shares, install its ssh keys, give `agent` the uid
# and gid that own the workspace on the host, and name the guest. Reads
# $root, $share, $uid, $gid, $name, $tools, $agents, $agenthome, $egress,
# and the keys from $host_key_file and $authorized_keys_file; calls die()
# when a step fails. A guest restored from a boot snapshot takes the same
# identity from the control program (/usr/local/lib/keystone/control),
# which makes these steps' system calls itself: keep the two alike.

# A directory, made only when missing.
keystone_dir() { [ -d "$1" ] || mkdir -p "$1"; }

keystone_identity() {
  # A persistent home, when the sandbox has one: the second disk.
  if [ -b /dev/vdb ]; then
    # noinit_itable: no background zeroing of a new disk's inode tables,
    # which costs seconds of CPU in an emulated guest.
    mount -t ext4 -o rw,nosuid,nodev,noinit_itable /dev/vdb "$root/home/agent" ||
      die "cannot mount the home disk /dev/vdb"
    # The skeleton's files where they are missing: never over (or
    # through a link) what the agent left on its disk.
    if [ ! -e "$root/home/agent/.profile" ]; then
      for f in "$root"/etc/skel/.[!.]* "$root"/etc/skel/*; do
        t="$root/home/agent/${f##*/}"
        [ ! -e "$f" ] || [ -e "$t" ] || [ -L "$t" ] || { cp -a "$f" "$t" && chown -hR "$uid:$gid" "$t"; } ||
          die "cannot copy $f into the home disk"
      done
    fi
  fi

  keystone_dir "$root/workspace"
  case "$share" in
    virtiofs) mount -t virtiofs workspace "$root/workspace" ;;
    9p) mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,cache=none workspace "$root/workspace" ;;
    # A disk of its own (vm.share = "disk"): the third disk.
    disk) mount -t ext4 -o rw,nosuid,nodev,noinit_itable /dev/vdc "$root/workspace" ;;
    *) false ;;
  esac || die "cannot mount the workspace (share tag workspace or disk /dev/vdc, $share)"

  # agentd's tools (the agents' launchers, the sandbox's CA) and the agent
  # toolbox, read-only: the launchers join Zellij in /opt/keystone/bin
  # (/run/keystone/bin), and they run the pinned agents from
  # /opt/keystone/agents (/run/keystone/agents).
  o=trans=virtio,version=9p2000.L,msize=524288,ro,nosuid,nodev
  if [ "$tools" = 1 ]; then
    keystone_dir "$root/opt/keystone/host"
    mount -t 9p -o $o,cache=none keystone-tools "$root/opt/keystone/host" ||
      die "cannot mount agentd's tools (tag keystone-tools)"
    links=
    for f in "$root"/opt/keystone/host/bin/*; do
      [ -e "$f" ] || continue
      n=${f##*/}
      [ -e "$root/opt/keystone/bin/$n" ] || links="$links /opt/keystone/host/bin/$n"
    done
    # One `ln` for all (the names are agentd's launchers: no blanks).
    [ -z "$links" ] || ln -s $links "$root/opt/keystone/bin/"
  fi
  if [ "$agents" = 1 ]; then
    keystone_dir "$root/opt/keystone/agents"
    mount -t 9p -o $o,cache=loose keystone-agents "$root/opt/keystone/agents" ||
      die "cannot mount the agent toolbox (tag keystone-agents)"
  elif [ "$agents" = disk ]; then
    # A guest whose workspace is a disk mounts no share: the toolbox is
    # a read-only disk too, the fourth (agentd copies its tools in).
    keystone_dir "$root/opt/keystone/agents"
    mount -t ext4 -o ro,noload,nosuid,nodev /dev/vdd "$root/opt/keystone/agents" ||
      die "cannot mount the agent toolbox (disk /dev/vdd)"
  fi

  # The owner's shared agent home (agent_home = "shared"), read-write.
  if [ "$agenthome" = 1 ]; then
    keystone_dir "$root/opt/keystone/agent-home"
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=524288,nosuid,nodev,cache=none \
      keystone-agent-home "$root/opt/keystone/agent-home" ||
      die "cannot mount the shared agent home (tag keystone-agent-home)"
  fi

  keystone_keys

  # `agent` takes the uid and gid that own the workspace on the host: one
  # sed for both files, each expression matching only its file's lines
  # (seven fields in passwd, four in group).
  sed -i -e "s/^agent:x:[0-9]*:[0-9]*:\([^:]*:[^:]*:[^:]*\)\$/agent:x:$uid:$gid:\1/" \
    -e "s/^agent:x:[0-9]*:\([^:]*\)\$/agent:x:$gid:\1/" "$root/etc/passwd" "$root/etc/group"
  [ "$(stat -c %u:%g "$root/home/agent")" = "$uid:$gid" ] || chown -R "$uid:$gid" "$root/home/agent"
  # A workspace disk copied from another sandbox (a fork) is its ids'.
  if [ "$share" = disk ] && [ "$(stat -c %u:%g "$root/workspace")" != "$uid:$gid" ]; then
    chown -R "$uid:$gid" "$root/workspace"
  fi
  keystone_names
}

# The guest's name, and whether the relay to the egress gateway
# (keystone-egress.socket) runs: only in a sandbox with a network.
keystone_names() {
  echo "$name" > "$root/etc/hostname"
  keystone_dir "$root/etc/keystone"
  if [ "$egress" = 1 ]; then : > "$root/etc/keystone/egress"; else rm -f "$root/etc/keystone/egress"; fi
}

# The sandbox's ssh keys: they never touch the shares. (A restored guest's
# fw_cfg files are padded with newlines: blank lines go.)
# The host key is made under umask 077 (0600); the files are made only
# here, so they keep these modes when written again.
keystone_keys() {
  keystone_dir "$root/etc/ssh/keystone"
  umask 077
  sed '/^$/d' "$host_key_file" > "$root/etc/ssh/keystone/ssh_host_ed25519_key" || die "cannot install the ssh host key"
  umask 022
  sed '/^$/d' "$authorized_keys_file" > "$root/etc/ssh/keystone/authorized_keys" || die "cannot install the authorized keys"
}
