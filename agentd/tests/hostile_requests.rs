//! agentd's memory, CPU and descriptors are bounded per request: what a
//! hostile command or caller sends ends with the request, and nothing it
//! sends grows what agentd keeps.

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::Env;
use keystone_agent_api::Error;

/// agentd's resident memory (KiB), CPU time (clock ticks) and descriptors.
fn usage(pid: i32) -> (u64, u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap();
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .collect();
    let cpu = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    (rss, cpu, fds)
}

/// `n` `Exec` calls that each leave a writer of endless output behind.
fn flood(env: &Env, n: usize) {
    env.with_sandbox("flood", async |sb| {
        for _ in 0..n {
            let r = sb
                .exec(
                    &[
                        "sh",
                        "-c",
                        "setsid sh -c 'exec cat /dev/zero' & echo started",
                    ],
                    HashMap::new(),
                    "",
                    0,
                )
                .await
                .unwrap();
            assert_eq!(r.exit_code, 0);
            assert!(r.stdout.starts_with(b"started\n"));
        }
    });
    // Three seconds on, the calls' readers are gone (or not).
    std::thread::sleep(Duration::from_secs(3));
}

#[test]
fn a_writer_left_in_the_background_costs_agentd_nothing_after_the_call() {
    let env = Env::running("flood", &[]);
    let pid = env.agentd_pid();
    env.ok(&["exec", "flood", "--", "true"]);
    let (rss0, _, fds0) = usage(pid);
    // One round first: what the allocator keeps of one call's buffers is
    // then part of the baseline; a second round must add nothing to it.
    flood(&env, 1);
    let (rss1, _, _) = usage(pid);
    flood(&env, 3);
    let (rss2, cpu2, fds2) = usage(pid);
    std::thread::sleep(Duration::from_secs(2));
    let (rss3, cpu3, fds3) = usage(pid);
    eprintln!(
        "agentd after 4 flooding Exec calls: RSS {rss0} KiB -> {rss3} KiB \
         ({rss1} KiB after the first), descriptors {fds0} -> {fds3}, \
         CPU over the next 2 s: {} ticks",
        cpu3 - cpu2
    );
    assert!(
        cpu3 - cpu2 <= 20,
        "agentd keeps spinning: {} ticks in 2 s",
        cpu3 - cpu2
    );
    assert!(
        fds2 <= fds0 + 2 && fds3 <= fds0 + 2,
        "descriptors {fds0} -> {fds2}, {fds3}"
    );
    // Each call's buffers (4 MiB per stream, and the reply's copies) are
    // given back; what the allocator keeps of them does not add up.
    assert!(
        rss2.max(rss3) < rss0 + 32 * 1024,
        "the calls grew RSS from {rss0} KiB to {rss3} KiB"
    );
    // And the writers, having lost their reader, have ended.
    common::wait_for(
        "the background writers to end",
        Duration::from_secs(20),
        || {
            env.ctl(&[
                "exec",
                "flood",
                "--",
                "sh",
                "-c",
                // (Not the `cat` agentd runs to hear the agents' hooks.)
                "for f in /proc/[0-9]*/cmdline; do tr '\\0' ' ' < $f; echo; done | grep -qx 'cat /dev/zero '",
            ])
            .status
            .code()
                == Some(1)
        },
    );
}

#[test]
fn oversized_arguments_are_refused_and_nothing_grows() {
    let env = Env::running("big", &[]);
    let registry = env.state_dir.join("registry/big.json");
    let size0 = std::fs::metadata(&registry).unwrap().len();
    let huge = "b".repeat(30 << 20);
    let long = "b".repeat(8 << 10);
    env.with_sandbox("big", async |sb| {
        let invalid = |r: Result<_, Error>, what: &str| match r {
            Err(Error::InvalidArgument(m)) => {
                assert!(m.len() < 1024, "{what}: the error repeats the input");
            }
            other => {
                let shown: String = format!("{other:?}").chars().take(300).collect();
                panic!("{what}: expected InvalidArgument, got {shown}")
            }
        };
        let opts = |b: &str| HashMap::from([("branch", zvariant::Value::from(b.to_owned()))]);
        invalid(sb.sync(opts(&huge)).await.map(|_| ()), "30 MiB branch");
        invalid(sb.sync(opts(&long)).await.map(|_| ()), "8 KiB branch");
        invalid(
            sb.add_worktree(&long, "").await.map(|_| ()),
            "8 KiB worktree",
        );
        let argv: Vec<&str> = std::iter::repeat_n("x", 5000).collect();
        invalid(
            sb.exec(&argv, HashMap::new(), "", 0).await.map(|_| ()),
            "5000 arguments",
        );
    });
    let size1 = std::fs::metadata(&registry).unwrap().len();
    let status = env.status("big");
    eprintln!("the sandbox's registry record after the oversized calls: {size0} -> {size1} bytes");
    assert!(
        size1 < size0 + 4096,
        "registry grew from {size0} to {size1} bytes"
    );
    assert!(
        status["last_sync_result"]
            .as_str()
            .unwrap_or_default()
            .len()
            <= 2048,
        "{status}"
    );
}
