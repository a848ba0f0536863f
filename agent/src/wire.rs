//! A session's socket, opened by the agent so that it can count the bytes the session
//! carries, for `ccm_agent_bytes_total{node,direction}`.
//!
//! `connect` does what tokio-postgres' own `Config::connect` does for one host (the
//! `hostaddr` if given, else every address the `host` resolves to, in order, or the Unix
//! socket `.s.PGSQL.<port>` of a directory host; each with the connect timeout; TCP_NODELAY,
//! keepalives and `tcp_user_timeout` as the string says; the next address when one fails),
//! but hands the socket to `Config::connect_raw` inside `Counted`, which adds up what is
//! written to it and read from it. That is the whole protocol as it crosses the socket, TLS
//! records included, TCP/IP headers not; Unix-socket sessions are counted too. No `/proc`,
//! no `getsockopt`: it builds wherever tokio does.
//!
//! A session made with `connect_raw` does not know its address, so its cancel requests go
//! through `Wire::cancel`: a new socket to the address the session was made to (libpq sends
//! them there too), with the session's TLS. They are not counted: they are not the session.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use socket2::{SockRef, TcpKeepalive};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
#[cfg(unix)]
use tokio::net::UnixStream;
use tokio_postgres::config::Host;
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres::{CancelToken, Client, Config, Connection};

use crate::tls::{MakeTls, TlsStream};

/// The connection object of a session made by `connect`.
pub type PgConnection = Connection<Counted<Socket>, TlsStream<Counted<Socket>>>;

/// Why `connect` failed: the socket (resolve, connect, socket options) or the session.
#[derive(Debug)]
pub enum ConnectError {
    Socket(io::Error),
    Postgres(tokio_postgres::Error),
}

/// A TCP or Unix-domain stream.
#[derive(Debug)]
pub enum Socket {
    Tcp(TcpStream),
    #[cfg(unix)]
    Unix(UnixStream),
}

/// Where a session's socket goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Peer {
    Tcp(SocketAddr),
    #[cfg(unix)]
    Unix(PathBuf),
}

/// The socket settings of a connection string, for the session and its cancel requests.
#[derive(Debug, Clone, PartialEq, Eq)]
struct SocketOptions {
    connect_timeout: Option<Duration>,
    tcp_user_timeout: Option<Duration>,
    keepalives: bool,
    keepalives_idle: Duration,
    keepalives_interval: Option<Duration>,
    keepalives_retries: Option<u32>,
}

impl SocketOptions {
    fn of(config: &Config) -> Self {
        SocketOptions {
            connect_timeout: config.get_connect_timeout().copied(),
            tcp_user_timeout: config.get_tcp_user_timeout().copied(),
            keepalives: config.get_keepalives(),
            keepalives_idle: config.get_keepalives_idle(),
            keepalives_interval: config.get_keepalives_interval(),
            keepalives_retries: config.get_keepalives_retries(),
        }
    }

    fn keepalive(&self) -> TcpKeepalive {
        #[allow(unused_mut)]
        let mut keepalive = TcpKeepalive::new().with_time(self.keepalives_idle);
        #[cfg(not(any(target_os = "aix", target_os = "solaris", target_os = "openbsd")))]
        if let Some(interval) = self.keepalives_interval {
            keepalive = keepalive.with_interval(interval);
        }
        #[cfg(not(any(
            target_os = "aix",
            target_os = "solaris",
            target_os = "windows",
            target_os = "openbsd"
        )))]
        if let Some(retries) = self.keepalives_retries {
            keepalive = keepalive.with_retries(retries);
        }
        keepalive
    }

    /// A socket to `peer`, set up as the string says.
    async fn open(&self, peer: &Peer) -> io::Result<Socket> {
        match peer {
            Peer::Tcp(addr) => {
                let stream = self.within_timeout(TcpStream::connect(addr)).await?;
                stream.set_nodelay(true)?;
                let socket = SockRef::from(&stream);
                #[cfg(any(target_os = "android", target_os = "fuchsia", target_os = "linux"))]
                if let Some(timeout) = self.tcp_user_timeout {
                    socket.set_tcp_user_timeout(Some(timeout))?;
                }
                if self.keepalives {
                    socket.set_tcp_keepalive(&self.keepalive())?;
                }
                Ok(Socket::Tcp(stream))
            }
            #[cfg(unix)]
            Peer::Unix(path) => Ok(Socket::Unix(
                self.within_timeout(UnixStream::connect(path)).await?,
            )),
        }
    }

    async fn within_timeout<T>(
        &self,
        connect: impl std::future::Future<Output = io::Result<T>>,
    ) -> io::Result<T> {
        match self.connect_timeout {
            None => connect.await,
            Some(timeout) => tokio::time::timeout(timeout, connect)
                .await
                .unwrap_or_else(|_| {
                    Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "connection timed out",
                    ))
                }),
        }
    }
}

/// Bytes written and read since the last `take`.
#[derive(Debug, Default)]
struct Counts {
    sent: AtomicU64,
    received: AtomicU64,
}

/// A stream that counts what passes through it.
#[derive(Debug)]
pub struct Counted<S> {
    inner: S,
    counts: Arc<Counts>,
}

impl<S> Counted<S> {
    fn new(inner: S) -> (Self, Arc<Counts>) {
        let counts = Arc::new(Counts::default());
        let counted = Counted {
            inner,
            counts: counts.clone(),
        };
        (counted, counts)
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let poll = Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before) as u64;
        self.counts.received.fetch_add(read, Ordering::Relaxed);
        poll
    }
}

impl<S> Counted<S> {
    /// Counts what a write reports written.
    fn sent(&self, poll: Poll<io::Result<usize>>) -> Poll<io::Result<usize>> {
        if let Poll::Ready(Ok(written)) = &poll {
            self.counts
                .sent
                .fetch_add(*written as u64, Ordering::Relaxed);
        }
        poll
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write(cx, buf);
        self.sent(poll)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let poll = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        self.sent(poll)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

macro_rules! each_socket {
    ($socket:expr, $s:ident => $body:expr) => {
        match $socket {
            Socket::Tcp($s) => $body,
            #[cfg(unix)]
            Socket::Unix($s) => $body,
        }
    };
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        each_socket!(self.get_mut(), s => Pin::new(s).poll_read(cx, buf))
    }
}

impl AsyncWrite for Socket {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        each_socket!(self.get_mut(), s => Pin::new(s).poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        each_socket!(self.get_mut(), s => Pin::new(s).poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        each_socket!(self, s => s.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each_socket!(self.get_mut(), s => Pin::new(s).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        each_socket!(self.get_mut(), s => Pin::new(s).poll_shutdown(cx))
    }
}

/// What a session keeps of its socket: the counts, and where to send its cancel requests.
#[derive(Debug)]
pub struct Wire {
    counts: Arc<Counts>,
    peer: Peer,
    options: SocketOptions,
}

impl Wire {
    /// Bytes the session sent and received since the last call (since the connect, the
    /// first time); what was still in flight when it closed is told once more.
    pub fn take(&self) -> (u64, u64) {
        (
            self.counts.sent.swap(0, Ordering::Relaxed),
            self.counts.received.swap(0, Ordering::Relaxed),
        )
    }

    /// Sends the session's cancel request, over `tls` as the session was made.
    pub async fn cancel(&self, token: &CancelToken, tls: MakeTls) -> Result<(), ConnectError> {
        let socket = self
            .options
            .open(&self.peer)
            .await
            .map_err(ConnectError::Socket)?;
        let mut tls = tls;
        let connect = <MakeTls as MakeTlsConnect<Socket>>::make_tls_connect(&mut tls, "")
            .map_err(ConnectError::Socket)?;
        token
            .cancel_query_raw(socket, connect)
            .await
            .map_err(ConnectError::Postgres)
    }
}

impl std::fmt::Display for ConnectError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // tokio-postgres' own words for a socket that could not be opened.
            ConnectError::Socket(e) => write!(f, "error connecting to server: {e}"),
            ConnectError::Postgres(e) => write!(f, "{e}"),
        }
    }
}

/// The addresses to try for the single host of `config`, in order.
async fn peers(config: &Config) -> io::Result<Vec<Peer>> {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    if let Some(addr) = config.get_hostaddrs().first() {
        return Ok(vec![Peer::Tcp(SocketAddr::new(*addr, port))]);
    }
    match config.get_hosts().first() {
        Some(Host::Tcp(name)) => {
            let found: Vec<Peer> = tokio::net::lookup_host((name.as_str(), port))
                .await?
                .map(Peer::Tcp)
                .collect();
            if found.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "could not resolve any addresses",
                ));
            }
            Ok(found)
        }
        #[cfg(unix)]
        Some(Host::Unix(dir)) => Ok(vec![Peer::Unix(dir.join(format!(".s.PGSQL.{port}")))]),
        None => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "both host and hostaddr are missing",
        )),
    }
}

/// Connects to the single host of `config` (see the module comment); the TLS mode is the
/// config's, the handshake `tls`'s. Every address is tried until one gives a session; the
/// error is the last address's.
pub async fn connect(
    config: &Config,
    tls: &MakeTls,
) -> Result<(Client, PgConnection, Wire), ConnectError> {
    let options = SocketOptions::of(config);
    let mut last = None;
    for peer in peers(config).await.map_err(ConnectError::Socket)? {
        let socket = match options.open(&peer).await {
            Ok(socket) => socket,
            Err(e) => {
                last = Some(ConnectError::Socket(e));
                continue;
            }
        };
        let (counted, counts) = Counted::new(socket);
        let connect =
            <MakeTls as MakeTlsConnect<Counted<Socket>>>::make_tls_connect(&mut tls.clone(), "")
                .map_err(ConnectError::Socket)?;
        match config.connect_raw(counted, connect).await {
            Ok((client, connection)) => {
                let wire = Wire {
                    counts,
                    peer,
                    options,
                };
                return Ok((client, connection, wire));
            }
            Err(e) => last = Some(ConnectError::Postgres(e)),
        }
    }
    Err(last.unwrap_or_else(|| {
        ConnectError::Socket(io::Error::new(
            io::ErrorKind::InvalidInput,
            "could not resolve any addresses",
        ))
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    #[tokio::test]
    async fn counts_what_crosses_the_socket() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = Peer::Tcp(listener.local_addr().unwrap());
        let options = SocketOptions::of(&Config::new());
        let socket = options.open(&peer).await.unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        let (mut client, counts) = Counted::new(socket);
        client.write_all(&[7u8; 1000]).await.unwrap();
        let mut buf = [0u8; 1000];
        server.read_exact(&mut buf).await.unwrap();
        server.write_all(&[8u8; 300]).await.unwrap();
        client.read_exact(&mut buf[..300]).await.unwrap();
        let wire = Wire {
            counts,
            peer,
            options,
        };
        assert_eq!(wire.take(), (1000, 300));
        assert_eq!(wire.take(), (0, 0), "each byte is told once");
        server.write_all(&[9u8; 5]).await.unwrap();
        drop(server);
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).await.unwrap();
        assert_eq!(
            wire.take(),
            (0, 5),
            "what arrived before the close still counts"
        );
    }

    #[tokio::test]
    async fn a_refused_connect_is_a_socket_error() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let error = connect(&plain_config(addr), &MakeTls::plain())
            .await
            .err()
            .unwrap();
        assert!(
            matches!(&error, ConnectError::Socket(e) if e.kind() == io::ErrorKind::ConnectionRefused),
            "{error}"
        );
        assert!(error
            .to_string()
            .starts_with("error connecting to server: "));
    }

    #[tokio::test]
    async fn a_server_that_hangs_up_is_a_session_error() {
        // Reads the startup message, then closes: the socket was fine, the session was not.
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut buf = [0u8; 512];
                let _ = socket.read(&mut buf).await;
            }
        });
        let error = connect(&plain_config(addr), &MakeTls::plain())
            .await
            .err()
            .unwrap();
        assert!(matches!(error, ConnectError::Postgres(_)), "{error}");
    }

    /// A session without TLS to `addr`, named localhost.
    fn plain_config(addr: SocketAddr) -> Config {
        let mut config = Config::new();
        config
            .host("localhost")
            .hostaddr(addr.ip())
            .port(addr.port())
            .user("u")
            .ssl_mode(tokio_postgres::config::SslMode::Disable);
        config
    }

    #[tokio::test]
    async fn hostaddr_is_used_not_the_name() {
        let mut config = Config::new();
        config
            .host("db.invalid")
            .hostaddr("10.1.2.3".parse().unwrap())
            .port(6000);
        assert_eq!(
            peers(&config).await.unwrap(),
            vec![Peer::Tcp("10.1.2.3:6000".parse().unwrap())]
        );
    }

    #[cfg(unix)]
    #[tokio::test]
    async fn a_directory_host_is_its_unix_socket() {
        let mut config = Config::new();
        config.host_path("/var/run/postgresql").port(5433);
        assert_eq!(
            peers(&config).await.unwrap(),
            vec![Peer::Unix(PathBuf::from(
                "/var/run/postgresql/.s.PGSQL.5433"
            ))]
        );
    }
}
