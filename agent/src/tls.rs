//! TLS for tokio-postgres with libpq's semantics, on rustls (ring provider).
//!
//! `TlsSettings` is what a connection string says (`sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey`, `sslsni` and their `PG*` variables). `TlsSettings::connector` turns it, for one
//! host, into a `MakeTls`: a tokio-postgres `MakeTlsConnect` whose files are read afresh on
//! every connection attempt, as libpq does (a renewed certificate needs no restart). The rules
//! are libpq's (fe-secure-openssl.c):
//!
//! - the root file is `sslrootcert`, else `~/.postgresql/root.crt`; `system` is the operating
//!   system's trust store (OpenSSL's default paths, `SSL_CERT_FILE`/`SSL_CERT_DIR` honoured).
//!   When a root file exists the chain is verified in every mode that uses TLS — also
//!   `require`, `prefer` and `allow`, as libpq does for compatibility; without one, `verify-ca`
//!   and `verify-full` are an error and the weaker modes verify nothing;
//! - `verify-full` also matches the host name (the `host` value, never `hostaddr`) against the
//!   certificate: subjectAltName entries of the host's kind (DNS name or IP address) and, when
//!   there is none of that kind, the subject's Common Name; a wildcard only as the whole first
//!   label (`*.example.com`), case-insensitively;
//! - the client certificate is `sslcert`, else `~/.postgresql/postgresql.crt`, skipped when the
//!   file does not exist; its key (`sslkey`, else `~/.postgresql/postgresql.key`) must exist
//!   then, be a regular file and not be readable by group or others (0640 allowed when owned
//!   by root);
//! - SNI carries the host name when `sslsni=1` (the default) and the host is not an IP address;
//!   ALPN offers `postgresql`, as libpq 17 does (needed by `sslnegotiation=direct`).
//!
//! The chain is verified by webpki (rustls' own verifier code); host names by libpq's rules
//! on the certificate as x509.rs reads it (which also yields the signature algorithm for
//! SCRAM channel binding, `tls-server-end-point`), except that the Common Name is never
//! consulted when the chain carries name constraints or the roots are the system's. A
//! server certificate that is itself in the root file (a self-signed certificate used as its
//! own CA, as in PostgreSQL's documentation and in Spilo images) is trusted within its
//! validity period, as OpenSSL trusts it, although webpki refuses CA certificates as end
//! entities. The system's trust store is loaded once per process; files are read per
//! connection, and the key file through one descriptor (its checks and its bytes are of the
//! same file).
//!
//! The Patroni REST API client (patroni.rs) uses the same code with `verify-full`, its own
//! ALPN and `patroni_cafile`/`patroni_certfile`/`patroni_keyfile` for the three files.

use std::fmt;
use std::future::Future;
use std::io;
use std::io::Read;
use std::net::{IpAddr, Ipv4Addr};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::Host;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

use crate::conninfo::HostSpec;
use crate::x509::{self, CommonName};

/// libpq's `sslmode`, all six values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    Disable,
    Allow,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl SslMode {
    pub fn parse(value: &str) -> Option<Self> {
        Some(match value {
            "disable" => Self::Disable,
            "allow" => Self::Allow,
            "prefer" => Self::Prefer,
            "require" => Self::Require,
            "verify-ca" => Self::VerifyCa,
            "verify-full" => Self::VerifyFull,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Allow => "allow",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }

    /// verify-ca or verify-full: a root certificate is mandatory.
    pub fn verifies(self) -> bool {
        matches!(self, Self::VerifyCa | Self::VerifyFull)
    }
}

impl fmt::Display for SslMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The TLS part of a connection string, resolved against the environment (see conninfo.rs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsSettings {
    pub mode: SslMode,
    /// `sslrootcert` as given: a file name or `system`.
    pub rootcert: Option<String>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub sni: bool,
    /// The home directory for the `~/.postgresql/` defaults (None: no defaults).
    pub home: Option<PathBuf>,
}

impl Default for TlsSettings {
    fn default() -> Self {
        TlsSettings {
            mode: SslMode::Prefer,
            rootcert: None,
            cert: None,
            key: None,
            sni: true,
            home: None,
        }
    }
}

const ROOT_CERT_FILE: &str = ".postgresql/root.crt";
const USER_CERT_FILE: &str = ".postgresql/postgresql.crt";
const USER_KEY_FILE: &str = ".postgresql/postgresql.key";

const MISSING_ROOT_HINT: &str = "either provide the file, use the system's trusted roots with \
     sslrootcert=system, or change sslmode to disable server certificate verification";

/// Why a TLS connection could not even be attempted (a file, not the server).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct TlsSetupError(pub String);

fn setup_error(message: impl Into<String>) -> TlsSetupError {
    TlsSetupError(message.into())
}

/// Trusted roots and where they came from, for messages.
#[derive(Debug, Clone)]
struct Roots {
    store: Arc<RootCertStore>,
    /// The certificates as read, to trust a server certificate that is one of them.
    ders: Arc<Vec<CertificateDer<'static>>>,
    /// "/path/root.crt" or "the system trust store".
    label: String,
    /// The operating system's store (`sslrootcert=system`).
    system: bool,
    /// Whether a root carries name constraints.
    constrained: bool,
}

/// ALPN for PostgreSQL, as libpq 17 offers it (needed by `sslnegotiation=direct`).
pub const ALPN_POSTGRESQL: &[u8] = b"postgresql";

fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| Arc::new(rustls::crypto::ring::default_provider()))
        .clone()
}

impl TlsSettings {
    fn default_file(&self, name: &str) -> Option<PathBuf> {
        self.home.as_ref().map(|h| h.join(name))
    }

    /// The root certificates to verify against, or None when libpq would verify nothing.
    fn roots(&self) -> Result<Option<Roots>, TlsSetupError> {
        if self.rootcert.as_deref() == Some("system") {
            return system_roots().map(Some);
        }
        let path = match &self.rootcert {
            Some(p) => Some(PathBuf::from(p)),
            None => self.default_file(ROOT_CERT_FILE),
        };
        let Some(path) = path else {
            if self.mode.verifies() {
                return Err(setup_error(format!(
                    "could not get home directory to locate root certificate file; \
                     {MISSING_ROOT_HINT}"
                )));
            }
            return Ok(None);
        };
        if std::fs::metadata(&path).is_err() {
            if self.mode.verifies() {
                return Err(setup_error(format!(
                    "root certificate file \"{}\" does not exist; {MISSING_ROOT_HINT}",
                    path.display()
                )));
            }
            return Ok(None);
        }
        let ders = read_certificates(&path).map_err(|e| {
            setup_error(format!(
                "could not read root certificate file \"{}\": {e}",
                path.display()
            ))
        })?;
        let mut store = RootCertStore::empty();
        let (added, _) = store.add_parsable_certificates(ders.iter().cloned());
        if added == 0 {
            return Err(setup_error(format!(
                "could not read root certificate file \"{}\": no usable certificate in it",
                path.display()
            )));
        }
        Ok(Some(Roots {
            store: Arc::new(store),
            constrained: x509::any_name_constraints(ders.iter().map(|d| d.as_ref())),
            ders: Arc::new(ders),
            label: path.display().to_string(),
            system: false,
        }))
    }

    /// The client certificate chain and key, when there is a certificate file.
    fn client_identity(
        &self,
    ) -> Result<
        Option<(
            Vec<CertificateDer<'static>>,
            PrivateKeyDer<'static>,
            PathBuf,
        )>,
        TlsSetupError,
    > {
        let Some(cert_path) = self
            .cert
            .clone()
            .or_else(|| self.default_file(USER_CERT_FILE))
        else {
            return Ok(None);
        };
        match std::fs::metadata(&cert_path) {
            Ok(_) => {}
            Err(e)
                if e.kind() == io::ErrorKind::NotFound
                    || e.raw_os_error() == Some(libc::ENOTDIR) =>
            {
                return Ok(None);
            }
            Err(e) => {
                return Err(setup_error(format!(
                    "could not open certificate file \"{}\": {e}",
                    cert_path.display()
                )))
            }
        }
        let chain = read_certificates(&cert_path).map_err(|e| {
            setup_error(format!(
                "could not read certificate file \"{}\": {e}",
                cert_path.display()
            ))
        })?;
        let Some(key_path) = self
            .key
            .clone()
            .or_else(|| self.default_file(USER_KEY_FILE))
        else {
            return Err(setup_error(format!(
                "certificate \"{}\" present, but no private key file (set sslkey)",
                cert_path.display()
            )));
        };
        let key = read_private_key(&key_path)?;
        Ok(Some((chain, key, key_path)))
    }

    /// The connector for one host of the string. Files are read now: call it per attempt.
    pub fn connector(&self, host: &HostSpec) -> Result<MakeTls, TlsSetupError> {
        self.connector_with_alpn(host, ALPN_POSTGRESQL)
    }

    /// `connector` offering `alpn` as the application protocol.
    pub fn connector_with_alpn(
        &self,
        host: &HostSpec,
        alpn: &[u8],
    ) -> Result<MakeTls, TlsSetupError> {
        let roots = self.roots()?;
        let name_check = match self.mode {
            SslMode::VerifyFull => Some(match &host.host {
                Some(Host::Tcp(h)) if !h.is_empty() => NameCheck::Host(h.clone()),
                _ => NameCheck::Missing,
            }),
            _ => None,
        };
        let outcome = Arc::new(Outcome::default());
        let verifier = Arc::new(Verifier {
            provider: provider(),
            roots,
            name_check,
            outcome: outcome.clone(),
        });
        let builder = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| setup_error(format!("cannot set up TLS: {e}")))?
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let mut config = match self.client_identity()? {
            Some((chain, key, key_path)) => {
                let key = client_key(chain.first(), key, &key_path)?;
                builder.with_client_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(
                    rustls::sign::CertifiedKey::new(chain, key),
                )))
            }
            None => builder.with_no_client_auth(),
        };
        config.alpn_protocols = vec![alpn.to_vec()];
        let (server_name, sni) = server_name(host);
        config.enable_sni = self.sni && sni;
        Ok(MakeTls {
            inner: Some(Arc::new(Handshake {
                config: Ok(Arc::new(config)),
                server_name,
                outcome,
            })),
        })
    }

    /// `connector`, except that a setup error (a file) is told only if the server accepts
    /// TLS, when the handshake would begin: libpq reads its files then, so `prefer` and
    /// `allow` still reach a server without SSL, and `prefer` falls back to a plain session.
    pub fn connector_deferring_errors(&self, host: &HostSpec) -> MakeTls {
        self.connector(host).unwrap_or_else(|error| MakeTls {
            inner: Some(Arc::new(Handshake {
                config: Err(error),
                server_name: server_name(host).0,
                outcome: Arc::new(Outcome::default()),
            })),
        })
    }
}

/// The name rustls is given (it sends it as SNI when it is a DNS name), and whether libpq
/// would send SNI for this host at all: not for IP addresses (nor what looks like one).
fn server_name(host: &HostSpec) -> (ServerName<'static>, bool) {
    let fallback = || {
        ServerName::IpAddress(
            host.hostaddr
                .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED))
                .into(),
        )
    };
    match &host.host {
        Some(Host::Tcp(h)) if !h.is_empty() => {
            let ip_like = h.bytes().all(|c| c.is_ascii_digit() || c == b'.') || h.contains(':');
            match ServerName::try_from(h.clone()) {
                Ok(name) => (name, !ip_like),
                Err(_) => (fallback(), false),
            }
        }
        _ => (fallback(), false),
    }
}

/// The signing key of the client certificate, checked against the certificate as
/// OpenSSL's SSL_check_private_key does. (rustls' own check parses the certificate with
/// webpki, which refuses X.509 v1 certificates: `openssl x509 -req` without extensions, as
/// in PostgreSQL's documentation, makes those, and servers accept them.)
fn client_key(
    cert: Option<&CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    key_path: &Path,
) -> Result<Arc<dyn rustls::sign::SigningKey>, TlsSetupError> {
    let shown = key_path.display();
    let key = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| setup_error(format!("could not load private key file \"{shown}\": {e}")))?;
    let certified = cert
        .and_then(|c| x509::parse(c))
        .map(|info| info.public_key);
    if let (Some(in_cert), Some(of_key)) = (certified, key.public_key()) {
        if in_cert != of_key.as_ref() {
            return Err(setup_error(format!(
                "certificate does not match private key file \"{shown}\""
            )));
        }
    }
    Ok(key)
}

/// The operating system's trust store (OpenSSL's default paths, `SSL_CERT_FILE` and
/// `SSL_CERT_DIR` honoured), loaded on first use and kept for the process's life; a failure
/// is not kept, the next connection tries again.
fn system_roots() -> Result<Roots, TlsSetupError> {
    static LOADED: Mutex<Option<Roots>> = Mutex::new(None);
    let mut slot = LOADED
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(roots) = slot.as_ref() {
        return Ok(roots.clone());
    }
    let loaded = rustls_native_certs::load_native_certs();
    let mut store = RootCertStore::empty();
    let (added, _) = store.add_parsable_certificates(loaded.certs.iter().cloned());
    if added == 0 {
        let why = loaded
            .errors
            .first()
            .map(|e| e.to_string())
            .unwrap_or_else(|| "no certificate found".to_string());
        return Err(setup_error(format!(
            "could not load system root certificates (sslrootcert=system): {why}"
        )));
    }
    let roots = Roots {
        store: Arc::new(store),
        ders: Arc::new(loaded.certs),
        label: "the system trust store (sslrootcert=system)".to_string(),
        system: true,
        constrained: false,
    };
    *slot = Some(roots.clone());
    Ok(roots)
}

fn read_certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = std::fs::read(path).map_err(|e| e.to_string())?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    if certs.is_empty() {
        // libpq (OpenSSL) takes PEM only for certificate files, but a DER file is one certificate.
        if bytes.first() == Some(&0x30) {
            return Ok(vec![CertificateDer::from(bytes)]);
        }
        return Err("no certificate found (expected PEM)".to_string());
    }
    Ok(certs)
}

/// libpq's checks on the key file, then the key itself (PEM, or DER as libpq's fallback).
/// The checks and the read go through one descriptor, so they are of the same file
/// (opened non-blocking: a FIFO put in its place fails the regular-file check instead of
/// hanging the connect).
fn read_private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsSetupError> {
    let shown = path.display();
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path);
    let mut file = match opened {
        Ok(file) => file,
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            return Err(setup_error(format!(
                "certificate present, but not private key file \"{shown}\""
            )))
        }
        Err(e) => {
            return Err(setup_error(format!(
                "could not open private key file \"{shown}\": {e}"
            )))
        }
    };
    let meta = file
        .metadata()
        .map_err(|e| setup_error(format!("could not stat private key file \"{shown}\": {e}")))?;
    if !meta.is_file() {
        return Err(setup_error(format!(
            "private key file \"{shown}\" is not a regular file"
        )));
    }
    if let Err(message) = key_permissions_ok(meta.uid(), meta.mode()) {
        return Err(setup_error(format!(
            "private key file \"{shown}\" {message}"
        )));
    }
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| setup_error(format!("could not read private key file \"{shown}\": {e}")))?;
    if let Ok(key) = PrivateKeyDer::from_pem_slice(&bytes) {
        return Ok(key);
    }
    if let Ok(key) = PrivateKeyDer::try_from(bytes.clone()) {
        return Ok(key);
    }
    let encrypted = String::from_utf8_lossy(&bytes).contains("ENCRYPTED");
    Err(setup_error(format!(
        "could not load private key file \"{shown}\": {}",
        if encrypted {
            "the key is encrypted (sslpassword is not supported)"
        } else {
            "no private key found (expected PEM or DER: PKCS#8, PKCS#1 or SEC1)"
        }
    )))
}

/// libpq's rule for key files: no group or other access, except group read (0640) for a
/// file owned by root, so a supplementary group can share a system-wide key.
pub fn key_permissions_ok(uid: u32, mode: u32) -> Result<(), String> {
    let forbidden = if uid == 0 { 0o037 } else { 0o077 };
    if mode & forbidden != 0 {
        return Err(format!(
            "has group or world access (mode {:04o}); file must have permissions u=rw (0600) or less \
             if owned by the current user, or permissions u=rw,g=r (0640) or less if owned by root",
            mode & 0o7777
        ));
    }
    Ok(())
}

/// What happened during one handshake, for the caller's error message and libpq's
/// `prefer`/`allow` retries.
#[derive(Debug, Default)]
struct Outcome {
    started: AtomicBool,
    completed: AtomicBool,
    failure: Mutex<Option<Failure>>,
}

/// Why a handshake failed, when it is known.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The server's certificate was refused: why.
    Verify(String),
    /// TLS could not be set up (a file): why.
    Setup(String),
}

#[derive(Debug)]
struct Handshake {
    config: Result<Arc<ClientConfig>, TlsSetupError>,
    server_name: ServerName<'static>,
    outcome: Arc<Outcome>,
}

/// A tokio-postgres `MakeTlsConnect`: TLS with the settings of one host, or none at all
/// (`plain`, for sessions that never use TLS; the server is then never asked for it).
#[derive(Debug, Clone)]
pub struct MakeTls {
    inner: Option<Arc<Handshake>>,
}

impl MakeTls {
    pub fn plain() -> Self {
        MakeTls { inner: None }
    }

    /// Whether a TLS handshake began (the server accepted the SSL request).
    pub fn handshake_started(&self) -> bool {
        self.inner
            .as_ref()
            .is_some_and(|h| h.outcome.started.load(Ordering::SeqCst))
    }

    /// Whether a handshake began and did not complete.
    pub fn handshake_failed(&self) -> bool {
        self.inner.as_ref().is_some_and(|h| {
            h.outcome.started.load(Ordering::SeqCst) && !h.outcome.completed.load(Ordering::SeqCst)
        })
    }

    /// Why the handshake failed, when the certificate or the setup is the reason.
    pub fn failure(&self) -> Option<Failure> {
        let inner = self.inner.as_ref()?;
        inner.outcome.failure.lock().ok()?.clone()
    }
}

impl<S> MakeTlsConnect<S> for MakeTls
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = TlsStream<S>;
    type TlsConnect = TlsConnector;
    type Error = io::Error;

    fn make_tls_connect(&mut self, _domain: &str) -> Result<TlsConnector, io::Error> {
        // The host name to verify and send is this host's `host` value, set when the
        // connector was made; tokio-postgres' `domain` is the same or the hostaddr.
        Ok(TlsConnector {
            inner: self.inner.clone(),
        })
    }
}

pub struct TlsConnector {
    inner: Option<Arc<Handshake>>,
}

impl<S> TlsConnect<S> for TlsConnector
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = TlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let Some(inner) = self.inner else {
                return Err(io::Error::other(
                    "TLS is not configured for this connection",
                ));
            };
            inner.outcome.started.store(true, Ordering::SeqCst);
            let config = match &inner.config {
                Ok(config) => config.clone(),
                Err(error) => {
                    if let Ok(mut slot) = inner.outcome.failure.lock() {
                        *slot = Some(Failure::Setup(error.to_string()));
                    }
                    return Err(io::Error::other(error.clone()));
                }
            };
            let connector = tokio_rustls::TlsConnector::from(config);
            let stream = connector.connect(inner.server_name.clone(), stream).await?;
            inner.outcome.completed.store(true, Ordering::SeqCst);
            Ok(TlsStream(stream))
        })
    }
}

/// A TLS session to a server, with the channel binding data SCRAM-SHA-256-PLUS needs.
pub struct TlsStream<S>(tokio_rustls::client::TlsStream<S>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for TlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for TlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for TlsStream<S> {
    /// `tls-server-end-point` (RFC 5929): the server certificate hashed with its signature's
    /// hash, SHA-256 for MD5 and SHA-1, as the server computes it.
    fn channel_binding(&self) -> ChannelBinding {
        let (_, session) = self.0.get_ref();
        let Some(cert) = session.peer_certificates().and_then(|c| c.first()) else {
            return ChannelBinding::none();
        };
        match x509::parse(cert).and_then(|info| x509::end_point_hash(&info.signature_oid)) {
            Some(alg) => ChannelBinding::tls_server_end_point(
                ring::digest::digest(alg, cert).as_ref().to_vec(),
            ),
            None => ChannelBinding::none(),
        }
    }
}

#[derive(Debug)]
enum NameCheck {
    Host(String),
    /// verify-full without a `host` (only `hostaddr`): libpq refuses.
    Missing,
}

#[derive(Debug)]
struct Verifier {
    provider: Arc<CryptoProvider>,
    roots: Option<Roots>,
    name_check: Option<NameCheck>,
    outcome: Arc<Outcome>,
}

/// The verifier's message, carried through rustls to the caller.
#[derive(Debug)]
struct VerifyFailure(String);

impl fmt::Display for VerifyFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for VerifyFailure {}

impl Verifier {
    fn fail(&self, message: String) -> rustls::Error {
        if let Ok(mut slot) = self.outcome.failure.lock() {
            *slot = Some(Failure::Verify(message.clone()));
        }
        rustls::Error::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(
            VerifyFailure(message),
        ))))
    }

    /// Whether libpq's Common Name fallback applies: not under name constraints (webpki
    /// checks them against SANs only) nor with the system's roots (review L2).
    fn common_name_rule(&self, intermediates: &[CertificateDer<'_>]) -> CommonName {
        const CONSTRAINED: &str = "the certificate chain carries name constraints";
        match &self.roots {
            Some(roots) if roots.system => {
                CommonName::Refused("the roots are the system's (sslrootcert=system)")
            }
            Some(roots) if roots.constrained => CommonName::Refused(CONSTRAINED),
            _ if x509::any_name_constraints(intermediates.iter().map(|c| c.as_ref())) => {
                CommonName::Refused(CONSTRAINED)
            }
            _ => CommonName::Fallback,
        }
    }

    fn check_chain(
        &self,
        roots: &Roots,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<(), String> {
        if roots.ders.iter().any(|r| r.as_ref() == end_entity.as_ref()) {
            // The server's certificate is itself trusted (self-signed, used as its own CA).
            let info = x509::parse(end_entity)
                .ok_or_else(|| "could not parse the server certificate".to_string())?;
            let now = i64::try_from(now.as_secs()).unwrap_or(i64::MAX);
            if now < info.not_before {
                return Err("certificate is not yet valid".to_string());
            }
            if now > info.not_after {
                return Err("certificate has expired".to_string());
            }
            return Ok(());
        }
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)
            .map_err(|e| describe_certificate_error(&e, &roots.label))?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &roots.store,
            intermediates,
            now,
            self.provider.signature_verification_algorithms.all,
        )
        .map_err(|e| describe_certificate_error(&e, &roots.label))
    }
}

fn describe_certificate_error(e: &rustls::Error, label: &str) -> String {
    match e {
        rustls::Error::InvalidCertificate(c) => match c {
            CertificateError::UnknownIssuer if label.starts_with("the system") => {
                format!("certificate is not signed by a CA in {label}")
            }
            CertificateError::UnknownIssuer => {
                format!("certificate is not signed by the CA in {label}")
            }
            CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
                format!("certificate has expired ({c})")
            }
            CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
                format!("certificate is not yet valid ({c})")
            }
            CertificateError::BadSignature => "certificate signature is invalid".to_string(),
            CertificateError::Other(other) if other.to_string().contains("CaUsedAsEndEntity") => {
                format!(
                    "the server's certificate is a CA certificate (basicConstraints CA:TRUE); \
                     it is accepted only when it is itself in {label}"
                )
            }
            other => other.to_string(),
        },
        other => other.to_string(),
    }
}

impl ServerCertVerifier for Verifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if let Some(roots) = &self.roots {
            self.check_chain(roots, end_entity, intermediates, now)
                .map_err(|m| self.fail(m))?;
        }
        match &self.name_check {
            None => {}
            Some(NameCheck::Missing) => {
                return Err(self.fail(
                    "host name must be specified for a verified SSL connection \
                     (sslmode=verify-full needs host=)"
                        .to_string(),
                ))
            }
            Some(NameCheck::Host(host)) => {
                let info = x509::parse(end_entity).ok_or_else(|| {
                    self.fail("could not parse the server certificate".to_string())
                })?;
                let common_name = self.common_name_rule(intermediates);
                x509::check_host_name(&info, host, common_name).map_err(|m| self.fail(m))?;
            }
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Made with the openssl CLI (as tests/integration/test_agent_tls.py makes its own).
    /// `openssl req -x509` of an EC P-256 key, CN=ccm test CA.
    const CA_PEM: &str = include_str!("../testdata/tls/ca.crt");
    /// Signed by CA_PEM: CN=db1, subjectAltName DNS:db1, DNS:localhost, IP:127.0.0.1,
    /// valid 2026-11-23T09:30:18Z to 2036-11-20T09:30:18Z.
    const SERVER_PEM: &str = include_str!("../testdata/tls/db1.crt");
    /// Self-signed, CN only (CN=*.example.com, no SAN), basicConstraints CA:TRUE as
    /// `openssl req -x509` makes by default, valid until 2036-11-20T09:30:19Z.
    const CN_ONLY_PEM: &str = include_str!("../testdata/tls/cn-only.crt");

    fn der(pem: &str) -> CertificateDer<'static> {
        CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
    }

    fn file_roots(store: RootCertStore, ders: Vec<CertificateDer<'static>>, label: &str) -> Roots {
        Roots {
            store: Arc::new(store),
            constrained: x509::any_name_constraints(ders.iter().map(|d| d.as_ref())),
            ders: Arc::new(ders),
            label: label.into(),
            system: false,
        }
    }

    #[test]
    fn key_file_permissions_follow_libpq() {
        assert!(key_permissions_ok(1000, 0o100600).is_ok());
        assert!(key_permissions_ok(1000, 0o100400).is_ok());
        assert!(key_permissions_ok(1000, 0o100640).is_err());
        assert!(key_permissions_ok(1000, 0o100604).is_err());
        assert!(
            key_permissions_ok(0, 0o100640).is_ok(),
            "root-owned 0640 is allowed"
        );
        assert!(key_permissions_ok(0, 0o100660).is_err());
        assert!(key_permissions_ok(0, 0o100644).is_err());
        let message = key_permissions_ok(1000, 0o100644).unwrap_err();
        assert!(message.contains("group or world access"), "{message}");
    }

    #[test]
    fn modes_parse() {
        for m in [
            "disable",
            "allow",
            "prefer",
            "require",
            "verify-ca",
            "verify-full",
        ] {
            assert_eq!(SslMode::parse(m).unwrap().as_str(), m);
        }
        assert_eq!(SslMode::parse("verify_full"), None);
        assert!(SslMode::VerifyCa.verifies() && !SslMode::Require.verifies());
    }

    fn host(name: Option<&str>, addr: Option<&str>) -> HostSpec {
        HostSpec {
            host: name.map(|n| Host::Tcp(n.to_string())),
            hostaddr: addr.map(|a| a.parse().unwrap()),
            port: 5432,
        }
    }

    #[test]
    fn sni_only_for_host_names() {
        assert!(server_name(&host(Some("db1.example.com"), None)).1);
        assert!(!server_name(&host(Some("127.0.0.1"), None)).1);
        assert!(!server_name(&host(Some("::1"), None)).1);
        assert!(!server_name(&host(None, Some("10.0.0.1"))).1);
        assert_eq!(
            server_name(&host(None, Some("10.0.0.1"))).0,
            ServerName::IpAddress("10.0.0.1".parse::<IpAddr>().unwrap().into())
        );
    }

    fn temp_dir(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("ccm-agent-tls-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn root_file_rules() {
        let dir = temp_dir("roots");
        let missing = dir.join("missing.crt");
        // No file: the weak modes verify nothing, verify-* is an error naming the file.
        for mode in [SslMode::Allow, SslMode::Prefer, SslMode::Require] {
            let s = TlsSettings {
                mode,
                rootcert: Some(missing.display().to_string()),
                ..TlsSettings::default()
            };
            assert!(s.roots().unwrap().is_none(), "{mode}");
        }
        for mode in [SslMode::VerifyCa, SslMode::VerifyFull] {
            let s = TlsSettings {
                mode,
                rootcert: Some(missing.display().to_string()),
                ..TlsSettings::default()
            };
            let e = s.roots().unwrap_err().to_string();
            assert!(e.contains("missing.crt\" does not exist"), "{e}");
        }
        // The default file under the home directory makes `require` verify (libpq's
        // backwards compatibility).
        std::fs::create_dir_all(dir.join(".postgresql")).unwrap();
        std::fs::write(dir.join(ROOT_CERT_FILE), SERVER_PEM).unwrap();
        let s = TlsSettings {
            mode: SslMode::Require,
            home: Some(dir.clone()),
            ..TlsSettings::default()
        };
        let roots = s.roots().unwrap().expect("default root.crt is used");
        assert!(roots.label.ends_with(".postgresql/root.crt"));
        // A file without certificates is an error.
        std::fs::write(dir.join("empty.crt"), "nothing here\n").unwrap();
        let s = TlsSettings {
            mode: SslMode::Require,
            rootcert: Some(dir.join("empty.crt").display().to_string()),
            ..TlsSettings::default()
        };
        assert!(s
            .roots()
            .unwrap_err()
            .to_string()
            .contains("could not read root certificate file"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn client_certificate_rules() {
        use std::os::unix::fs::PermissionsExt;
        let dir = temp_dir("client");
        // No certificate file: no client certificate, no error.
        let s = TlsSettings {
            cert: Some(dir.join("none.crt")),
            ..TlsSettings::default()
        };
        assert!(s.client_identity().unwrap().is_none());
        // A certificate without its key is an error naming the key file.
        std::fs::write(dir.join("c.crt"), SERVER_PEM).unwrap();
        let s = TlsSettings {
            cert: Some(dir.join("c.crt")),
            key: Some(dir.join("c.key")),
            ..TlsSettings::default()
        };
        let e = s.client_identity().unwrap_err().to_string();
        assert!(
            e.contains("certificate present, but not private key file"),
            "{e}"
        );
        // A key readable by others is refused before it is read.
        std::fs::write(dir.join("c.key"), "-----BEGIN PRIVATE KEY-----\n").unwrap();
        std::fs::set_permissions(dir.join("c.key"), std::fs::Permissions::from_mode(0o644))
            .unwrap();
        let e = s.client_identity().unwrap_err().to_string();
        if nix_uid() == 0 || std::fs::metadata(dir.join("c.key")).unwrap().uid() != 0 {
            assert!(e.contains("has group or world access"), "{e}");
        }
        std::fs::set_permissions(dir.join("c.key"), std::fs::Permissions::from_mode(0o600))
            .unwrap();
        let e = s.client_identity().unwrap_err().to_string();
        assert!(e.contains("could not load private key file"), "{e}");
        // A FIFO in the key's place is refused at once (one non-blocking descriptor).
        std::fs::remove_file(dir.join("c.key")).unwrap();
        let name =
            std::ffi::CString::new(dir.join("c.key").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: mkfifo reads the NUL-terminated path only.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let e = s.client_identity().unwrap_err().to_string();
        assert!(e.contains("is not a regular file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn client_key_must_match_the_certificate() {
        let rng = ring::rand::SystemRandom::new();
        let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(
            &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
            &rng,
        )
        .unwrap();
        let key = PrivateKeyDer::Pkcs8(pkcs8.as_ref().to_vec().into());
        let e = client_key(Some(&der(SERVER_PEM)), key.clone_key(), Path::new("/k.key"))
            .err()
            .unwrap();
        assert_eq!(
            e.to_string(),
            "certificate does not match private key file \"/k.key\""
        );
        // The key's own public key is what the certificate must carry.
        let loaded = provider().key_provider.load_private_key(key).unwrap();
        let spki = loaded.public_key().unwrap();
        assert!(x509::parse(&der(SERVER_PEM)).unwrap().public_key != spki.as_ref());
        assert_eq!(
            x509::parse(&der(SERVER_PEM)).unwrap().public_key[..2],
            [0x30, 0x59],
            "a P-256 SubjectPublicKeyInfo, whole"
        );
    }

    fn nix_uid() -> u32 {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() }
    }

    #[test]
    fn connector_for_plain_refuses_to_handshake() {
        let plain = MakeTls::plain();
        assert!(!plain.handshake_started());
        assert!(plain.failure().is_none());
    }

    #[test]
    fn verify_full_without_host_is_refused() {
        let dir = temp_dir("nohost");
        std::fs::write(dir.join("root.crt"), SERVER_PEM).unwrap();
        let s = TlsSettings {
            mode: SslMode::VerifyFull,
            rootcert: Some(dir.join("root.crt").display().to_string()),
            ..TlsSettings::default()
        };
        let tls = s.connector(&host(None, Some("127.0.0.1"))).unwrap();
        let inner = tls.inner.as_ref().unwrap();
        let verifier = Verifier {
            provider: provider(),
            roots: None,
            name_check: Some(NameCheck::Missing),
            outcome: inner.outcome.clone(),
        };
        let e = verifier
            .verify_server_cert(
                &der(SERVER_PEM),
                &[],
                &inner.server_name,
                &[],
                UnixTime::now(),
            )
            .unwrap_err();
        assert!(e.to_string().contains("host name must be specified"), "{e}");
        assert!(matches!(
            tls.failure(),
            Some(Failure::Verify(m)) if m.contains("host name must be specified")
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn self_signed_server_certificate_in_the_root_file_is_trusted() {
        let roots = {
            let mut store = RootCertStore::empty();
            store.add_parsable_certificates([der(CN_ONLY_PEM)]);
            file_roots(store, vec![der(CN_ONLY_PEM)], "root.crt")
        };
        let verifier = Verifier {
            provider: provider(),
            roots: None,
            name_check: None,
            outcome: Arc::new(Outcome::default()),
        };
        let valid = UnixTime::since_unix_epoch(std::time::Duration::from_secs(1800000000));
        let before = UnixTime::since_unix_epoch(std::time::Duration::from_secs(1700000000));
        assert_eq!(
            verifier
                .check_chain(&roots, &der(CN_ONLY_PEM), &[], before)
                .unwrap_err(),
            "certificate is not yet valid"
        );
        assert!(verifier
            .check_chain(&roots, &der(CN_ONLY_PEM), &[], valid)
            .is_ok());
        let later = UnixTime::since_unix_epoch(std::time::Duration::from_secs(2200000000));
        assert_eq!(
            verifier
                .check_chain(&roots, &der(CN_ONLY_PEM), &[], later)
                .unwrap_err(),
            "certificate has expired"
        );
        // A certificate from another CA is not signed by this one.
        let e = verifier
            .check_chain(&roots, &der(SERVER_PEM), &[], valid)
            .unwrap_err();
        assert_eq!(e, "certificate is not signed by the CA in root.crt");
    }

    #[test]
    fn chains_are_verified_by_webpki() {
        let mut store = RootCertStore::empty();
        store.add_parsable_certificates([der(CA_PEM)]);
        let roots = file_roots(store, vec![der(CA_PEM)], "ca.crt");
        let verifier = Verifier {
            provider: provider(),
            roots: None,
            name_check: None,
            outcome: Arc::new(Outcome::default()),
        };
        let valid = UnixTime::since_unix_epoch(std::time::Duration::from_secs(1800000000));
        assert!(verifier
            .check_chain(&roots, &der(SERVER_PEM), &[], valid)
            .is_ok());
        let later = UnixTime::since_unix_epoch(std::time::Duration::from_secs(2200000000));
        let e = verifier
            .check_chain(&roots, &der(SERVER_PEM), &[], later)
            .unwrap_err();
        assert!(e.starts_with("certificate has expired"), "{e}");
        // A CA certificate presented as the server's, not itself trusted: webpki refuses it.
        let e = verifier
            .check_chain(&roots, &der(CN_ONLY_PEM), &[], valid)
            .unwrap_err();
        assert!(
            e.contains("not signed by the CA") || e.contains("CA certificate"),
            "{e}"
        );
    }
}
