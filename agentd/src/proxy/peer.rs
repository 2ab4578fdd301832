//! Who is at the other end of a loopback socket, from `/proc/net/tcp` (the
//! kernel's `uid` column). Caddy's uid: the only one whose connections
//! agentd's dev-server forwarders join to a sandbox (Caddy's routes carry
//! the links' token check, a bare connection would skip it); Caddy is
//! known by the owner of its admin socket, or of the socket listening on
//! its admin port. The web console's callers: each connection is the
//! uid of the process that made it.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::fs::{FileTypeExt, MetadataExt};

/// `ADDR:PORT` as `/proc/net/tcp` prints an IPv4 address: the address's
/// bytes as a native-endian word, the port as a number, both in hex.
fn proc_form(a: SocketAddrV4) -> String {
    format!(
        "{:08X}:{:04X}",
        u32::from_ne_bytes(a.ip().octets()),
        a.port()
    )
}

/// The uid of the first line of `/proc/net/tcp` (`table`) that `pick`
/// accepts, given its local address, remote address and state.
fn find_uid(table: &str, pick: impl Fn(&str, &str, &str) -> bool) -> Option<u32> {
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // sl local rem st tx:rx tr:when retrnsmt uid …
        let (local, remote, state, uid) = (f.get(1)?, f.get(2)?, f.get(3)?, f.get(7)?);
        pick(local, remote, state)
            .then(|| uid.parse().ok())
            .flatten()
    })
}

fn table() -> String {
    crate::procfs::read_table("/proc/net/tcp").unwrap_or_default()
}

/// The uid owning the socket that listens on `addr` (or on every address
/// at its port).
fn listener_uid(addr: SocketAddrV4) -> Option<u32> {
    let exact = proc_form(addr);
    let any = proc_form(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, addr.port()));
    // State 0A: LISTEN.
    find_uid(&table(), |a, _, st| st == "0A" && (a == exact || a == any))
}

/// The uid owning the socket at `peer` connected to `local` (the other
/// end of a loopback connection agentd accepted at `local`).
#[must_use]
pub fn connection_uid(peer: SocketAddrV4, local: SocketAddrV4) -> Option<u32> {
    let (p, l) = (proc_form(peer), proc_form(local));
    // State 01: ESTABLISHED.
    find_uid(&table(), |a, b, st| st == "01" && a == p && b == l)
}

/// Caddy's uid, from its admin address (`proxy.caddy_admin`): the owner of
/// its admin socket, or of the socket listening on its admin port. None
/// when neither can be found.
#[must_use]
pub fn caddy_uid(admin: &str) -> Option<u32> {
    if let Some(socket) = crate::config::caddy_admin_socket(admin) {
        let meta = std::fs::symlink_metadata(socket).ok()?;
        return meta.file_type().is_socket().then(|| meta.uid());
    }
    let host_port = admin.strip_prefix("http://")?.trim_end_matches('/');
    let host_port = host_port.replacen("localhost:", "127.0.0.1:", 1);
    match host_port.parse::<SocketAddr>().ok()? {
        SocketAddr::V4(a) => listener_uid(a),
        SocketAddr::V6(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:07E3 00000000:0000 0A 00000000:00000000 00:00000000 00000000   997        0 1 1 0 100 0 0 10 0
   1: 0100007F:A1B2 0100007F:8AE4 01 00000000:00000000 00:00000000 00000000 65534        0 2 1 0 20 4 30 10 -1
   2: 0100007F:8AE4 0100007F:A1B2 01 00000000:00000000 00:00000000 00000000     0        0 3 1 0 20 4 30 10 -1
";

    #[test]
    fn addresses_are_in_the_kernels_form() {
        let a: SocketAddrV4 = "127.0.0.1:2019".parse().unwrap();
        if cfg!(target_endian = "little") {
            assert_eq!(proc_form(a), "0100007F:07E3");
        }
    }

    #[test]
    fn each_socket_has_its_owners_uid() {
        let uid = |l: &str, r: &str| find_uid(TABLE, |a, b, _| a == l && b == r);
        // The connecting side and the accepting side of one connection.
        assert_eq!(uid("0100007F:A1B2", "0100007F:8AE4"), Some(65534));
        assert_eq!(uid("0100007F:8AE4", "0100007F:A1B2"), Some(0));
        assert_eq!(uid("0100007F:0001", "0100007F:8AE4"), None);
        assert_eq!(
            find_uid(TABLE, |a, _, st| st == "0A" && a == "0100007F:07E3"),
            Some(997)
        );
    }

    #[test]
    fn a_connection_shows_the_connecting_process_uid() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (_server, peer) = listener.accept().unwrap();
        let me = nix::unistd::Uid::effective().as_raw();
        let (SocketAddr::V4(peer), SocketAddr::V4(local)) = (peer, listener.local_addr().unwrap())
        else {
            unreachable!()
        };
        assert_eq!(connection_uid(peer, local), Some(me));
        drop(client);
    }

    #[test]
    fn a_live_listener_shows_this_process_uid() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let me = nix::unistd::Uid::effective().as_raw();
        let SocketAddr::V4(l) = listener.local_addr().unwrap() else {
            unreachable!()
        };
        assert_eq!(listener_uid(l), Some(me));
    }
}
