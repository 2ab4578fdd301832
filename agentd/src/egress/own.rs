//! This host's own addresses, which the gateway refuses to connect a
//! sandbox to (they reach the host's services).
//!
//! Reading them is a netlink dump of every link and address of the host
//! (`getifaddrs`): it cost a new tunnel about 6% of agentd's CPU on a host
//! with five addresses, and more with every interface the host has. The
//! list is kept, and read again when the kernel says an address came or
//! went: a netlink socket joined to the address groups, opened before the
//! first read, is drained before each use. Where that cannot be known (no
//! such socket, a missed message, any error) the list is read every time,
//! as before.

use std::net::IpAddr;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::{Mutex, OnceLock};

use nix::sys::socket::{
    AddressFamily, MsgFlags, NetlinkAddr, SockFlag, SockProtocol, SockType, bind, recv, socket,
};

/// The addresses of this host now.
pub fn host_addresses() -> Vec<IpAddr> {
    static OWN: OnceLock<Own> = OnceLock::new();
    OWN.get_or_init(Own::new).get()
}

/// The kept list and what says when it is stale.
#[derive(Debug)]
struct Own {
    /// Address changes, as the kernel announces them (`None`: unknown,
    /// the list is read at each use).
    changes: Option<OwnedFd>,
    kept: Mutex<Option<Vec<IpAddr>>>,
}

impl Own {
    fn new() -> Self {
        Self {
            changes: watch_addresses().ok(),
            kept: Mutex::new(None),
        }
    }

    fn get(&self) -> Vec<IpAddr> {
        let mut kept = self
            .kept
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let changed = self.changes.as_ref().is_none_or(drained_any);
        match kept.as_ref() {
            Some(list) if !changed => list.clone(),
            _ => {
                let list = read_addresses();
                *kept = Some(list.clone());
                list
            }
        }
    }
}

/// A non-blocking netlink socket that receives every change of an IPv4 or
/// IPv6 address of this host.
fn watch_addresses() -> nix::Result<OwnedFd> {
    let fd = socket(
        AddressFamily::Netlink,
        SockType::Raw,
        SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC,
        SockProtocol::NetlinkRoute,
    )?;
    let groups = u32::try_from(nix::libc::RTMGRP_IPV4_IFADDR | nix::libc::RTMGRP_IPV6_IFADDR)
        .unwrap_or(u32::MAX);
    bind(fd.as_raw_fd(), &NetlinkAddr::new(0, groups))?;
    Ok(fd)
}

/// Read every message waiting on `fd`: whether there was any, or anything
/// else than "none waiting" (a full queue that dropped messages, an error).
fn drained_any(fd: &OwnedFd) -> bool {
    let mut buf = [0u8; 8192];
    let mut any = false;
    loop {
        match recv(fd.as_raw_fd(), &mut buf, MsgFlags::MSG_DONTWAIT) {
            Ok(0) => return true,
            Ok(_) => any = true,
            Err(nix::errno::Errno::EAGAIN) => return any,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return true,
        }
    }
}

/// This host's addresses, on every interface (none when they cannot be
/// read).
fn read_addresses() -> Vec<IpAddr> {
    let Ok(addrs) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    addrs
        .filter_map(|i| {
            let a = i.address?;
            if let Some(v4) = a.as_sockaddr_in() {
                Some(IpAddr::V4(v4.ip()))
            } else {
                a.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip()))
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kept_list_is_the_host_s_and_follows_a_new_address() {
        let own = Own::new();
        assert!(
            own.changes.is_some(),
            "no netlink socket for address changes"
        );
        let first = own.get();
        assert!(first.contains(&IpAddr::from([127, 0, 0, 1])), "{first:?}");
        assert_eq!(own.get(), first);
        if !nix::unistd::Uid::effective().is_root() {
            return;
        }
        // An address the host takes is in the next list, and gone after.
        struct Taken(&'static str);
        fn ip(verb: &str, addr: &str) -> bool {
            std::process::Command::new("ip")
                .args(["addr", verb, &format!("{addr}/32"), "dev", "lo"])
                .status()
                .is_ok_and(|s| s.success())
        }
        impl Drop for Taken {
            fn drop(&mut self) {
                let _ = ip("del", self.0);
            }
        }
        let extra: IpAddr = "127.77.0.42".parse().unwrap();
        assert!(ip("add", "127.77.0.42"), "ip addr add");
        let taken = Taken("127.77.0.42");
        let with = own.get();
        drop(taken);
        assert!(with.contains(&extra), "{with:?}");
        assert!(!own.get().contains(&extra));
    }
}
