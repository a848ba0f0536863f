//! Bytes on the wire per node session, as the kernel counts them, for
//! `ccm_agent_bytes_total{node,direction}`.
//!
//! tokio-postgres owns the session's socket and does not lend it out, so the socket is found
//! the way `ss -p` finds it: right after the session is established, the agent's own TCP
//! sockets to the node's port (its descriptors in /proc/self/fd, matched by inode with
//! /proc/self/net/tcp and tcp6) that were not there before the connect. When exactly one is
//! new, it is the session's; otherwise (a unix-domain socket, another connect to the same port
//! at the same moment) the session goes uncounted rather than counted wrong.
//!
//! The counts are TCP_INFO's `tcpi_bytes_acked` (sent, and acknowledged by the node) and
//! `tcpi_bytes_received`: everything the protocol carries, TLS included. Before each read the
//! descriptor is checked to still be the same socket (its inode), since a descriptor closed
//! by the connection task may be reused for another file.

use std::collections::HashSet;
use std::fs;
use std::os::fd::RawFd;

/// The inodes of this process's TCP sockets whose peer port is `port`.
pub fn sockets_to(port: u16) -> HashSet<u64> {
    let ours = own_socket_inodes();
    let mut found = HashSet::new();
    for table in ["/proc/self/net/tcp", "/proc/self/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            if let Some((peer_port, inode)) = peer_port_and_inode(line) {
                if peer_port == port && ours.contains(&inode) {
                    found.insert(inode);
                }
            }
        }
    }
    found
}

/// A line of /proc/net/tcp: "sl local_address rem_address st tx:rx tr:when retrnsmt uid
/// timeout inode ...", addresses as HEXADDR:HEXPORT.
fn peer_port_and_inode(line: &str) -> Option<(u16, u64)> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (_, port) = fields.get(2)?.rsplit_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let inode = fields.get(9)?.parse().ok()?;
    Some((port, inode))
}

/// Socket inodes of this process's open descriptors.
fn own_socket_inodes() -> HashSet<u64> {
    descriptors().into_iter().map(|(_, inode)| inode).collect()
}

/// (descriptor, socket inode) of this process's open sockets.
fn descriptors() -> Vec<(RawFd, u64)> {
    let Ok(entries) = fs::read_dir("/proc/self/fd") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|entry| {
            let fd: RawFd = entry.file_name().to_str()?.parse().ok()?;
            let target = fs::read_link(entry.path()).ok()?;
            let inode = target
                .to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .parse()
                .ok()?;
            Some((fd, inode))
        })
        .collect()
}

/// The kernel's byte counts of one session's socket.
#[derive(Debug)]
pub struct SocketCounter {
    fd: RawFd,
    inode: u64,
    sent: u64,
    received: u64,
}

impl SocketCounter {
    /// The socket to `port` opened since `before` was taken (sockets_to(port) then), if
    /// exactly one is.
    pub fn find(port: u16, before: &HashSet<u64>) -> Option<SocketCounter> {
        let new: Vec<u64> = sockets_to(port).difference(before).copied().collect();
        let [inode] = new[..] else {
            return None;
        };
        let fd = descriptors()
            .into_iter()
            .find(|&(_, i)| i == inode)
            .map(|(fd, _)| fd)?;
        Some(SocketCounter {
            fd,
            inode,
            sent: 0,
            received: 0,
        })
    }

    /// Bytes sent and received since the last call (since the connect, the first time); None
    /// once the socket is gone.
    pub fn take(&mut self) -> Option<(u64, u64)> {
        let (sent, received) = tcp_bytes(self.fd, self.inode)?;
        let delta = (
            sent.saturating_sub(self.sent),
            received.saturating_sub(self.received),
        );
        (self.sent, self.received) = (sent, received);
        Some(delta)
    }
}

/// TCP_INFO's bytes acked and received of descriptor `fd`, if it is still socket `inode`.
fn tcp_bytes(fd: RawFd, inode: u64) -> Option<(u64, u64)> {
    // SAFETY: fstat and getsockopt write at most the sizes given into the zeroed structs; a
    // descriptor that is closed or reused makes them fail or fails the inode check.
    unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        if libc::fstat(fd, &mut stat) != 0 || stat.st_ino != inode {
            return None;
        }
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let rc = libc::getsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        );
        if rc != 0 {
            return None;
        }
        Some((info.tcpi_bytes_acked, info.tcpi_bytes_received))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn parses_a_proc_net_tcp_line() {
        let line = "   3: 0100007F:D2A4 0100007F:1538 01 00000000:00000000 00:00000000 00000000     0        0 4242 1 0000000000000000 20 4 30 10 -1";
        assert_eq!(peer_port_and_inode(line), Some((0x1538, 4242)));
        assert_eq!(peer_port_and_inode("garbage"), None);
    }

    #[test]
    fn counts_the_bytes_of_a_new_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let before = sockets_to(port);
        let mut client = TcpStream::connect(("127.0.0.1", port)).unwrap();
        let (mut server, _) = listener.accept().unwrap();
        let mut counter = SocketCounter::find(port, &before).expect("the new socket");
        client.write_all(&[7u8; 1000]).unwrap();
        let mut buf = [0u8; 1000];
        server.read_exact(&mut buf).unwrap();
        server.write_all(&[8u8; 300]).unwrap();
        client.read_exact(&mut buf[..300]).unwrap();
        // The acknowledgement of the last bytes may trail the read a little.
        let mut total = (0, 0);
        for _ in 0..100 {
            let (s, r) = counter.take().unwrap();
            total = (total.0 + s, total.1 + r);
            if total.0 >= 1000 && total.1 >= 300 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        // Some kernels count the SYN's sequence number as one byte acknowledged.
        assert!(
            (1000..=1001).contains(&total.0) && total.1 == 300,
            "{total:?}"
        );
        drop(client);
        assert_eq!(counter.take(), None, "a closed socket is not read");
    }
}
