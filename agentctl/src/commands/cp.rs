//! `agentctl cp`: files and directories into and out of a sandbox, as a tar
//! stream through the same pipes as `exec` (the sandbox runs `tar`).
//!
//! Copying out never trusts the sandbox: what it sends is filtered by
//! [`crate::unpack`] (only the name asked for, only plain files and
//! directories unless `--links`, no setuid bits, nothing through a symlink)
//! and lands in the destination only when all of it was accepted.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use keystone_agent_api::options::ExecOptions;
use keystone_agent_api::{self as api, ExitCode, SandboxProxy};
use nix::fcntl::OFlag;

use crate::{Failure, Result, unpack};

/// One side of a copy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A path on this machine.
    Local(PathBuf),
    /// `NAME:/path` inside a sandbox.
    Sandbox {
        /// Sandbox name.
        name: String,
        /// Absolute path inside it.
        path: String,
    },
}

impl Endpoint {
    /// `NAME:/abs/path` is a sandbox path; anything else is local (write
    /// `./a:b` for a local file with a colon).
    #[must_use]
    pub fn parse(s: &str) -> Self {
        if let Some((name, path)) = s.split_once(':') {
            let name_ok = !name.is_empty()
                && name
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if name_ok && path.starts_with('/') {
                return Self::Sandbox {
                    name: name.to_owned(),
                    path: path.to_owned(),
                };
            }
        }
        Self::Local(PathBuf::from(s))
    }
}

fn fail(code: ExitCode, msg: impl Into<String>) -> Failure {
    Failure::new(code, msg)
}

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(OFlag::O_CLOEXEC)
        .map_err(|e| fail(ExitCode::Failed, format!("cannot create a pipe: {e}")))
}

fn split(path: &str) -> (String, String) {
    let p = Path::new(path);
    let parent = p
        .parent()
        .map_or_else(|| "/".to_owned(), |d| d.display().to_string());
    let base = p
        .file_name()
        .map(|b| b.to_string_lossy().into_owned())
        .unwrap_or_default();
    (
        if parent.is_empty() {
            "/".to_owned()
        } else {
            parent
        },
        base,
    )
}

/// `base` in `dir`, as the history records a copy (agentd checks that the
/// record names the path the copy's `tar` touches).
fn joined(dir: &str, base: &str) -> String {
    format!("{}/{base}", dir.trim_end_matches('/'))
}

/// Run `argv` in the sandbox with the given stdin and stdout, recorded in
/// its history as `record` (`cp <description>`, or `cp-check` for the
/// check of the destination, which `agentctl history` leaves out); stderr
/// is collected for the error message.
async fn run(
    sb: &SandboxProxy<'_>,
    argv: &[&str],
    stdin: &OwnedFd,
    stdout: &OwnedFd,
    record: String,
) -> Result<(i32, String)> {
    let (err_r, err_w) = pipe()?;
    let collect = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = std::fs::File::from(err_r).read_to_string(&mut s);
        s
    });
    let opts = ExecOptions {
        record_as: Some(record),
        ..ExecOptions::default()
    };
    let code = sb
        .exec_stdio(
            argv,
            HashMap::new(),
            opts.to_dict(),
            stdin.as_fd().into(),
            stdout.as_fd().into(),
            err_w.as_fd().into(),
        )
        .await;
    drop(err_w);
    let err = collect.join().unwrap_or_default();
    Ok((code?, err.trim().to_owned()))
}

fn bar(total: Option<u64>) -> Option<indicatif::ProgressBar> {
    use std::io::IsTerminal;
    if !std::io::stderr().is_terminal() {
        return None;
    }
    let b = match total {
        Some(t) => indicatif::ProgressBar::new(t),
        None => indicatif::ProgressBar::new_spinner(),
    };
    b.set_style(
        indicatif::ProgressStyle::with_template(
            "{bytes:>10} {bar:30} {total_bytes} {bytes_per_sec}",
        )
        .expect("template")
        .progress_chars("=> "),
    );
    Some(b)
}

fn local_size(p: &Path) -> u64 {
    let Ok(m) = std::fs::symlink_metadata(p) else {
        return 0;
    };
    if m.is_dir() {
        std::fs::read_dir(p)
            .map(|d| d.flatten().map(|e| local_size(&e.path())).sum())
            .unwrap_or(0)
    } else {
        m.len()
    }
}

/// A writer that counts bytes for the progress bar.
struct Counting<W> {
    inner: W,
    bar: Option<indicatif::ProgressBar>,
}

impl<W: Write> Write for Counting<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        if let Some(b) = &self.bar {
            b.inc(n as u64);
        }
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Copy `local` into the sandbox at `dest` (into it when it is a directory).
pub async fn copy_in(sb: &SandboxProxy<'_>, name: &str, local: &Path, dest: &str) -> Result<()> {
    let meta = std::fs::symlink_metadata(local)
        .map_err(|e| fail(ExitCode::NotFound, format!("{}: {e}", local.display())))?;
    let devnull = OwnedFd::from(
        std::fs::File::open("/dev/null").map_err(|e| fail(ExitCode::Failed, e.to_string()))?,
    );
    let (out_r, out_w) = pipe()?;
    drop(out_r);
    let (is_dir, _) = run(
        sb,
        &["test", "-d", dest],
        &devnull,
        &out_w,
        "cp-check".to_owned(),
    )
    .await?;
    let (dir, entry) = if is_dir == 0 {
        (
            dest.to_owned(),
            local
                .file_name()
                .map(|b| b.to_string_lossy().into_owned())
                .unwrap_or_default(),
        )
    } else {
        split(dest)
    };
    if entry.is_empty() {
        return Err(fail(
            ExitCode::Requirements,
            format!("cannot copy {} to {dest}", local.display()),
        ));
    }
    let (in_r, in_w) = pipe()?;
    let bar = bar(Some(local_size(local)));
    let src = local.to_owned();
    let entry_name = entry.clone();
    let writer_bar = bar.clone();
    let producer = std::thread::spawn(move || -> std::io::Result<()> {
        let out = Counting {
            inner: std::fs::File::from(in_w),
            bar: writer_bar,
        };
        let mut b = tar::Builder::new(out);
        b.follow_symlinks(false);
        if meta.is_dir() {
            b.append_dir_all(&entry_name, &src)?;
        } else {
            b.append_path_with_name(&src, &entry_name)?;
        }
        b.into_inner()?.flush()
    });
    let record = format!("cp {} -> {name}:{}", local.display(), joined(&dir, &entry));
    let (code, err) = run(
        sb,
        &["tar", "-x", "-p", "--no-same-owner", "-C", &dir],
        &in_r,
        &out_w,
        record,
    )
    .await?;
    drop(in_r);
    let produced = producer
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("panicked")));
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    if code != 0 {
        return Err(fail(
            ExitCode::Failed,
            format!("copying into {name}:{dest} failed: {err}"),
        ));
    }
    produced.map_err(|e| {
        fail(
            ExitCode::Failed,
            format!("reading {}: {e}", local.display()),
        )
    })?;
    Ok(())
}

/// Copy `src` out of the sandbox to `local` (into it when it is a
/// directory). The archive the sandbox sends is filtered by
/// [`crate::unpack`] into a private temporary directory beside the
/// destination, and moved into place only when every entry was accepted.
pub async fn copy_out(
    sb: &SandboxProxy<'_>,
    name: &str,
    src: &str,
    local: &Path,
    opts: unpack::Options,
) -> Result<()> {
    let (dir, base) = split(src);
    if base.is_empty() || base == "." || base == ".." {
        return Err(fail(
            ExitCode::Requirements,
            format!("cannot copy {name}:{src}: name a file or directory"),
        ));
    }
    let existing = std::fs::symlink_metadata(local).ok();
    if existing
        .as_ref()
        .is_some_and(|m| m.file_type().is_symlink())
    {
        return Err(fail(
            ExitCode::Requirements,
            format!(
                "{} is a symbolic link, which a copy never follows or replaces; name its target",
                local.display()
            ),
        ));
    }
    let (parent, dest) = if existing.as_ref().is_some_and(std::fs::Metadata::is_dir) {
        (local.to_owned(), local.join(&base))
    } else {
        let parent = local
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        (parent.to_owned(), local.to_owned())
    };
    let tmp = tempdir_in(&parent)?;
    let devnull = OwnedFd::from(
        std::fs::File::open("/dev/null").map_err(|e| fail(ExitCode::Failed, e.to_string()))?,
    );
    let (out_r, out_w) = pipe()?;
    let bar = bar(None);
    let consumer_bar = bar.clone();
    let target = tmp.clone();
    let wanted = base.clone();
    let consumer = std::thread::spawn(move || {
        let reader = std::fs::File::from(out_r);
        let reader: Box<dyn Read> = match &consumer_bar {
            Some(b) => Box::new(b.wrap_read(reader)),
            None => Box::new(reader),
        };
        // On a refusal the pipe closes early and the sandbox's tar fails
        // writing: the refusal is what gets reported.
        unpack::unpack(reader, &target, &wanted, opts)
    });
    let record = format!("cp {name}:{} -> {}", joined(&dir, &base), local.display());
    let ran = run(
        sb,
        &["tar", "-c", "-C", &dir, "--", &base],
        &devnull,
        &out_w,
        record,
    )
    .await;
    drop(out_w);
    let unpacked = consumer.join().unwrap_or_else(|_| {
        Err(unpack::UnpackError::Io {
            what: "unpacking".to_owned(),
            source: std::io::Error::other("panicked"),
        })
    });
    if let Some(b) = bar {
        b.finish_and_clear();
    }
    let placed = (move || {
        let (code, err) = ran?;
        if let Err(e @ unpack::UnpackError::Refused { .. }) = &unpacked {
            return Err(fail(
                ExitCode::Failed,
                format!("copying {name}:{src}: {e}; nothing was copied"),
            ));
        }
        if code != 0 {
            return Err(fail(
                ExitCode::Failed,
                format!(
                    "copying {name}:{src} failed: {}",
                    crate::output::escape_controls(&err)
                ),
            ));
        }
        let tree = unpacked.map_err(|e| {
            fail(
                ExitCode::Failed,
                format!("copying {name}:{src}: {e}; nothing was copied"),
            )
        })?;
        unpack::place(&tree, &dest).map_err(|e| {
            fail(
                ExitCode::Failed,
                format!("copying {name}:{src}: {e}; nothing was copied"),
            )
        })
    })();
    let _ = std::fs::remove_dir_all(&tmp);
    placed
}

fn tempdir_in(parent: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::DirBuilderExt;
    for n in 0..1000 {
        let p = parent.join(format!(".agentctl-cp-{}-{n}", std::process::id()));
        if std::fs::DirBuilder::new().mode(0o700).create(&p).is_ok() {
            return Ok(p);
        }
    }
    Err(fail(
        ExitCode::Failed,
        format!(
            "cannot create a temporary directory in {}",
            parent.display()
        ),
    ))
}

/// `agentctl cp SRC DEST`.
pub async fn run_cp(
    conn: &zbus::Connection,
    manager: &api::ManagerProxy<'_>,
    src: &str,
    dest: &str,
    opts: unpack::Options,
) -> Result<i32> {
    let lookup = |name: String| async move { super::lookup(conn, manager, &name).await };
    match (Endpoint::parse(src), Endpoint::parse(dest)) {
        (Endpoint::Local(l), Endpoint::Sandbox { name, path }) => {
            let sb = lookup(name.clone()).await?;
            copy_in(&sb, &name, &l, &path).await?;
        }
        (Endpoint::Sandbox { name, path }, Endpoint::Local(l)) => {
            let sb = lookup(name.clone()).await?;
            copy_out(&sb, &name, &path, &l, opts).await?;
        }
        _ => {
            return Err(fail(
                ExitCode::Requirements,
                "exactly one side must be NAME:/absolute/path inside a sandbox (e.g. `agentctl cp ./src myproject:/workspace/src`)",
            ));
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(
            Endpoint::parse("proj:/workspace/a"),
            Endpoint::Sandbox {
                name: "proj".into(),
                path: "/workspace/a".into()
            }
        );
        assert_eq!(
            Endpoint::parse("./proj:/x"),
            Endpoint::Local("./proj:/x".into())
        );
        assert_eq!(
            Endpoint::parse("proj:rel"),
            Endpoint::Local("proj:rel".into())
        );
        assert_eq!(
            Endpoint::parse("/abs/path"),
            Endpoint::Local("/abs/path".into())
        );
        assert_eq!(split("/workspace/a/b"), ("/workspace/a".into(), "b".into()));
        assert_eq!(split("/a"), ("/".into(), "a".into()));
    }
}
