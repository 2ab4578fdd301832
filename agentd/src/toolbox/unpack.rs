//! Unpacking a package safely: its size and members checked before
//! anything is written, what tar made normalized (no link, device or odd
//! mode survives), and unfinished installs removed without following links.

use std::fs;
use std::io::Read;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Stdio};

use super::{InstallError, file_err};

/// Why a package's tarball is refused before anything is unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// gzip or tar could not be run.
    #[error("cannot run {tool}: {source}")]
    Spawn {
        /// `gzip` or `tar`.
        tool: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Its output could not be read.
    #[error("cannot read {what}: {source}")]
    Read {
        /// Whose output.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// It could not be waited for.
    #[error("{tool}: {source}")]
    Wait {
        /// `gzip` or `tar`.
        tool: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The tar stream is larger than allowed.
    #[error("it unpacks to more than {} MiB", .max >> 20)]
    TooLarge {
        /// The limit (bytes).
        max: u64,
    },
    /// It has more members than allowed.
    #[error("it has more than {max} entries")]
    TooManyEntries {
        /// The limit.
        max: u64,
    },
    /// A member's path is longer than allowed.
    #[error("it has a path longer than {max} bytes")]
    NameTooLong {
        /// The limit (bytes).
        max: usize,
    },
    /// A member's path is deeper than allowed.
    #[error("it has a path deeper than {max} directories")]
    TooDeep {
        /// The limit (components).
        max: usize,
    },
    /// gzip refused it.
    #[error("not a gzip file: {stderr}")]
    NotGzip {
        /// gzip's message.
        stderr: String,
    },
    /// tar could not unpack it.
    #[error("{stderr}")]
    Extract {
        /// tar's message.
        stderr: String,
    },
    /// tar refused it.
    #[error("not a tarball: {stderr}")]
    NotTar {
        /// tar's message.
        stderr: String,
    },
}

fn stderr_of(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stderr).trim().to_owned()
}

/// `tool ARGS tgz` started with its output to read (and its stderr kept).
fn read_from(
    tool: &'static str,
    args: &[&str],
    tgz: &Path,
) -> Result<(std::process::Child, std::process::ChildStdout), UnpackError> {
    let mut child = crate::child::end_with_us(&mut Command::new(tool))
        .args(args)
        .arg(tgz)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| UnpackError::Spawn { tool, source })?;
    let out = child.stdout.take().expect("piped");
    Ok((child, out))
}

/// The size of the tar stream in gzip file `tgz` (`gzip -dc`, counted as
/// it comes), or why it is refused: more than `max` bytes, or not gzip.
pub(super) fn unpacked_size(tgz: &Path, max: u64) -> Result<u64, UnpackError> {
    let (mut child, mut out) = read_from("gzip", &["-dc"], tgz)?;
    let mut buf = vec![0u8; 1 << 16];
    let mut total: u64 = 0;
    loop {
        let n = match out.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(UnpackError::Read {
                    what: "gzip's output",
                    source: e,
                });
            }
        };
        total += n as u64;
        if total > max {
            let _ = child.kill();
            let _ = child.wait();
            return Err(UnpackError::TooLarge { max });
        }
    }
    let done = child
        .wait_with_output()
        .map_err(|source| UnpackError::Wait {
            tool: "gzip",
            source,
        })?;
    if done.status.success() {
        Ok(total)
    } else {
        Err(UnpackError::NotGzip {
            stderr: stderr_of(&done),
        })
    }
}

/// The number of members of gzipped tarball `tgz` as `tar` lists them, or
/// why it is refused: more than `max_entries`, a path of more than
/// `max_depth` components or `max_name` bytes, or not a tarball.
pub(super) fn check_members(
    tgz: &Path,
    max_entries: u64,
    max_depth: usize,
    max_name: usize,
) -> Result<u64, UnpackError> {
    // One line per member: a newline in a name is written `\n`.
    let (mut child, mut out) = read_from("tar", &["--quoting-style=escape", "-tzf"], tgz)?;
    let mut buf = vec![0u8; 1 << 16];
    let (mut entries, mut len, mut depth, mut at_start) = (0u64, 0usize, 0usize, true);
    let refused = 'read: loop {
        let n = match out.read(&mut buf) {
            Ok(0) => break None,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(source) => {
                break Some(UnpackError::Read {
                    what: "tar's listing",
                    source,
                });
            }
        };
        for &b in &buf[..n] {
            if b == b'\n' {
                entries += 1;
                if entries > max_entries {
                    break 'read Some(UnpackError::TooManyEntries { max: max_entries });
                }
                (len, depth, at_start) = (0, 0, true);
                continue;
            }
            len += 1;
            if b == b'/' {
                at_start = true;
            } else if at_start {
                depth += 1;
                at_start = false;
            }
            if len > max_name {
                break 'read Some(UnpackError::NameTooLong { max: max_name });
            }
            if depth > max_depth {
                break 'read Some(UnpackError::TooDeep { max: max_depth });
            }
        }
    };
    drop(out);
    if refused.is_some() {
        let _ = child.kill();
    }
    let done = child
        .wait_with_output()
        .map_err(|source| UnpackError::Wait {
            tool: "tar",
            source,
        })?;
    match refused {
        Some(why) => Err(why),
        None if done.status.success() => Ok(entries),
        None => Err(UnpackError::NotTar {
            stderr: stderr_of(&done),
        }),
    }
}

/// Remove `path` and everything under it, not following links; directories
/// are made accessible first (a package may hold one of mode 000, which an
/// unprivileged agentd could not enter). Holds no descriptor per level.
pub(super) fn remove_tree(path: &Path) -> std::io::Result<()> {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return fs::remove_file(path);
    }
    if meta.permissions().mode() & 0o700 != 0o700 {
        fs::set_permissions(path, fs::Permissions::from_mode(0o700))?;
    }
    let children = fs::read_dir(path)?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<_>>>()?;
    let mut first_error = None;
    for child in children {
        if let Err(e) = remove_tree(&child) {
            first_error.get_or_insert(e);
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => fs::remove_dir(path),
    }
}

/// Make an unpacked package safe to show to every sandbox: directories
/// 0755, files 0755 or 0644 (by their execute bit), and nothing else (no
/// symlink, device or fifo stays).
pub(super) fn normalize(dir: &Path) -> Result<(), InstallError> {
    // Read before descending: no descriptor stays open per level.
    let children = fs::read_dir(dir)
        .and_then(|rd| {
            rd.map(|e| e.map(|e| e.path()))
                .collect::<Result<Vec<_>, _>>()
        })
        .map_err(file_err("read", dir))?;
    for path in children {
        let meta = fs::symlink_metadata(&path).map_err(file_err("read", &path))?;
        let ft = meta.file_type();
        if ft.is_dir() {
            fs::set_permissions(&path, fs::Permissions::from_mode(0o755))
                .map_err(file_err("set the mode of", &path))?;
            normalize(&path)?;
        } else if ft.is_file() {
            let mode = if meta.permissions().mode() & 0o111 != 0 {
                0o755
            } else {
                0o644
            };
            fs::set_permissions(&path, fs::Permissions::from_mode(mode))
                .map_err(file_err("set the mode of", &path))?;
        } else {
            fs::remove_file(&path).map_err(file_err("remove", &path))?;
        }
    }
    fs::set_permissions(dir, fs::Permissions::from_mode(0o755))
        .map_err(file_err("set the mode of", dir))
}
