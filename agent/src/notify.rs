//! systemd's service notification protocol (sd_notify(3)), for `Type=notify` units: READY=1
//! once the agent serves, STATUS= lines, WATCHDOG=1 while the sync loop is alive, STOPPING=1
//! at shutdown. Without `NOTIFY_SOCKET` (not under systemd) every call does nothing.
//!
//! The protocol is one datagram per message on a Unix socket (a path, or an abstract name
//! when it starts with '@'); the few lines of std below are all it takes, so no crate.

use std::os::unix::net::UnixDatagram;
use std::time::Duration;

#[cfg(target_os = "linux")]
use std::os::linux::net::SocketAddrExt;

/// Sends `state` (e.g. "READY=1") to systemd, if the agent runs under it. Failures are
/// ignored, as sd_notify's callers do: the service works the same without them.
pub fn notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let Ok(socket) = UnixDatagram::unbound() else {
        return;
    };
    let path = path.to_string_lossy().into_owned();
    let _ = match path.strip_prefix('@') {
        #[cfg(target_os = "linux")]
        Some(name) => std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())
            .and_then(|addr| socket.send_to_addr(state.as_bytes(), &addr)),
        #[cfg(not(target_os = "linux"))]
        Some(_) => return,
        None => socket.send_to(state.as_bytes(), &path),
    };
}

/// The watchdog period systemd asks for (`WatchdogSec=`), if it asks this process.
pub fn watchdog_period() -> Option<Duration> {
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    if let Ok(pid) = std::env::var("WATCHDOG_PID") {
        if pid.parse::<u32>().ok()? != std::process::id() {
            return None;
        }
    }
    (usec > 0).then(|| Duration::from_micros(usec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_datagrams_to_the_socket_systemd_names() {
        let dir = std::env::temp_dir().join(format!("ccm-notify-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let receiver = UnixDatagram::bind(&dir).unwrap();
        std::env::set_var("NOTIFY_SOCKET", &dir);
        notify("READY=1");
        let mut buf = [0u8; 64];
        let n = receiver.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
        std::env::remove_var("NOTIFY_SOCKET");
        notify("READY=1"); // nowhere to go: does nothing
        std::fs::remove_file(&dir).unwrap();

        std::env::set_var("WATCHDOG_USEC", "2000000");
        std::env::set_var("WATCHDOG_PID", std::process::id().to_string());
        assert_eq!(watchdog_period(), Some(Duration::from_secs(2)));
        std::env::set_var("WATCHDOG_PID", "1");
        assert_eq!(watchdog_period(), None, "another process's watchdog");
        std::env::remove_var("WATCHDOG_PID");
        std::env::remove_var("WATCHDOG_USEC");
    }
}
