//! Certificates for tests of HTTPS: a CA and a server certificate it
//! signed, made by openssl.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

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

/// An HTTPS origin on the host: a Python script run as `python3 SCRIPT
/// CERT KEY LOG` that prints its port and appends one JSON line per request
/// to LOG.
pub struct Origin {
    pub port: u16,
    log: PathBuf,
    server: Child,
}

impl Origin {
    /// Run `script` (its text) in `dir` with the certificate of `tls`.
    pub fn start(dir: &Path, name: &str, script: &str, tls: &Tls) -> Self {
        let path = dir.join(name);
        std::fs::write(&path, script).unwrap();
        let log = dir.join(format!("{name}.log"));
        let mut server = Command::new("python3")
            .arg(&path)
            .arg(&tls.cert)
            .arg(&tls.key)
            .arg(&log)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let port = read_port(&mut server).expect("the origin prints its port");
        Self { port, log, server }
    }

    /// agentd trusting `certs`' CA for the hosts it checks, with
    /// `hosts` resolving to 127.0.0.1, started on `env` (its `agentd_env`
    /// kept); this origin (`name`, `script`) serving them; and sandbox
    /// `sec` running, allowed to reach the origin's port, with the test CA
    /// at /tmp/test-ca.pem.
    pub fn for_secrets(
        env: &mut super::Env,
        certs: &Tls,
        hosts: &[&str],
        (name, script): (&str, &str),
    ) -> Self {
        env.agentd_env
            .push(("SSL_CERT_FILE".into(), Some(certs.ca.display().to_string())));
        let names: serde_json::Map<String, serde_json::Value> = hosts
            .iter()
            .map(|h| ((*h).to_owned(), serde_json::json!("127.0.0.1")))
            .collect();
        let config = env.tmp.path().join("agentd.json");
        std::fs::write(
            &config,
            serde_json::json!({"egress": {"hosts": names}}).to_string(),
        )
        .unwrap();
        env.config = Some(config);
        env.start_agentd();
        let origin = Self::start(env.tmp.path(), name, script, certs);
        env.create_running("sec", &[]);
        env.ok(&[
            "egress",
            "sec",
            "allow",
            &format!("127.0.0.1/32:{}", origin.port),
        ]);
        env.ok(&["cp", certs.ca.to_str().unwrap(), "sec:/tmp/test-ca.pem"]);
        origin
    }

    /// What it recorded of each request.
    pub fn requests(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }
}

impl Drop for Origin {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// The port a test server prints on its first line of output.
pub fn read_port(server: &mut Child) -> Option<u16> {
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(server.stdout.take()?),
        &mut line,
    )
    .ok()?;
    line.trim().parse().ok()
}
