//! Certificates for tests of HTTPS: a CA and a server certificate it
//! signed, made by openssl.

use std::path::{Path, PathBuf};
use std::process::Command;

/// A certificate authority, and a server certificate it signed for
/// `names` and 127.0.0.1, made by openssl in `dir`.
pub struct Tls {
    pub ca: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Make them in `dir`.
pub fn tls(dir: &Path, names: &[&str]) -> Tls {
    let san: Vec<String> = names.iter().map(|n| format!("DNS:{n}")).collect();
    let script = format!(
        "set -e
        key='-newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes'
        openssl req -x509 $key -days 2 -subj '/CN=Keystone test CA' -keyout ca.key -out ca.pem
        openssl req $key -subj /CN=site -keyout site.key -out site.csr
        printf '%s\\n' subjectAltName={},IP:127.0.0.1 basicConstraints=CA:FALSE \
            extendedKeyUsage=serverAuth > site.ext
        openssl x509 -req -days 2 -in site.csr -CA ca.pem -CAkey ca.key -CAcreateserial \
            -extfile site.ext -out site.pem",
        san.join(",")
    );
    let out = Command::new("sh")
        .args(["-c", &script])
        .current_dir(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openssl (apt-get install openssl): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Tls {
        ca: dir.join("ca.pem"),
        cert: dir.join("site.pem"),
        key: dir.join("site.key"),
    }
}
