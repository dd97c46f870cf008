//! TLS with client certificates (rustls, through tonic), as an option beside the token: with
//! `--tls-dir DIR`, every connection — driver to worker, worker to worker — is encrypted, and
//! each side proves itself with a certificate that the directory's CA signed.
//!
//! DIR holds `ca.pem` (the CA that signs every node's certificate), `cert.pem` and `key.pem`
//! (this node's certificate and key; one pair may serve all nodes when its subject names cover
//! their hosts). A worker refuses connections without a client certificate from that CA.

use std::path::Path;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

#[derive(Clone)]
pub struct Tls {
    ca: Certificate,
    identity: Identity,
}

impl Tls {
    /// Reads `ca.pem`, `cert.pem` and `key.pem` from `dir`.
    pub fn load(dir: &Path) -> Result<Tls, String> {
        let read = |name: &str| {
            std::fs::read(dir.join(name)).map_err(|e| format!("cannot read `{}`: {e}", dir.join(name).display()))
        };
        Ok(Tls {
            ca: Certificate::from_pem(read("ca.pem")?),
            identity: Identity::from_pem(read("cert.pem")?, read("key.pem")?),
        })
    }

    pub(crate) fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new().identity(self.identity.clone()).client_ca_root(self.ca.clone())
    }

    fn client(&self, host: &str) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(self.ca.clone()).identity(self.identity.clone()).domain_name(host)
    }
}

/// The endpoint of the worker at `address` (host:port): TLS when `tls` is given, Nagle off,
/// large HTTP/2 windows (see `crate::STREAM_WINDOW`).
pub fn endpoint(address: &str, tls: Option<&Tls>) -> Result<Endpoint, String> {
    let scheme = if tls.is_some() { "https" } else { "http" };
    let mut endpoint = Endpoint::from_shared(format!("{scheme}://{address}"))
        .map_err(|e| format!("worker address `{address}`: {e}"))?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(crate::STREAM_WINDOW))
        .initial_connection_window_size(Some(crate::CONNECTION_WINDOW));
    if let Some(tls) = tls {
        let host = address.rsplit_once(':').map_or(address, |(host, _)| host).trim_matches(['[', ']']);
        endpoint = endpoint.tls_config(tls.client(host)).map_err(|e| format!("TLS for `{address}`: {e}"))?;
    }
    Ok(endpoint)
}
