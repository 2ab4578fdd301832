//! Fetching a package: the registry's metadata and the tarball with curl,
//! counted and bounded by agentd, and the tarball's sha512 against the
//! registry's integrity.

use std::fs;
use std::io::Read;
use std::path::Path;
use std::process::{Command, Stdio};

use super::{InstallError, file_err};

/// Fetch `url` into `to` with curl: HTTPS (or loopback HTTP) only, no
/// redirect, at most `max` bytes. The bytes come through
/// agentd, which counts them: curl's `--max-filesize` only checks a length
/// the server announces (before curl 8.4), and a chunked answer has none.
pub(super) fn curl(url: &str, to: &Path, max: u64) -> Result<(), InstallError> {
    let fail = |why: String| InstallError::Download {
        what: url.to_owned(),
        why,
    };
    let mut child = crate::child::end_with_us(&mut Command::new("curl"))
        .args([
            "--silent",
            "--show-error",
            "--fail",
            // A URL is fetched as it is: `[1-1000]` or `{a,b}` in a path
            // would otherwise be one request per expansion.
            "--globoff",
            // No redirect is followed: everything comes from the registry's
            // own host (a redirect is curl's error 47, reported below).
            "--location",
            "--max-redirs",
            "0",
            "--proto",
            "=https,http",
            "--connect-timeout",
            "30",
            "--max-time",
            "1800",
            "--max-filesize",
        ])
        .arg(max.to_string())
        .args(["--output", "-", "--", url])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| fail(format!("cannot run curl ({e}); install curl")))?;
    let copied = copy_at_most(child.stdout.take().expect("piped"), to, max);
    if copied.is_err() {
        let _ = child.kill();
    }
    let done = child
        .wait_with_output()
        .map_err(|e| fail(format!("curl: {e}")))?;
    match copied {
        Err(CopyError::TooLarge) => {
            Err(fail(format!("the answer is larger than {} MiB", max >> 20)))
        }
        Err(CopyError::Write(e)) => Err(file_err("write", to)(e)),
        Err(CopyError::Read(e)) => Err(fail(format!("cannot read curl's output: {e}"))),
        Ok(()) if done.status.success() => Ok(()),
        Ok(()) if done.status.code() == Some(47) => Err(fail(
            "the registry answered with a redirect, which agentd does not follow: \
             toolbox.registry must serve the metadata and the tarballs itself"
                .to_owned(),
        )),
        Ok(()) => Err(fail(
            String::from_utf8_lossy(&done.stderr).trim().to_owned(),
        )),
    }
}

pub(super) enum CopyError {
    TooLarge,
    Read(std::io::Error),
    Write(std::io::Error),
}

/// Copy `from` into a new file `to`, refusing more than `max` bytes.
pub(super) fn copy_at_most(mut from: impl Read, to: &Path, max: u64) -> Result<(), CopyError> {
    use std::io::Write;
    let mut file = fs::File::create(to).map_err(CopyError::Write)?;
    let mut buf = vec![0u8; 1 << 16];
    let mut total: u64 = 0;
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(CopyError::Read(e)),
        };
        total += n as u64;
        if total > max {
            return Err(CopyError::TooLarge);
        }
        file.write_all(&buf[..n]).map_err(CopyError::Write)?;
    }
}

/// The tarball URL and sha512 (base64) that the metadata of `id` names.
pub(super) fn read_metadata(
    path: &Path,
    id: &str,
    registry: &str,
) -> Result<(String, String), InstallError> {
    let bad = |why: String| InstallError::Metadata {
        package: id.to_owned(),
        why,
    };
    let text = fs::read(path).map_err(file_err("read", path))?;
    let v: serde_json::Value =
        serde_json::from_slice(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
    let dist = &v["dist"];
    let tarball = dist["tarball"]
        .as_str()
        .ok_or_else(|| bad("no dist.tarball".into()))?;
    // The tarball comes from the registry itself, over the same scheme.
    let scheme_host =
        |u: &str| -> String { u.splitn(4, '/').take(3).collect::<Vec<_>>().join("/") };
    if scheme_host(tarball) != scheme_host(registry) {
        return Err(bad(format!("dist.tarball {tarball} is not on {registry}")));
    }
    let integrity = dist["integrity"]
        .as_str()
        .ok_or_else(|| bad("no dist.integrity".into()))?;
    let want = integrity
        .split_whitespace()
        .find_map(|h| h.strip_prefix("sha512-"))
        .ok_or_else(|| bad(format!("dist.integrity '{integrity}' has no sha512")))?;
    Ok((tarball.to_owned(), want.to_owned()))
}

pub(super) fn sha512_base64(path: &Path) -> Result<String, InstallError> {
    use base64::Engine;
    use sha2::Digest;
    let mut f = fs::File::open(path).map_err(file_err("read", path))?;
    let mut h = sha2::Sha512::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let n = f.read(&mut buf).map_err(file_err("read", path))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(base64::engine::general_purpose::STANDARD.encode(h.finalize()))
}
