//! `agentctl exec`: output streams while the command runs, stdin reaches it,
//! worktrees as working directories, and a caller that goes away takes its
//! command with it.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::Stdio;
use std::time::Duration;

use common::{Env, wait_for};

fn running(name: &str) -> (Env, std::path::PathBuf) {
    let env = Env::new();
    let repo = env.repo(name);
    env.ok(&["create", repo.to_str().unwrap()]);
    env.ok(&["start", name]);
    (env, repo)
}

#[test]
fn output_arrives_while_the_command_runs() {
    let (env, _) = running("stream");
    let mut child = env
        .ctl_cmd(&[
            "exec",
            "stream",
            "--",
            "sh",
            "-c",
            "echo first; sleep 30; echo second",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "first\n");
    assert!(
        child.try_wait().unwrap().is_none(),
        "the first line came only after the command ended"
    );
    child.kill().unwrap();
    let _ = child.wait();
}

#[test]
fn stdin_reaches_the_command_and_exit_codes_pass_through() {
    let (env, _) = running("input");
    let mut child = env
        .ctl_cmd(&["exec", "input", "--", "sh", "-c", "tr a-z A-Z; exit 3"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"hello sandbox\n")
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "HELLO SANDBOX\n");
    assert_eq!(out.status.code(), Some(3));
    // Binary data in, binary data out.
    let data: Vec<u8> = (0..=255u8).cycle().take(300_000).collect();
    let mut child = env
        .ctl_cmd(&["exec", "input", "--", "cat"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let feed = data.clone();
    let writer = std::thread::spawn(move || stdin.write_all(&feed));
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap().unwrap();
    assert!(out.status.success());
    assert_eq!(out.stdout.len(), data.len());
    assert!(out.stdout == data);
}

#[test]
fn worktree_sets_the_working_directory() {
    let (env, _) = running("wtx");
    env.ok(&["worktree", "add", "wtx", "feature/a"]);
    assert_eq!(
        env.ok(&["exec", "wtx", "--worktree", "feature/a", "--", "pwd"]),
        "/workspace/.worktrees/feature/a\n"
    );
    assert_eq!(
        env.ok(&["exec", "wtx", "-b", "main", "--", "pwd"]),
        "/workspace\n"
    );
    let err = env.fails(4, &["exec", "wtx", "--worktree", "nope", "--", "pwd"]);
    assert!(
        err.contains("no worktree for 'nope'") && err.contains("agentctl worktree add wtx nope"),
        "{err}"
    );
    let err = env.fails(
        4,
        &[
            "exec",
            "wtx",
            "--worktree",
            "main",
            "-w",
            "/tmp",
            "--",
            "pwd",
        ],
    );
    assert!(!err.is_empty());
}

#[test]
fn a_killed_agentctl_takes_its_command_along() {
    let (env, _) = running("gone");
    let mut child = env
        .ctl_cmd(&[
            "exec",
            "gone",
            "--",
            "sh",
            "-c",
            "echo $$ > /tmp/pid; echo ready; exec sleep 1000",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line, "ready\n");
    let pid = env
        .ok(&["exec", "gone", "--", "cat", "/tmp/pid"])
        .trim()
        .to_owned();
    child.kill().unwrap();
    let _ = child.wait();
    wait_for("the command to be killed", Duration::from_secs(10), || {
        env.ctl(&["exec", "gone", "--", "kill", "-0", &pid])
            .status
            .code()
            != Some(0)
    });
}

#[test]
fn every_exec_is_in_the_history() {
    let (env, _) = running("hist");
    env.ok(&["exec", "hist", "--", "true"]);
    let _ = env.ctl(&["exec", "hist", "--", "sh", "-c", "exit 4"]);
    let _ = env.ctl(&["exec", "hist", "--", "no-such-program", "with space"]);
    let h: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["history", "hist", "--json"])).unwrap();
    assert_eq!(h.len(), 3, "{h:?}");
    assert_eq!(h[0]["detail"], "true");
    assert_eq!(h[0]["exit_code"], 0);
    assert_eq!(h[1]["detail"], "sh -c 'exit 4'");
    assert_eq!(h[1]["exit_code"], 4);
    assert_eq!(h[2]["exit_code"], serde_json::Value::Null);
    assert!(h[2]["error"].as_str().unwrap().contains("not found"));
    assert_eq!(h[0]["uid"], nix::unistd::Uid::effective().as_raw());
    let last: Vec<serde_json::Value> =
        serde_json::from_str(&env.ok(&["history", "hist", "--json", "-n", "1"])).unwrap();
    assert_eq!(last.len(), 1);
    assert_eq!(last[0]["detail"], h[2]["detail"]);
    assert!(env.ok(&["history", "hist"]).starts_with("TIME"));
}
