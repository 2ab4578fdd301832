//! The record of every terminal session, written by agentd from outside
//! the sandbox: a real `agentctl exec --tty` in a real terminal (tmux),
//! then `agentctl sessions log` and `agentctl replay` read it back as
//! asciicast v2 with what was typed and printed, its size changes too,
//! and `agentctl audit` lists the lines typed; the sandbox cannot reach
//! either, another uid cannot list or open them, and they go with
//! destroy.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::time::Duration;

use common::term::Terminal;
use common::{Env, agentctl, json};

const LONG: Duration = Duration::from_secs(60);
const NOBODY: u32 = 65534;

#[test]
fn a_terminal_session_is_recorded_outside_the_sandbox_and_replays() {
    let env = Env::running("rec", &[]);
    let t = Terminal::new(env.tmp.path(), 100, 30, &[]);
    t.line(&format!(
        "{} --bus {} exec --tty rec -- bash --norc --noprofile; echo code=$?",
        agentctl().display(),
        env.address
    ));
    t.line("echo hi-$((6*7))");
    t.wait_screen("the command's output", LONG, |s| s.contains("hi-42"));
    // A hostile program sets the clipboard and the title.
    t.line("printf 'clip\\033]52;c;aGk=\\007ask\\033]0;pwned\\007\\n'");
    t.wait_screen("the hostile output", LONG, |s| s.contains("clipask"));
    t.resize(120, 40);
    t.line("stty size");
    t.wait_screen("the new size", LONG, |s| s.contains("40 120"));
    t.line("exit 3");
    t.wait_screen("agentctl to exit", LONG, |s| s.contains("code=3"));

    let log = json(&env.ok(&["sessions", "log", "rec", "--json"]));
    let log = log.as_array().unwrap();
    assert_eq!(log.len(), 1, "{log:?}");
    let r = &log[0];
    assert_eq!(r["kind"], "exec");
    assert_eq!(r["detail"], "bash --norc --noprofile");
    assert_eq!(r["uid"], u64::from(nix::unistd::getuid().as_raw()));
    let id = r["id"].as_str().unwrap().to_owned();

    // The file itself: asciicast v2, with the typing, the output and the
    // new size, in order.
    let raw = env.ok(&["replay", "rec", &id, "--raw"]);
    let mut lines = raw.lines();
    let header: serde_json::Value = serde_json::from_str(lines.next().unwrap()).unwrap();
    assert_eq!(header["version"], 2);
    assert_eq!(
        (header["width"].as_u64(), header["height"].as_u64()),
        (Some(100), Some(30))
    );
    let events: Vec<(f64, String, String)> =
        lines.map(|l| serde_json::from_str(l).unwrap()).collect();
    let typed: String = events
        .iter()
        .filter(|e| e.1 == "i")
        .map(|e| e.2.as_str())
        .collect();
    assert!(typed.contains("echo hi-$((6*7))"), "{typed:?}");
    assert!(typed.contains("exit 3\r"), "{typed:?}");
    let at = |code: &str, text: &str| {
        events
            .iter()
            .position(|e| e.1 == code && e.2.contains(text))
            .unwrap_or_else(|| panic!("no {code} event with {text:?}"))
    };
    assert!(at("o", "hi-42") < at("r", "120x40"));
    assert!(at("r", "120x40") < at("o", "40 120"));
    assert!(
        events.windows(2).all(|w| w[0].0 <= w[1].0),
        "time goes back"
    );
    // Played at once, it prints what the session printed.
    let played = env.ok(&["replay", "rec", &id, "--speed", "0"]);
    assert!(
        played.contains("hi-42") && played.contains("40 120"),
        "{played}"
    );
    // Played, never the sequences that would set the replayer's clipboard
    // or title; the file itself keeps them.
    assert!(played.contains("clipask"), "{played:?}");
    assert!(
        !played.contains("\x1b]52") && !played.contains("\x1b]0;pwned"),
        "{played:?}"
    );
    assert!(
        raw.contains("\\u001b]52;c;aGk="),
        "the record lost the output"
    );

    // What was typed, a line an entry, in the audit log: who, when, in
    // which session.
    let audit = json(&env.ok(&["audit", "rec", "--json", "--limit", "0"]));
    let audit = audit.as_array().unwrap();
    let typed: Vec<&str> = audit.iter().map(|e| e["typed"].as_str().unwrap()).collect();
    assert!(
        typed.iter().any(|t| t.starts_with("echo hi-$((6*7))")),
        "{typed:?}"
    );
    assert!(
        typed.contains(&"stty size\r") && typed.contains(&"exit 3\r"),
        "{typed:?}"
    );
    for e in audit {
        assert_eq!(e["session"], id.as_str());
        assert_eq!(e["uid"], u64::from(nix::unistd::getuid().as_raw()));
        assert_eq!(e["kind"], "exec");
    }
    let log = env.state_dir.join("audit/rec.jsonl");
    assert_eq!(
        std::fs::metadata(&log).unwrap().permissions().mode() & 0o777,
        0o600
    );
    let (code, _) = env.inside("rec", &format!("echo '{{}}' >> '{}'", log.display()));
    assert_ne!(code, 0, "the sandbox wrote into its audit log");

    // agentd's file, out of the sandbox's reach.
    let dir = env.state_dir.join("recordings/rec");
    let file = dir.join(format!("{id}.cast"));
    let (d, f) = (
        std::fs::metadata(&dir).unwrap(),
        std::fs::metadata(&file).unwrap(),
    );
    assert_eq!(
        (d.permissions().mode() & 0o777, d.uid()),
        (0o700, nix::unistd::geteuid().as_raw())
    );
    assert_eq!(f.permissions().mode() & 0o777, 0o600);
    let (code, _) = env.inside(
        "rec",
        &format!(
            "echo forged >> '{}' || cat '{}'",
            file.display(),
            file.display()
        ),
    );
    assert_ne!(code, 0, "the sandbox reached its own record");
    assert!(!std::fs::read_to_string(&file).unwrap().contains("forged"));

    // Nobody else lists or opens it; a name that is not a record's is not
    // a path.
    if common::is_root() {
        for args in [
            vec!["sessions", "log", "rec"],
            vec!["replay", "rec", id.as_str(), "--raw"],
            vec!["audit", "rec"],
        ] {
            let out = env.ctl_as(Some(NOBODY), &args);
            assert!(!out.status.success(), "uid {NOBODY} ran {args:?}");
            assert!(!String::from_utf8_lossy(&out.stdout).contains("hi-42"));
        }
    }
    env.fails(1, &["replay", "rec", "../../registry"]);
    env.fails(1, &["replay", "rec", "20000101-000000-00000000"]);

    // The records go with the sandbox.
    env.ok(&["stop", "rec"]);
    env.ok(&["destroy", "--force", "rec"]);
    assert!(!dir.exists(), "the records outlived their sandbox");
    assert!(!log.exists(), "the audit log outlived its sandbox");
}
