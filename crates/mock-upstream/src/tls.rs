//! An optional HTTPS front for a running [`crate::MockUpstream`]: it terminates TLS
//! with a certificate the caller gives (tests generate one under their own CA) and
//! forwards the bytes to the mock's plain listener, so every behaviour of the mock is
//! served over TLS unchanged. rustls with ring, like the rest of polygw.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::TlsAcceptor;

/// A TLS listener in front of a mock upstream. Dropping it stops the accept loop and
/// every connection it forwards.
#[derive(Debug)]
pub struct TlsFront {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

fn invalid(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{what}: {e}"))
}

impl TlsFront {
    /// Listens on `127.0.0.1:0` with `cert_chain_pem` (the server certificate first,
    /// then its issuers) and `key_pem`, forwarding each connection to `backend` (the
    /// mock's [`crate::MockUpstream::addr`]).
    pub async fn start(
        backend: SocketAddr,
        cert_chain_pem: &str,
        key_pem: &str,
    ) -> io::Result<TlsFront> {
        let chain: Vec<CertificateDer<'static>> =
            CertificateDer::pem_slice_iter(cert_chain_pem.as_bytes())
                .collect::<Result<_, _>>()
                .map_err(|e| invalid("certificate chain PEM", e))?;
        if chain.is_empty() {
            return Err(invalid("certificate chain PEM", "no certificate"));
        }
        let key = PrivateKeyDer::from_pem_slice(key_pem.as_bytes())
            .map_err(|e| invalid("private key PEM", e))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("TLS versions", e))?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(|e| invalid("certificate and key", e))?;
        let acceptor = TlsAcceptor::from(Arc::new(config));
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            loop {
                let Ok((tcp, _)) = listener.accept().await else {
                    continue;
                };
                let acceptor = acceptor.clone();
                conns.spawn(async move {
                    // A failed handshake (an untrusting client) just ends the connection.
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    let Ok(mut plain) = TcpStream::connect(backend).await else {
                        return;
                    };
                    let _ = tokio::io::copy_bidirectional(&mut tls, &mut plain).await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Ok(TlsFront { addr, task })
    }

    /// The TLS listener's address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `https://HOST:PORT/v1`: `host` must be a name the certificate carries.
    pub fn base_url(&self, host: &str) -> String {
        format!("https://{host}:{}/v1", self.addr.port())
    }
}

impl Drop for TlsFront {
    fn drop(&mut self) {
        self.task.abort();
    }
}
