//! The `vm` backend with real QEMU microVMs booted from the Debian-built
//! guest image (KVM when it works, TCG otherwise): create → start → git in
//! the guest → a commit synced back → a dev server reached through Caddy →
//! stop with nothing left behind; boot failures reported with the console;
//! a VM that outlives a killed agentd adopted, or cleaned up when it was
//! still starting.
//!
//! These boot VMs (seconds each under TCG), so they are `#[ignore]`d in the
//! fast suite; `tests/run-vm.sh` builds the image and runs them.

mod common;

use std::time::Duration;

use common::caddy::Caddy;
use common::vm::{create_vm, create_vm_with, env_with, image};
use common::{Env, git, wait_for};

fn assert_nothing_left(env: &Env) {
    // The supervisor takes its children along; give the kernel a moment
    // to reap them.
    let mut left = Vec::new();
    for _ in 0..50 {
        left = env.vm_processes();
        if left.is_empty() {
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("processes left behind: {left:#?}");
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn a_vm_sandbox_boots_runs_git_syncs_serves_and_stops_without_leftovers() {
    let dir = tempfile::tempdir().unwrap();
    let caddy = Caddy::start(dir.path());
    let proxy: serde_json::Value = serde_json::from_str(&caddy.agentd_config(false)).unwrap();
    let env = env_with(&image(), proxy);
    // Protected paths (the default list), and a symlink where one would be.
    let repo = env.repo("vmtest");
    std::fs::create_dir_all(repo.join(".github/workflows")).unwrap();
    std::fs::write(repo.join(".github/workflows/ci.yml"), "on: push\n").unwrap();
    std::fs::write(repo.join(".gitlab-ci.yml"), "job: {}\n").unwrap();
    std::os::unix::fs::symlink("/etc", repo.join(".husky")).unwrap();
    common::git(&repo, &["add", "-A"]);
    common::commit(&repo, "ci");
    create_vm_with(&env, "vmtest", "none", &["--agent-home", "shared"]);
    env.ok(&["start", "vmtest"]);
    let st = env.status("vmtest");
    assert_eq!(st["state"], "running", "{st}");
    assert_eq!(st["backend"], "vm", "{st}");
    let limits = st["limits"].as_str().unwrap();
    assert!(
        limits.contains("QEMU microvm under TCG") || limits.contains("QEMU microvm under KVM"),
        "the accelerator is reported: {limits}"
    );
    assert!(limits.contains("2 vCPUs, 1024 MiB RAM"), "{limits}");
    let log = env.log();
    assert!(
        log.contains("accel=tcg") || log.contains("accel=kvm"),
        "the accelerator is logged:\n{log}"
    );

    // It is a VM: its own kernel, the sandbox's memory, no NIC for
    // network "none", and the workspace at /workspace.
    let out = env.sh(
        "vmtest",
        "uname -r; grep MemTotal /proc/meminfo; nproc; ls /sys/class/net; git -C /workspace status",
    );
    assert!(out.contains("-amd64\n"), "{out}");
    let kib: u64 = out
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap();
    assert!((800_000..=1_048_576).contains(&kib), "{out}");
    assert!(out.contains("\n2\nlo\n"), "one NIC, loopback: {out}");
    assert!(out.contains("On branch main"), "{out}");
    assert!(
        out.contains("nothing to commit, working tree clean"),
        "{out}"
    );

    // The protected paths are read-only inside (the guest's own mounts:
    // advisory, the sync holds their changes), the rest is the agent's,
    // and the symlink was not followed.
    for attack in [
        "echo 'run: evil' >> .github/workflows/ci.yml",
        "echo evil > .github/workflows/new.yml",
        "rm -rf .github/workflows",
        "echo evil > .gitlab-ci.yml",
        "rm -f .gitlab-ci.yml",
    ] {
        let (code, out) = env.inside("vmtest", &format!("cd /workspace && {attack}"));
        assert_ne!(code, 0, "`{attack}` worked inside the guest: {out}");
    }
    let out = env.sh(
        "vmtest",
        "cd /workspace && cat .gitlab-ci.yml && echo ok > ok.txt && rm ok.txt && test -L .husky && \
         grep -c -e ' /workspace/.husky ' -e ' /etc ' /proc/self/mountinfo || true",
    );
    assert_eq!(out, "job: {}\n0\n", "nothing mounted through the symlink");

    // The agent toolbox, shared read-only from the host's cache (.ci/run
    // fills it with `agentd --install-agents`): the pinned CLIs run in the
    // guest, first on PATH, and the guest cannot write them.
    let v = agentd::toolbox::Versions::default();
    let out = env.sh(
        "vmtest",
        "command -v claude; claude --version; codex --version; gemini --version; \
         (echo hostile > /run/keystone/agents/x) 2>/dev/null && echo wrote; true",
    );
    assert_eq!(
        out,
        format!(
            "/run/keystone/bin/claude\n{} (Claude Code)\ncodex-cli {}\n{}\n",
            v.claude, v.codex, v.gemini
        ),
        "(the toolbox comes from the cache: agentd --install-agents)"
    );
    assert!(
        env.status("vmtest")["agents"]
            .as_str()
            .unwrap()
            .starts_with("claude ")
    );

    // The agents' hooks: agentd configured them in the guest (here in the
    // shared agent home), and a hook run there reaches `list` and
    // `status` on the host.
    wait_for(
        "the agents' hooks in the guest",
        Duration::from_secs(120),
        || {
            env.inside(
                "vmtest",
                r#"grep -q 'keystone-notify claude Stop' "${CLAUDE_CONFIG_DIR:-$HOME/.claude}/settings.json" && test -p ~/.keystone/notify"#,
            )
            .0 == 0
        },
    );
    env.sh(
        "vmtest",
        r#"printf '%s' '{"message":"the vm waits"}' | keystone-notify claude Notification"#,
    );
    common::wait_for(
        "the waiting agent",
        std::time::Duration::from_secs(30),
        || env.list()[0]["waiting"] == 1,
    );
    assert_eq!(
        env.status("vmtest")["waiting_agents"][0]["message"],
        "the vm waits"
    );

    // A secret: its placeholder and the sandbox's CA reach the guest (the
    // CA through agentd's shared tools directory).
    let mut set = env
        .ctl_cmd(&[
            "secret",
            "set",
            "vmtest",
            "ANTHROPIC_API_KEY",
            "--host",
            "api.anthropic.com",
            "--header",
            "x-api-key",
        ])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(&mut set.stdin.take().unwrap(), b"sk-vm-test-value\n").unwrap();
    assert!(set.wait().unwrap().success());
    let out = env.sh("vmtest",
        "echo $ANTHROPIC_API_KEY; head -1 $NODE_EXTRA_CA_CERTS; grep -c 'BEGIN CERTIFICATE' $SSL_CERT_FILE",
    );
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].starts_with("keystone-placeholder-"), "{out}");
    assert_eq!(lines[1], "-----BEGIN CERTIFICATE-----", "{out}");
    assert!(
        lines[2].parse::<u32>().unwrap() > 1,
        "the system's roots and the sandbox's CA: {out}"
    );

    // A commit made in the guest reaches the host with sync.
    env.sh(
        "vmtest",
        "echo 'made in a VM' > vm.txt && git add vm.txt && \
         git -c user.name=Agent -c user.email=agent@example.com commit -qm 'from the guest'",
    );
    let out = env.ok(&["sync", "vmtest"]);
    assert!(out.contains("main"), "{out}");
    let repo = env.tmp.path().join("vmtest");
    let msg = git(&repo, &["log", "-1", "--format=%s", "sandbox/vmtest/main"]);
    assert_eq!(msg.trim(), "from the guest");
    let file = git(&repo, &["show", "sandbox/vmtest/main:vm.txt"]);
    assert_eq!(file, "made in a VM\n");

    // A dev server in the guest answers at its link through Caddy, over
    // the control channel (the guest has no network at all). It listens on
    // every address, IPv6 included, as most dev servers do.
    env.sh(
        "vmtest",
        "busybox httpd -f -p 8123 -h /workspace </dev/null >/dev/null 2>&1 &",
    );
    let mut last = (0, String::new());
    wait_for(
        "the guest's dev server link",
        Duration::from_secs(60),
        || {
            last = caddy.get("vmtest.sandbox.local", "/vm.txt");
            last.0 == 200
        },
    );
    assert_eq!(last.1, "made in a VM\n");
    let ports: serde_json::Value =
        serde_json::from_str(&env.ok(&["ports", "vmtest", "--json"])).unwrap();
    assert!(
        ports["routes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["port"] == 8123),
        "{ports}"
    );

    // OpenSSH into the guest through agentd (docs/ssh.md): a command, a
    // terminal, files both ways over SFTP, a forward to the dev server on
    // the guest's loopback; any other address refused.
    ssh_into_the_guest(&env, "vmtest");

    // QEMU runs as the sandbox's uid (the workspace's owner), never as
    // root (virtiofsd too: see the hostile guest root's test below). The
    // control channel is QEMU's own virtio-serial: no device helper.
    let ws_uid = std::os::unix::fs::MetadataExt::uid(
        &std::fs::metadata(env.state_dir.join("sandboxes/vmtest/workspace")).unwrap(),
    );
    assert_ne!(ws_uid, 0);
    let procs = env.vm_processes();
    assert!(
        !procs.iter().any(|(_, c)| c.contains("vhost-device")),
        "{procs:#?}"
    );
    let name = "qemu-system";
    let (pid, _) = procs
        .iter()
        .find(|(_, c)| c.contains(name))
        .unwrap_or_else(|| panic!("no {name} in {procs:#?}"));
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let uids = status.lines().find(|l| l.starts_with("Uid:")).unwrap();
    let ids: Vec<u32> = uids[4..]
        .split_whitespace()
        .map(|x| x.parse().unwrap())
        .collect();
    assert!(
        ids.iter().all(|&u| u == ws_uid),
        "{name}: {uids}, want {ws_uid}"
    );
    let groups = status.lines().find(|l| l.starts_with("Groups:")).unwrap();
    assert!(
        !groups[7..].split_whitespace().any(|g| g == "0"),
        "{name}: {groups}"
    );

    // Nothing of the VM listens on a host port.
    let mut host_ports = Vec::new();
    for (pid, cmd) in env.vm_processes() {
        let listening = agentd::procfs::tcp_listeners(pid);
        for inode in agentd::procfs::socket_inodes(pid) {
            if let Some(l) = listening.get(&inode) {
                host_ports.push((cmd.clone(), *l));
            }
        }
    }
    assert!(host_ports.is_empty(), "{host_ports:?}");

    // The home is a disk of its own that outlives the VM: what an agent's
    // login leaves there stays.
    env.sh(
        "vmtest",
        "mkdir -p ~/.claude && echo 'logged in' > ~/.claude/.credentials.json \
         && grep -q ' /home/agent ext4 ' /proc/mounts",
    );

    // The owner's shared agent home (agent_home = "shared"): the guest's
    // agent writes it as its own, and it is root's on the host (QEMU, as the
    // sandbox's uid, gets an idmapped copy of the directory).
    let ids = env.sh(
        "vmtest",
        "echo token > $CODEX_HOME/auth.json && stat -c %u $CODEX_HOME/auth.json && id -u",
    );
    let mut ids = ids.lines();
    assert_eq!(ids.next(), ids.next(), "the agent owns what it wrote");
    let uid = nix::unistd::Uid::effective().as_raw();
    let stored = env
        .state_dir
        .join(format!("agent-homes/{uid}/codex/auth.json"));
    assert_eq!(std::fs::read_to_string(&stored).unwrap(), "token\n");
    assert_eq!(
        std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&stored).unwrap()),
        uid
    );

    env.ok(&["stop", "vmtest"]);
    assert_eq!(env.state("vmtest"), "stopped");
    assert_nothing_left(&env);
    let boot =
        std::fs::read_to_string(env.state_dir.join("sandboxes/vmtest/logs/boot.log")).unwrap();
    assert!(boot.contains("keystone: ready"), "{boot}");
    assert!(
        boot.contains("reboot: Power down"),
        "a clean power-off: {boot}"
    );

    // The workspace and the home persist: a second start sees both files.
    env.ok(&["start", "vmtest"]);
    let out = env.sh("vmtest", "cat vm.txt ~/.claude/.credentials.json");
    assert_eq!(out, "made in a VM\nlogged in\n");
    // A forced stop kills the VM at once; destroy removes the rest.
    env.ok(&["stop", "--force", "vmtest"]);
    assert_nothing_left(&env);
    env.ok(&["destroy", "--force", "vmtest"]);
    assert!(!env.state_dir.join("sandboxes/vmtest").exists());
    assert_nothing_left(&env);
}

/// `ssh`, `scp` and `sftp` into vm sandbox `name` (its dev server on port
/// 8123 of the guest's loopback), as ssh.rs does for a local one.
fn ssh_into_the_guest(env: &Env, name: &str) {
    use common::ssh::run;
    let config = common::ssh::config(env, name, &env.tmp.path().join("ssh-state"));
    let conf = config.to_str().unwrap();
    let host = format!("keystone-{name}");
    let ssh = |args: &[&str], input: &[u8]| {
        let mut all = vec!["-F", conf];
        all.extend_from_slice(args);
        run("ssh", &all, input)
    };
    let out = ssh(&[&host, "uname -r; pwd; git status --short | wc -l"], b"");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("-amd64\n/workspace\n"), "{text}");
    let out = ssh(&["-tt", &host, "tty"], b"");
    assert!(String::from_utf8_lossy(&out.stdout).contains("/dev/pts/"));
    let up = env.tmp.path().join("ssh-up.txt");
    std::fs::write(&up, "over ssh\n").unwrap();
    let to = format!("{host}:/workspace/ssh-up.txt");
    let scp = run("scp", &["-F", conf, up.to_str().unwrap(), &to], b"");
    assert!(scp.status.success());
    assert_eq!(env.sh(name, "cat /workspace/ssh-up.txt"), "over ssh\n");
    let out = ssh(
        &["-W", "127.0.0.1:8123", &host],
        b"GET /vm.txt HTTP/1.0\r\n\r\n",
    );
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("made in a VM"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ssh(&["-W", "10.0.2.2:22", &host], b"");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("administratively prohibited"));
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn a_guest_that_cannot_boot_ends_in_error_with_its_console_and_no_leftovers() {
    let real = image();
    let tmp = tempfile::tempdir().unwrap();
    // An initramfs that is junk: the kernel finds no root and panics.
    let broken = tmp.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    std::os::unix::fs::symlink(real.join("vmlinux"), broken.join("vmlinux")).unwrap();
    std::os::unix::fs::symlink(real.join("rootfs.img"), broken.join("rootfs.img")).unwrap();
    std::fs::write(broken.join("initrd"), b"not an initramfs").unwrap();
    let env = env_with(&broken, serde_json::json!({}));
    create_vm(&env, "panics", "nat");
    let err = env.fails(3, &["start", "panics"]);
    assert!(err.contains("ended while booting"), "{err}");
    assert!(err.contains("boot.log"), "{err}");
    assert!(
        err.contains("Kernel panic"),
        "the console's last lines: {err}"
    );
    let st = env.status("panics");
    assert_eq!(st["state"], "error");
    assert!(
        st["state_reason"]
            .as_str()
            .unwrap()
            .contains("Kernel panic"),
        "{st}"
    );
    assert_nothing_left(&env);
    drop(env);

    // An image without a kernel: refused before anything starts.
    let nokernel = tmp.path().join("nokernel");
    std::fs::create_dir(&nokernel).unwrap();
    std::os::unix::fs::symlink(real.join("initrd"), nokernel.join("initrd")).unwrap();
    std::os::unix::fs::symlink(real.join("rootfs.img"), nokernel.join("rootfs.img")).unwrap();
    let env = env_with(&nokernel, serde_json::json!({}));
    create_vm(&env, "nokernel", "none");
    let err = env.fails(3, &["start", "nokernel"]);
    assert!(err.contains("has no vmlinux"), "{err}");
    assert!(
        err.contains(&nokernel.join("vmlinux").display().to_string()),
        "{err}"
    );
    assert_eq!(env.state("nokernel"), "error");
    assert_nothing_left(&env);
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn a_vm_outlives_a_killed_agentd_and_is_adopted_or_cleaned_up() {
    let img = image();
    // This one shares its workspace over 9p, QEMU's own (as when agentd is
    // not root), and has a network: the egress gateway.
    let dir = tempfile::tempdir().unwrap();
    let caddy = Caddy::start(dir.path());
    let mut extra: serde_json::Value = serde_json::from_str(&caddy.agentd_config(false)).unwrap();
    extra["vm"] = serde_json::json!({"share": "9p"});
    extra["egress"] = serde_json::json!({"hosts": {"origin.test": "127.0.0.1"}});
    let mut env = env_with(&img, extra);
    create_vm(&env, "survivor", "nat");
    env.ok(&["start", "survivor"]);
    let limits = env.status("survivor")["limits"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(limits.contains("workspace over 9p"), "{limits}");
    env.sh(
        "survivor",
        "echo via-9p > /workspace/shared.txt; mkdir -p ~/.codex && echo token > ~/.codex/auth.json",
    );
    // No NIC: its only way out is the egress gateway, through root's
    // master connection. The host's
    // loopback (QEMU's old 10.0.2.2) answers only through an address-range
    // entry.
    let port = common::origin(
        std::net::IpAddr::from([127, 0, 0, 1]),
        "host-loopback-service",
    );
    let through_gateway = |env: &Env| {
        env.sh(
            "survivor",
            &format!(
                "for i in $(seq 100); do curl -sS --max-time 20 http://origin.test:{port}/ 2>&1 && exit 0; sleep 0.2; done; exit 0"
            ),
        )
    };
    let out = env.sh("survivor",
        &format!(
            "ls /sys/class/net; curl -sS --max-time 10 --noproxy '*' http://10.0.2.2:{port}/ 2>&1; exit 0"
        ),
    );
    assert!(
        out.starts_with("lo\n") && !out.contains("host-loopback-service"),
        "{out}"
    );
    // Caddy's admin API (whoever reaches it owns Caddy) answers neither
    // directly nor through the gateway.
    let admin = caddy.admin;
    let out = env.sh("survivor",
        &format!(
            "for a in 10.0.2.2 127.0.0.1; do curl -sS --max-time 10 --noproxy '*' http://$a:{admin}/config/ 2>&1; done; \
             curl -sS --max-time 20 --noproxy '' --proxy http://127.0.0.1:3128 http://127.0.0.1:{admin}/config/ 2>&1; exit 0"
        ),
    );
    assert!(
        out.contains("refused") && !out.contains("\"apps\""),
        "{out}"
    );
    let out = through_gateway(&env);
    assert!(out.contains("not on this sandbox's allowlist"), "{out}");
    env.ok(&[
        "egress",
        "survivor",
        "allow",
        &format!("127.0.0.1/32:{port}"),
    ]);
    assert_eq!(through_gateway(&env), "host-loopback-service");
    let shared = env
        .state_dir
        .join("sandboxes/survivor/workspace/shared.txt");
    assert_eq!(std::fs::read_to_string(&shared).unwrap(), "via-9p\n");
    let ws_uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&shared).unwrap());
    assert!(
        agentd::auth::SANDBOX_IDS.contains(&ws_uid),
        "files the guest writes belong to the sandbox's own uid, not {ws_uid}"
    );
    let before = env.vm_processes();
    assert!(
        before.iter().any(|(_, c)| c.contains("qemu-system")),
        "{before:#?}"
    );

    env.kill_agentd();
    // The VM runs on without agentd.
    let out = env.vm_processes();
    assert!(
        out.iter().any(|(_, c)| c.contains("qemu-system")),
        "{out:#?}"
    );
    env.start_agentd();
    assert_eq!(env.state("survivor"), "running");
    assert!(env.log().contains("adopted a running sandbox"));
    // Port discovery and links need the adopted VM's paths and uid, which
    // agentd reads back from the supervisor and its plan.
    env.sh(
        "survivor",
        "busybox httpd -f -p 8124 -h /workspace </dev/null >/dev/null 2>&1 &",
    );
    let mut ports = serde_json::Value::Null;
    wait_for(
        "the adopted guest's listener",
        Duration::from_secs(30),
        || {
            ports = serde_json::from_str(&env.ok(&["ports", "survivor", "--json"])).unwrap();
            ports["routes"]
                .as_array()
                .is_some_and(|r| r.iter().any(|x| x["port"] == 8124))
        },
    );
    let out = env.ok(&["exec", "survivor", "--", "cat", "/etc/hostname"]);
    assert_eq!(out, "survivor\n");
    // The agent's login is still there in the adopted guest.
    assert_eq!(env.sh("survivor", "cat ~/.codex/auth.json"), "token\n");
    // The restarted agentd serves the guest's gateway again.
    assert_eq!(through_gateway(&env), "host-loopback-service");
    // The master connections (one per control port; root's carries the
    // gateway's forward) killed: the next command opens them again, and
    // the gateway is reached again.
    let masters: Vec<i32> = env
        .vm_processes()
        .into_iter()
        .filter(|(_, c)| c.contains("ControlMaster=yes") && c.contains("/survivor/"))
        .map(|(p, _)| p)
        .collect();
    assert_eq!(masters.len(), 2, "{:#?}", env.vm_processes());
    for pid in masters {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    let got = through_gateway(&env);
    let log = env.log();
    assert_eq!(
        got,
        "host-loopback-service",
        "{}\n{:#?}",
        &log[log.len().saturating_sub(6000)..],
        env.vm_processes()
    );
    assert!(
        log.contains("master connection opened again"),
        "{}",
        &log[log.len().saturating_sub(6000)..]
    );

    // A VM still booting when agentd dies is stopped at the restart, not
    // left running unowned.
    create_vm(&env, "orphan", "none");
    let mut start = env.ctl_cmd(&["start", "orphan"]).spawn().unwrap();
    wait_for("the orphan's QEMU", Duration::from_secs(60), || {
        env.vm_processes()
            .iter()
            .any(|(_, c)| c.contains("qemu-system") && c.contains("keystone-orphan"))
    });
    env.kill_agentd();
    let _ = start.wait();
    env.start_agentd();
    assert_eq!(env.state("orphan"), "error");
    wait_for(
        "the orphan's processes to end",
        Duration::from_secs(10),
        || {
            !env.vm_processes()
                .iter()
                .any(|(_, c)| c.contains("/orphan/"))
        },
    );
    assert_eq!(env.state("survivor"), "running");

    env.ok(&["stop", "survivor"]);
    assert_nothing_left(&env);
}

/// `ssh` that runs `script` as root inside the guest of sandbox `name`
/// (whose QEMU runs as `uid`), as a hostile guest root would: over the
/// sandbox's own key and root's master connection.
fn guest_root(env: &Env, name: &str, uid: u32, script: &str) -> std::process::Command {
    let dir = env.state_dir.join("sandboxes").join(name);
    let target = agentd::backend::ssh::SshTarget {
        user: "root".into(),
        host: format!("keystone-{name}"),
        port: 22,
        key: dir.join("client/id_ed25519"),
        known_hosts: dir.join("client/known_hosts"),
        alias: format!("keystone-{name}"),
        proxy_command: Some(format!(
            "{} {} {} {uid}",
            common::AGENTD,
            agentd::backend::vm::serial::SERIAL_ARG,
            dir.join("run/vm/control-root.sock").display()
        )),
        control_path: Some(dir.join("client/root.mux")),
    };
    let mut cmd = target.std_command();
    cmd.arg(format!("root@{}", target.host)).arg(script);
    cmd
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn guest_root_is_the_sandboxs_uid_in_the_workspace_and_leaves_agentd_its_reserve() {
    // virtiofs (agentd is root here) on a disk image of its own, so that
    // the guest can fill it.
    let env = env_with(
        &image(),
        serde_json::json!({"vm": {"home_size_mib": 256, "share": "virtiofs"}}),
    );
    create_vm_with(&env, "hostile", "none", &["--disk", "128"]);
    env.ok(&["start", "hostile"]);
    let limits = env.status("hostile")["limits"].as_str().unwrap().to_owned();
    assert!(limits.contains("workspace over virtiofs"), "{limits}");
    assert!(limits.contains("disk 128 MiB (ext4 image)"), "{limits}");
    let ws = env.state_dir.join("sandboxes/hostile/workspace");
    let meta = std::fs::metadata(&ws).unwrap();
    let (uid, gid) = (
        std::os::unix::fs::MetadataExt::uid(&meta),
        std::os::unix::fs::MetadataExt::gid(&meta),
    );
    assert_ne!(uid, 0);
    let reserved = || {
        let fs = nix::sys::statvfs::statvfs(&ws).unwrap();
        (fs.blocks_free(), fs.blocks_available())
    };
    let (free, available) = reserved();
    let reserve = free - available;
    assert!(reserve > 0, "the image keeps no reserve for agentd");

    // The agent leaves a shell in the workspace; guest root makes it and
    // one of its own setuid root, and makes device nodes.
    env.sh("hostile", "cp /bin/sh /workspace/agentsh");
    let out = guest_root(
        &env,
        "hostile",
        uid,
        "cd /workspace; cp /bin/sh rootsh; mkdir rootdir; \
         chown 0:0 agentsh rootsh rootdir; chmod 4755 agentsh rootsh; \
         mknod chardev c 1 1; mknod blockdev b 254 0; chmod 666 chardev blockdev; \
         ls -ln 2>&1; true",
    )
    .output()
    .unwrap();
    eprintln!(
        "guest root in /workspace:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // The file server runs as the sandbox's uid on the host.
    let procs = env.vm_processes();
    let servers: Vec<_> = procs
        .iter()
        .filter(|(_, c)| c.contains("virtiofsd"))
        .collect();
    assert!(!servers.is_empty(), "{procs:#?}");
    for (pid, _) in servers {
        let uids = common::proc_status(*pid, "Uid");
        assert!(
            uids.split_whitespace().all(|u| u == uid.to_string()),
            "virtiofsd {pid}: Uid {uids}, want {uid}"
        );
    }
    // Then the agent and guest root fill the disk. The guest may stop
    // when its disks cannot grow any more (QEMU's files are on this disk
    // too): watch the disk until nothing is written for a while.
    let mut fill = guest_root(
        &env,
        "hostile",
        uid,
        &format!(
            "cd /workspace; setpriv --reuid={uid} --regid={gid} --clear-groups \
             sh -c 'head -c 1G /dev/zero > fill'; cat /dev/zero >> fill; \
             head -c 1G /dev/zero > rootfill; true"
        ),
    )
    .stdout(std::process::Stdio::null())
    .stderr(std::process::Stdio::null())
    .spawn()
    .unwrap();
    let mut last = (reserved(), std::time::Instant::now());
    wait_for("the disk to fill", Duration::from_secs(600), || {
        let now = reserved();
        if now != last.0 {
            last = (now, std::time::Instant::now());
        }
        matches!(fill.try_wait(), Ok(Some(_)))
            || (now.1 == 0 && last.1.elapsed() > Duration::from_secs(15))
    });
    let _ = fill.kill();
    let _ = fill.wait();

    // On the host everything in the workspace is the sandbox's, and none
    // of it is a device.
    let mut wrong = Vec::new();
    let mut stack = vec![ws.clone()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let m = std::fs::symlink_metadata(&path).unwrap();
            let t = m.file_type();
            use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
            if m.uid() != uid || m.gid() != gid || t.is_char_device() || t.is_block_device() {
                wrong.push(format!(
                    "{} {}:{} {:o}",
                    path.display(),
                    m.uid(),
                    m.gid(),
                    m.permissions().mode()
                ));
            }
            if t.is_dir() {
                stack.push(path);
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "not the sandbox's ({uid}:{gid}), or a device: {wrong:#?}"
    );
    assert!(ws.join("agentsh").is_file());
    // The disk is full for the sandbox, not for agentd: the reserve is left
    // and agentd writes the sandbox's settings.
    let (free, available) = reserved();
    assert!(
        available < reserve / 20,
        "the disk was not filled: {available} blocks left"
    );
    assert!(
        free >= reserve * 9 / 10,
        "the guest wrote into agentd's reserve: {free} of {reserve} blocks left"
    );
    env.ok(&["set", "hostile", "--sync-mode", "auto-commit"]);
    env.ok(&["stop", "--force", "hostile"]);
    assert_nothing_left(&env);
}

/// The files QEMU `pid` holds open that were deleted (its temporary files;
/// not the memfds of the guest's memory), with their device and allocated
/// size.
fn deleted_files_of(pid: i32) -> Vec<(String, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| {
            let path = e.ok()?.path();
            let target = std::fs::read_link(&path).ok()?;
            let target = target.to_string_lossy().into_owned();
            let m = std::fs::metadata(&path).ok()?;
            (m.is_file() && !target.starts_with("/memfd:") && target.ends_with(" (deleted)"))
                .then(|| (target, m.dev(), m.blocks() * 512))
        })
        .collect()
}

#[test]
#[ignore = "boots real VMs: run tests/run-vm.sh"]
fn what_a_guest_writes_to_its_root_disk_stays_in_the_sandbox_s_directory() {
    use std::os::unix::fs::MetadataExt;
    // A cold boot: a guest started from the boot snapshot keeps its root's
    // changes in its own memory (an overlay on tmpfs), not on a disk.
    let env = env_with(&image(), serde_json::json!({"vm": {"fast_start": false}}));
    create_vm(&env, "disk", "none");
    env.ok(&["start", "disk"]);
    let qemu = env
        .vm_processes()
        .into_iter()
        .find(|(_, c)| c.contains("qemu-system"))
        .expect("QEMU runs")
        .0;
    // The guest fills its root disk (its /tmp is on it).
    env.sh(
        "disk",
        "dd if=/dev/urandom of=/tmp/fill bs=1M count=64 conv=fsync 2>/dev/null; sync",
    );
    let dir = env.state_dir.join("sandboxes/disk");
    let files = deleted_files_of(qemu);
    eprintln!("QEMU's temporary files: {files:?}");
    let (path, dev, size) = files
        .iter()
        .max_by_key(|f| f.2)
        .expect("QEMU keeps the root disk's writes in a temporary file")
        .clone();
    assert!(size >= 64 << 20, "{files:?}");
    assert!(
        path.starts_with(dir.to_str().unwrap()),
        "the guest's writes are kept outside its sandbox's directory: {path}"
    );
    // On the sandbox's own file system (its disk image where it has one).
    assert_eq!(dev, std::fs::metadata(&dir).unwrap().dev(), "{path}");
    env.ok(&["stop", "disk"]);
    assert_nothing_left(&env);
}
