//! A real terminal for tests: a private tmux server running a shell, driven
//! with send-keys and read with capture-pane.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

pub struct Terminal {
    socket: PathBuf,
}

impl Terminal {
    /// A `cols`×`rows` terminal running `bash --norc` with `env` set, on a
    /// tmux server of its own (socket in `dir`).
    pub fn new(dir: &std::path::Path, cols: u16, rows: u16, env: &[(&str, &str)]) -> Self {
        let t = Self {
            socket: dir.join("tmux.sock"),
        };
        let mut cmd = t.tmux();
        cmd.args(["-f", "/dev/null", "new-session", "-d", "-s", "t"])
            .args(["-x", &cols.to_string(), "-y", &rows.to_string()]);
        for (k, v) in env {
            cmd.args(["-e", &format!("{k}={v}")]);
        }
        cmd.args(["env", "PS1=$ ", "bash", "--norc", "--noprofile"]);
        let out = cmd
            .output()
            .expect("tmux must be installed (apt-get install tmux)");
        assert!(
            out.status.success(),
            "tmux: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // A fixed size whatever clients come and go.
        t.run(&["set-option", "-g", "window-size", "manual"]);
        t.wait_screen("the shell prompt", Duration::from_secs(10), |s| {
            s.contains('$')
        });
        t
    }

    fn tmux(&self) -> Command {
        let mut c = Command::new("tmux");
        c.arg("-S").arg(&self.socket).stdin(Stdio::null());
        c
    }

    fn run(&self, args: &[&str]) -> String {
        let out = self.tmux().args(args).output().unwrap();
        assert!(
            out.status.success(),
            "tmux {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Type `text` and press Enter.
    pub fn line(&self, text: &str) {
        self.run(&["send-keys", "-t", "t", "-l", text]);
        self.run(&["send-keys", "-t", "t", "Enter"]);
    }

    /// Send tmux key names (`C-o`, `d`, `Enter`…).
    pub fn keys(&self, keys: &[&str]) {
        let mut args = vec!["send-keys", "-t", "t"];
        args.extend_from_slice(keys);
        self.run(&args);
    }

    /// What the terminal shows now.
    pub fn screen(&self) -> String {
        self.run(&["capture-pane", "-p", "-t", "t"])
    }

    /// Wait until the screen satisfies `cond`; returns it.
    pub fn wait_screen(
        &self,
        what: &str,
        timeout: Duration,
        cond: impl Fn(&str) -> bool,
    ) -> String {
        let deadline = Instant::now() + timeout;
        loop {
            let s = self.screen();
            if cond(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {what}; the screen shows:\n{s}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Resize the terminal.
    pub fn resize(&self, cols: u16, rows: u16) {
        self.run(&[
            "resize-window",
            "-t",
            "t",
            "-x",
            &cols.to_string(),
            "-y",
            &rows.to_string(),
        ]);
    }

    /// The terminal's settings as `stty -a` prints them, read from a shell
    /// at the prompt (the command runs in the terminal, so it sees the
    /// settings any program left behind).
    pub fn stty(&self, marker: &str) -> String {
        self.line(&format!(
            "clear; echo {marker}-begin; stty -a; echo {marker}-end"
        ));
        let s = self.wait_screen("stty output", Duration::from_secs(10), |s| {
            s.contains(&format!("\n{marker}-end"))
        });
        let start = s.find(&format!("\n{marker}-begin")).unwrap_or(0);
        s[start..].to_owned()
    }
}

impl Drop for Terminal {
    fn drop(&mut self) {
        let _ = self
            .tmux()
            .arg("kill-server")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// Whether `stty -a` output shows a sane, cooked terminal.
pub fn is_cooked(stty: &str) -> bool {
    let words: Vec<&str> = stty.split_whitespace().collect();
    ["icanon", "echo", "isig", "icrnl", "opost"]
        .iter()
        .all(|f| words.contains(f))
}
