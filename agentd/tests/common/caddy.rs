//! A real Caddy for tests, on loopback ports of its own, and a plain
//! HTTP/1.1 client that sends any Host header.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::wait_for;

/// A free loopback port (bound and released).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub struct Caddy {
    dir: PathBuf,
    pub admin: u16,
    /// The admin API's unix socket, when it listens on one instead of
    /// `admin`.
    pub admin_socket: Option<PathBuf>,
    pub http: u16,
    child: Option<Child>,
}

impl Caddy {
    /// Start Caddy with nothing but its admin API configured.
    pub fn start(dir: &Path) -> Self {
        let dir = dir.join("caddy");
        std::fs::create_dir_all(&dir).unwrap();
        let mut c = Self {
            dir,
            admin: free_port(),
            admin_socket: None,
            http: free_port(),
            child: None,
        };
        c.restart();
        c
    }

    /// Start Caddy with its admin API on a unix socket in a directory only
    /// its owner may enter.
    pub fn start_unix(dir: &Path) -> Self {
        let dir = dir.join("caddy");
        let private = dir.join("admin");
        std::fs::create_dir_all(&private).unwrap();
        std::fs::set_permissions(
            &private,
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .unwrap();
        let mut c = Self {
            dir,
            admin: 0,
            admin_socket: Some(private.join("admin.sock")),
            http: free_port(),
            child: None,
        };
        c.restart();
        c
    }

    /// The admin address as agentd's `proxy.caddy_admin` names it.
    pub fn admin_address(&self) -> String {
        match &self.admin_socket {
            Some(s) => format!("unix/{}", s.display()),
            None => format!("http://127.0.0.1:{}", self.admin),
        }
    }

    /// (Re)start the Caddy process with its initial configuration, as a
    /// restart or a reload of a Caddyfile would: API routes are gone.
    pub fn restart(&mut self) {
        self.stop();
        let config = self.dir.join("caddy.json");
        std::fs::write(
            &config,
            // No root certificate in the machine's trust store.
            format!(
                r#"{{"admin":{{"listen":"{}"}},"apps":{{"pki":{{"certificate_authorities":{{"local":{{"install_trust":false}}}}}}}}}}"#,
                match &self.admin_socket {
                    Some(s) => format!("unix/{}", s.display()),
                    None => format!("127.0.0.1:{}", self.admin),
                }
            ),
        )
        .unwrap();
        let log = std::fs::File::create(self.dir.join("caddy.log")).unwrap();
        let child = Command::new("caddy")
            .args(["run", "--config"])
            .arg(&config)
            .env("HOME", &self.dir)
            .env("XDG_DATA_HOME", self.dir.join("data"))
            .env("XDG_CONFIG_HOME", self.dir.join("config"))
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("caddy must be installed (apt-get install caddy)");
        self.child = Some(child);
        let admin = self.admin;
        let socket = self.admin_socket.clone();
        wait_for(
            "Caddy's admin API",
            Duration::from_secs(20),
            || match &socket {
                Some(s) => std::os::unix::net::UnixStream::connect(s).is_ok(),
                None => TcpStream::connect(("127.0.0.1", admin)).is_ok(),
            },
        );
    }

    /// Stop Caddy (`restart` starts it again).
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The `proxy` section of agentd's configuration for this Caddy.
    /// agentd's config for this Caddy, with links that answer anyone (the
    /// routing tests); see [`Caddy::agentd_config_auth`].
    pub fn agentd_config(&self, https: bool) -> String {
        self.agentd_config_auth(https, "none")
    }

    /// agentd's config for this Caddy with `proxy.auth` set to `auth`.
    pub fn agentd_config_auth(&self, https: bool, auth: &str) -> String {
        format!(
            r#"{{"proxy":{{"enable":true,"domain":"sandbox.local","caddy_admin":"{}","listen":["127.0.0.1:{}"],"https":{https},"ca_file":"{}","auth":"{auth}"}}}}"#,
            self.admin_address(),
            self.http,
            self.root_cert().display()
        )
    }

    /// Where this Caddy keeps its internal CA's root certificate.
    pub fn root_cert(&self) -> PathBuf {
        self.dir.join("data/caddy/pki/authorities/local/root.crt")
    }

    /// The value at `path` of Caddy's configuration (Null when it cannot be
    /// read).
    pub fn config(&self, path: &str) -> serde_json::Value {
        let (status, body) = match &self.admin_socket {
            Some(s) => {
                let Ok(stream) = std::os::unix::net::UnixStream::connect(s) else {
                    return serde_json::Value::Null;
                };
                stream
                    .set_read_timeout(Some(Duration::from_secs(10)))
                    .unwrap();
                // Over its socket, Caddy's admin API takes only an empty Host.
                let (status, _, body) = exchange(stream, "", "GET", path, "", "");
                (status, body)
            }
            None => {
                // As agentd does: Caddy may check the Origin (agentd turns
                // that on), and the admin address itself is allowed.
                let host = format!("127.0.0.1:{}", self.admin);
                let (status, _, body) = request(
                    self.admin,
                    &host,
                    "GET",
                    path,
                    &format!("Origin: http://{host}\r\n"),
                );
                (status, body)
            }
        };
        if status != 200 {
            return serde_json::Value::Null;
        }
        serde_json::from_str(&body).unwrap_or_default()
    }

    /// `@id`s of the routes of agentd's server.
    pub fn route_ids(&self) -> Vec<String> {
        self.config("/config/apps/http/servers/keystone-agent/routes")
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|r| r["@id"].as_str().map(str::to_owned))
            .collect()
    }

    /// GET `path` from the proxy with `Host: host`.
    pub fn get(&self, host: &str, path: &str) -> (u16, String) {
        http(self.http, host, "GET", path)
    }

    /// GET `path` with `Host: host` and a `Cookie` header (when not empty);
    /// (status, the response's head, body).
    pub fn get_with_cookie(&self, host: &str, path: &str, cookie: &str) -> (u16, String, String) {
        let cookie = if cookie.is_empty() {
            String::new()
        } else {
            format!("Cookie: {cookie}\r\n")
        };
        request(self.http, host, "GET", path, &cookie)
    }
}

impl Drop for Caddy {
    fn drop(&mut self) {
        self.stop();
    }
}

/// One HTTP/1.1 request to 127.0.0.1:`port`; (status, body). Status 0 when
/// the connection failed.
pub fn http(port: u16, host: &str, method: &str, path: &str) -> (u16, String) {
    let (status, _, body) = request(port, host, method, path, "");
    (status, body)
}

/// One HTTP/1.1 request with `headers` (each line ending in CRLF) added;
/// (status, the response's head, body). Status 0 when the connection failed.
pub fn request(
    port: u16,
    host: &str,
    method: &str,
    path: &str,
    headers: &str,
) -> (u16, String, String) {
    send(port, host, method, path, headers, "")
}

/// One HTTP/1.1 request with `headers` and `body` (its Content-Length
/// added); (status, the response's head, body). Status 0 when the
/// connection failed.
pub fn send(
    port: u16,
    host: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> (u16, String, String) {
    let Ok(s) = TcpStream::connect(("127.0.0.1", port)) else {
        return (0, String::new(), String::new());
    };
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let headers = if body.is_empty() {
        headers.to_owned()
    } else {
        format!("{headers}Content-Length: {}\r\n", body.len())
    };
    exchange(s, host, method, path, &headers, body)
}

/// Send one request over `s` and read the answer to its end.
fn exchange(
    mut s: impl Read + Write,
    host: &str,
    method: &str,
    path: &str,
    headers: &str,
    body: &str,
) -> (u16, String, String) {
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\n{headers}Connection: close\r\n\r\n{body}"
    );
    if s.write_all(req.as_bytes()).is_err() {
        return (0, String::new(), String::new());
    }
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw);
    let text = String::from_utf8_lossy(&raw).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    let (head, b) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(b)
    } else {
        b.to_owned()
    };
    (status, head.to_owned(), body)
}

fn dechunk(mut b: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = b.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        b = rest[n..].trim_start_matches("\r\n");
    }
    out
}
