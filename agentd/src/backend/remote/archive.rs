//! Files of agentd's copied into a sandbox whose file system is its own
//! (a Pod's volumes, a guest's disk): a tar archive written by a thread of
//! agentd's (the files are agentd's own) into the stdin of `tar` inside.

use super::{RemoteError, Shell, feed};

/// Something copied in.
#[derive(Debug)]
pub enum Part {
    /// The entries of agentd's tools directory, but for its `ca/` (the
    /// CA files of every local sandbox, named by their ids) and `agents`.
    Entries(std::path::PathBuf),
    /// A file at a path inside.
    File(std::path::PathBuf, String),
    /// A directory at a path inside.
    Dir(std::path::PathBuf, String),
}

/// Run `argv` inside with a tar archive of `parts` on its stdin
/// ([`archive`]), written by a thread of agentd's; `what` names them in
/// errors.
///
/// # Errors
/// The command inside, or a file of agentd's that cannot be read.
pub async fn send(
    shell: &dyn Shell,
    argv: &[&str],
    parts: Vec<Part>,
    what: &str,
) -> Result<(), RemoteError> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(std::io::Error::from)?;
    // A thread of its own, not the blocking pool, where it could wait
    // behind a task that waits for it.
    let (done, writing) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name("archive".to_owned())
        .spawn(move || {
            let _ = done.send(archive(std::fs::File::from(w), &parts));
        })?;
    let mut input = tokio::net::unix::pipe::Receiver::from_owned_fd(r)?;
    let fed = feed(shell, argv, &mut input, what).await;
    drop(input);
    let written = writing
        .await
        .unwrap_or_else(|_| Err(std::io::Error::other("the archive's writer ended")));
    fed?;
    Ok(written?)
}

/// Write a tar archive of `parts` to `out`. Never of a directory itself
/// at the top: "." would be the volume's root in the Pod, whose mode and
/// time the Pod's uid may not set, an emptyDir being root's.
fn archive(out: std::fs::File, parts: &[Part]) -> std::io::Result<()> {
    let mut b = tar::Builder::new(out);
    b.follow_symlinks(false);
    for part in parts {
        match part {
            Part::Entries(dir) => {
                for entry in std::fs::read_dir(dir)? {
                    let entry = entry?;
                    // (The toolbox has its own copy, onto the claim.)
                    let name = entry.file_name();
                    if name == crate::backend::CA_DIR || name == "agents" {
                        continue;
                    }
                    if entry.file_type()?.is_dir() {
                        b.append_dir_all(entry.file_name(), entry.path())?;
                    } else {
                        b.append_path_with_name(entry.path(), entry.file_name())?;
                    }
                }
            }
            Part::File(path, name) => b.append_path_with_name(path, name)?,
            Part::Dir(path, name) => b.append_dir_all(name, path)?,
        }
    }
    b.finish()
}
