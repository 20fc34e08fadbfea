//! Sockets for hyper on glommio: TCP connect (name resolution off the
//! executor thread, `TCP_NODELAY`), the rustls client configuration (system
//! roots plus an optional PEM bundle, ALPN), and [`Stream`], a plain or TLS
//! socket.
//!
//! The IO adapter, executor and timer hyper needs come from
//! `kvshard_io::http` ([`HyperIo`], [`LocalExec`], [`LocalTimer`]): every
//! task hyper spawns stays on the calling glommio executor.

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use futures_lite::io::{AsyncRead, AsyncWrite};
use futures_rustls::client::TlsStream;
use futures_rustls::TlsConnector;
use glommio::net::TcpStream;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName};

pub use kvshard_io::http::{HyperIo, LocalExec, LocalTimer};

/// ALPN protocol id of HTTP/2.
pub const ALPN_H2: &[u8] = b"h2";
/// ALPN protocol id of HTTP/1.1.
pub const ALPN_HTTP11: &[u8] = b"http/1.1";

/// A connected socket, plain or TLS.
pub enum Stream {
    /// Plain TCP.
    Tcp(TcpStream),
    /// rustls over TCP (boxed: the TLS state is large).
    Tls(Box<TlsStream<TcpStream>>),
}

impl fmt::Debug for Stream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Stream::Tcp(_) => f.write_str("Stream::Tcp"),
            Stream::Tls(s) => write!(
                f,
                "Stream::Tls(alpn {:?})",
                s.get_ref().1.alpn_protocol().map(String::from_utf8_lossy)
            ),
        }
    }
}

impl Stream {
    /// The TCP socket underneath.
    pub fn tcp_fd(&self) -> RawFd {
        match self {
            Stream::Tcp(s) => s.as_raw_fd(),
            Stream::Tls(s) => s.get_ref().0.as_raw_fd(),
        }
    }

    /// The ALPN protocol the server chose, for TLS streams.
    pub fn alpn_protocol(&self) -> Option<&[u8]> {
        match self {
            Stream::Tcp(_) => None,
            Stream::Tls(s) => s.get_ref().1.alpn_protocol(),
        }
    }
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_close(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Tcp(s) => Pin::new(s).poll_close(cx),
            Stream::Tls(s) => Pin::new(s.as_mut()).poll_close(cx),
        }
    }
}

/// Why a connection could not be set up.
#[derive(Debug)]
pub enum ConnectError {
    /// The host name did not resolve (or resolved to nothing).
    Resolve {
        /// The host.
        host: String,
        /// The resolver's error.
        error: io::Error,
    },
    /// TCP connect failed (refused, unreachable, reset).
    Tcp {
        /// The address tried last.
        addr: SocketAddr,
        /// The error.
        error: io::Error,
    },
    /// The TLS handshake failed because of an I/O error (a transport
    /// problem, worth retrying).
    TlsIo(io::Error),
    /// The TLS handshake was refused: bad certificate, no common protocol
    /// (a configuration problem; retrying does not help).
    TlsRejected(String),
    /// The HTTP/2 connection preface or settings exchange failed.
    Handshake(String),
}

impl ConnectError {
    /// True for failures of the network path (resolve, TCP, TLS transport),
    /// false for a TLS rejection.
    pub fn is_connection_level(&self) -> bool {
        !matches!(self, ConnectError::TlsRejected(_))
    }
}

impl fmt::Display for ConnectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConnectError::Resolve { host, error } => write!(f, "cannot resolve {host:?}: {error}"),
            ConnectError::Tcp { addr, error } => write!(f, "TCP connect to {addr}: {error}"),
            ConnectError::TlsIo(e) => write!(f, "TLS handshake I/O: {e}"),
            ConnectError::TlsRejected(e) => write!(f, "TLS handshake rejected: {e}"),
            ConnectError::Handshake(e) => write!(f, "HTTP handshake: {e}"),
        }
    }
}

impl std::error::Error for ConnectError {}

/// Resolves `host:port` to socket addresses. IP literals need no lookup;
/// names are looked up on glommio's blocking thread pool so `getaddrinfo`
/// never stalls the executor.
pub async fn resolve(host: &str, port: u16) -> Result<Vec<SocketAddr>, ConnectError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(vec![SocketAddr::new(ip, port)]);
    }
    let name = host.to_owned();
    let result = glommio::executor()
        .spawn_blocking(move || {
            (name.as_str(), port)
                .to_socket_addrs()
                .map(|addrs| addrs.collect::<Vec<_>>())
        })
        .await;
    match result {
        Ok(addrs) if !addrs.is_empty() => Ok(addrs),
        Ok(_) => Err(ConnectError::Resolve {
            host: host.to_owned(),
            error: io::Error::new(io::ErrorKind::NotFound, "no addresses"),
        }),
        Err(error) => Err(ConnectError::Resolve {
            host: host.to_owned(),
            error,
        }),
    }
}

/// Connects to the first address of `host:port` that accepts, with
/// `TCP_NODELAY` on (requests are small writes followed by a wait).
pub async fn connect_tcp(host: &str, port: u16) -> Result<TcpStream, ConnectError> {
    let addrs = resolve(host, port).await?;
    connect_addrs(&addrs, None).await
}

/// Connects to the first of `addrs` (not empty) that accepts, with
/// `TCP_NODELAY` on. With `per_address`, each attempt gets that long; one
/// that runs out fails with [`io::ErrorKind::TimedOut`] and the next
/// address is tried.
pub async fn connect_addrs(
    addrs: &[SocketAddr],
    per_address: Option<Duration>,
) -> Result<TcpStream, ConnectError> {
    let mut last = None;
    for &addr in addrs {
        let attempt = match per_address {
            Some(limit) => TcpStream::connect_timeout(addr, limit).await.map_err(|e| {
                match io::Error::from(e) {
                    e if e.kind() == io::ErrorKind::TimedOut => io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no answer within {limit:?}"),
                    ),
                    e => e,
                }
            }),
            None => TcpStream::connect(addr).await.map_err(io::Error::from),
        };
        match attempt {
            Ok(stream) => {
                stream.set_nodelay(true).map_err(|e| ConnectError::Tcp {
                    addr,
                    error: e.into(),
                })?;
                return Ok(stream);
            }
            Err(e) => last = Some((addr, e)),
        }
    }
    let (addr, error) = last.expect("connect_addrs needs at least one address");
    Err(ConnectError::Tcp { addr, error })
}

/// The TLS server name for a connect host: an IP address or a DNS name.
pub fn server_name(host: &str) -> Result<ServerName<'static>, String> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ServerName::IpAddress(ip.into()));
    }
    ServerName::try_from(host.to_owned())
        .map_err(|e| format!("invalid TLS server name {host:?}: {e}"))
}

/// Opens a TLS session over `tcp`. An I/O failure during the handshake is
/// [`ConnectError::TlsIo`]; a refusal by either side (certificate, alert) is
/// [`ConnectError::TlsRejected`].
pub async fn connect_tls(
    connector: &TlsConnector,
    name: ServerName<'static>,
    tcp: TcpStream,
) -> Result<TlsStream<TcpStream>, ConnectError> {
    connector.connect(name, tcp).await.map_err(|e| {
        // futures-rustls wraps rustls errors as InvalidData.
        if e.kind() == io::ErrorKind::InvalidData {
            ConnectError::TlsRejected(e.to_string())
        } else {
            ConnectError::TlsIo(e)
        }
    })
}

/// Where the trusted roots come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsTrust {
    /// Load the operating system's roots (`rustls-native-certs`).
    pub system_roots: bool,
    /// An extra PEM bundle (`AWS_CA_BUNDLE` or configuration).
    pub ca_bundle: Option<PathBuf>,
}

/// Why the TLS configuration could not be built.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsConfigError(pub String);

impl fmt::Display for TlsConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TlsConfigError {}

/// Reads every certificate of a PEM bundle.
pub fn read_pem_bundle(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsConfigError> {
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| TlsConfigError(format!("CA bundle {}: {e}", path.display())))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsConfigError(format!("CA bundle {}: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TlsConfigError(format!(
            "CA bundle {} holds no certificate",
            path.display()
        )));
    }
    Ok(certs)
}

/// A rustls client configuration on the `ring` provider: server
/// certificates are always verified (system roots plus the bundle), and
/// ALPN offers `h2` then `http/1.1` when `prefer_http2`, else `http/1.1`.
pub fn tls_client_config(
    trust: &TlsTrust,
    prefer_http2: bool,
) -> Result<Arc<rustls::ClientConfig>, TlsConfigError> {
    let mut roots = rustls::RootCertStore::empty();
    if trust.system_roots {
        let native = rustls_native_certs::load_native_certs();
        for e in &native.errors {
            log::warn!("s3 TLS: loading a system root failed: {e}");
        }
        let (added, ignored) = roots.add_parsable_certificates(native.certs);
        log::debug!("s3 TLS: {added} system roots ({ignored} unparsable)");
    }
    if let Some(path) = &trust.ca_bundle {
        for cert in read_pem_bundle(path)? {
            roots.add(cert).map_err(|e| {
                TlsConfigError(format!(
                    "CA bundle {}: unusable certificate: {e}",
                    path.display()
                ))
            })?;
        }
    }
    if roots.is_empty() {
        return Err(TlsConfigError(
            "no trusted root certificates: the system store is empty and no CA bundle is set"
                .to_owned(),
        ));
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsConfigError(format!("TLS protocol versions: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = if prefer_http2 {
        vec![ALPN_H2.to_vec(), ALPN_HTTP11.to_vec()]
    } else {
        vec![ALPN_HTTP11.to_vec()]
    };
    Ok(Arc::new(config))
}
