//! TLS with client certificates (rustls), and where plain connections are allowed.
//!
//! With `--tls-dir DIR`, every connection is encrypted and each side proves itself with a
//! certificate that the directory's CA signed: driver to worker and worker to worker over gRPC
//! (through tonic), and worker to worker on the data plane (rustls on the data connections,
//! with the same files). DIR holds `ca.pem` (the CA that signs every node's certificate),
//! `cert.pem` and `key.pem` (this node's certificate and key), as `dfc certs` writes them.
//!
//! Without it, nothing is encrypted, so a plain connection is allowed only on loopback: a
//! worker will not listen beyond it ([`plaintext_listener`]), and neither a driver nor a
//! worker sends the token (or a proof of it, or a tensor) to an address beyond it
//! ([`plaintext_address`]). Reading loopback traffic takes root on that machine, which can
//! read the token from the processes' memory anyway.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity, ServerTlsConfig};

/// The data plane's ALPN protocol: a data connection is never taken for a gRPC one.
const DATA_ALPN: &[u8] = b"dfc-data/2";

/// The most a PEM file of a `--tls-dir` (or of `dfc certs`' CA) may hold: a certificate or key
/// takes a few KiB.
pub(crate) const MAX_PEM_BYTES: u64 = 1 << 20;

#[derive(Clone)]
pub struct Tls {
    ca: Certificate,
    identity: Identity,
    /// The data plane's ends, from the same files.
    data_server: Arc<rustls::ServerConfig>,
    data_client: Arc<rustls::ClientConfig>,
}

impl Tls {
    /// Reads `ca.pem`, `cert.pem` and `key.pem` from `dir`; each must hold what its name says.
    pub fn load(dir: &Path) -> Result<Tls, String> {
        let read = |name: &str| {
            dfc_diag::read::read_at_most(&dir.join(name), MAX_PEM_BYTES)
                .map_err(|e| format!("cannot read `{}`: {e}", dir.join(name).display()))
        };
        let (ca, cert, key) = (read("ca.pem")?, read("cert.pem")?, read("key.pem")?);
        let (data_server, data_client) = data_configs(dir, &ca, &cert, &key)?;
        Ok(Tls {
            ca: Certificate::from_pem(ca),
            identity: Identity::from_pem(cert, key),
            data_server: Arc::new(data_server),
            data_client: Arc::new(data_client),
        })
    }

    pub(crate) fn server(&self) -> ServerTlsConfig {
        ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
            .timeout(crate::limits::UNPROVEN_DEADLINE)
    }

    fn client(&self, host: &str) -> ClientTlsConfig {
        ClientTlsConfig::new().ca_certificate(self.ca.clone()).identity(self.identity.clone()).domain_name(host)
    }

    pub(crate) fn data_server(&self) -> Arc<rustls::ServerConfig> {
        self.data_server.clone()
    }

    pub(crate) fn data_client(&self) -> Arc<rustls::ClientConfig> {
        self.data_client.clone()
    }
}

/// The data plane's server and client configurations: TLS 1.3, the CA's certificates only,
/// a client certificate required, no session tickets (nothing crosses a data connection
/// after its handshake but frames, see `crate::data`).
fn data_configs(
    dir: &Path,
    ca: &[u8],
    cert: &[u8],
    key: &[u8],
) -> Result<(rustls::ServerConfig, rustls::ClientConfig), String> {
    let at = |name: &str| dir.join(name).display().to_string();
    let certificates = |pem: &[u8], name: &str| {
        let certificates: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(pem)
            .collect::<Result<_, _>>()
            .map_err(|e| format!("`{}` is not PEM certificates: {e}", at(name)))?;
        if certificates.is_empty() {
            return Err(format!("`{}` holds no certificate", at(name)));
        }
        Ok(certificates)
    };
    let mut roots = rustls::RootCertStore::empty();
    for certificate in certificates(ca, "ca.pem")? {
        roots.add(certificate).map_err(|e| format!("`{}`: {e}", at("ca.pem")))?;
    }
    let roots = Arc::new(roots);
    let chain = certificates(cert, "cert.pem")?;
    let key =
        PrivateKeyDer::from_pem_slice(key).map_err(|e| format!("`{}` holds no private key: {e}", at("key.pem")))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls13 = [&rustls::version::TLS13];
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| format!("`{}`: {e}", at("ca.pem")))?;
    let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&tls13)
        .map_err(|e| e.to_string())?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain.clone(), key.clone_key())
        .map_err(|e| format!("`{}` and `{}`: {e}", at("cert.pem"), at("key.pem")))?;
    server.send_tls13_tickets = 0;
    server.alpn_protocols = vec![DATA_ALPN.to_vec()];
    let mut client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&tls13)
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .map_err(|e| format!("`{}` and `{}`: {e}", at("cert.pem"), at("key.pem")))?;
    client.alpn_protocols = vec![DATA_ALPN.to_vec()];
    client.resumption = rustls::client::Resumption::disabled();
    Ok((server, client))
}

/// What to do instead of talking in clear beyond loopback.
const USE_TLS: &str = "give --tls-dir DIR (`dfc certs --out DIR HOST...` makes one for each host)";

/// Refuses to serve without TLS on `address` unless it is a loopback address: the token and
/// the tensors would cross the network in clear.
pub fn plaintext_listener(address: SocketAddr) -> Result<(), String> {
    if address.ip().is_loopback() {
        return Ok(());
    }
    Err(format!(
        "a worker listening on {address} without TLS would take the token and the tensors in clear over the network: {USE_TLS}, or listen on 127.0.0.1"
    ))
}

/// The address to talk to in clear for `address` (host:port): its host must resolve to
/// loopback addresses only, and the one returned is the one to connect to (not resolved again,
/// so that a name cannot point elsewhere the second time): an IPv4 one if there is one, as
/// workers listen on 127.0.0.1 unless told otherwise, where `localhost` often resolves to ::1
/// first.
pub fn plaintext_address(address: &str) -> Result<SocketAddr, String> {
    let resolved: Vec<SocketAddr> =
        address.to_socket_addrs().map_err(|e| format!("worker address `{address}`: {e}"))?.collect();
    match resolved.iter().find(|a| a.is_ipv4()).or(resolved.first()) {
        Some(first) if resolved.iter().all(|a| a.ip().is_loopback()) => Ok(*first),
        Some(_) => Err(format!(
            "worker address `{address}` is not on this machine's loopback, and without TLS the token and the tensors would cross the network in clear: {USE_TLS}"
        )),
        None => Err(format!("worker address `{address}` resolves to no address")),
    }
}

/// The host part of `address` (host:port), without an IPv6 address's brackets: the name its
/// certificate must carry.
pub(crate) fn host_of(address: &str) -> &str {
    dfc_ir::address_host(address)
}

/// The endpoint of the worker at `address` (host:port): TLS when `tls` is given, else only on
/// loopback; Nagle off, large HTTP/2 windows (see `crate::STREAM_WINDOW`).
pub fn endpoint(address: &str, tls: Option<&Tls>) -> Result<Endpoint, String> {
    let uri = match tls {
        Some(_) => format!("https://{address}"),
        None => format!("http://{}", plaintext_address(address)?),
    };
    let mut endpoint = Endpoint::from_shared(uri)
        .map_err(|e| format!("worker address `{address}`: {e}"))?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        .initial_stream_window_size(Some(crate::STREAM_WINDOW))
        .initial_connection_window_size(Some(crate::CONNECTION_WINDOW));
    if let Some(tls) = tls {
        endpoint =
            endpoint.tls_config(tls.client(host_of(address))).map_err(|e| format!("TLS for `{address}`: {e}"))?;
    }
    Ok(endpoint)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_connections_only_on_loopback() {
        for address in ["127.0.0.1:7000", "[::1]:7000", "localhost:7000", "127.1.2.3:1"] {
            assert!(plaintext_address(address).is_ok_and(|a| a.ip().is_loopback()), "{address}");
        }
        assert!(plaintext_address("localhost:7000").unwrap().is_ipv4(), "where workers listen by default");
        for address in ["192.0.2.1:7000", "10.0.0.1:1", "[2001:db8::1]:7000", "0.0.0.0:7000"] {
            let error = plaintext_address(address).unwrap_err();
            assert!(error.contains("in clear") && error.contains("dfc certs"), "{address}: {error}");
        }
        assert!(plaintext_listener("127.0.0.1:0".parse().unwrap()).is_ok());
        for address in ["0.0.0.0:7000", "[::]:7000", "192.0.2.1:7000"] {
            let error = plaintext_listener(address.parse().unwrap()).unwrap_err();
            assert!(error.contains("--tls-dir") && error.contains("dfc certs"), "{address}: {error}");
        }
    }

    #[test]
    fn files_that_are_not_what_their_names_say_are_refused_by_name() {
        let dir = std::env::temp_dir().join(format!("dfc-tls-load-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("ca.pem"), "not a certificate").unwrap();
        std::fs::write(dir.join("cert.pem"), "").unwrap();
        std::fs::write(dir.join("key.pem"), "").unwrap();
        let error = Tls::load(&dir).err().expect("refused");
        assert!(error.contains("ca.pem") && error.contains("no certificate"), "{error}");
        std::fs::remove_file(dir.join("key.pem")).unwrap();
        let error = Tls::load(&dir).err().expect("refused");
        assert!(error.contains("key.pem"), "{error}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
