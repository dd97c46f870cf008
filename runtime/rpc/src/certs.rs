//! `dfc certs`: a CA, and for each host a certificate and key it signed, laid out so that each
//! host's `--tls-dir` is one directory:
//!
//! ```text
//! OUT/ca.pem            the CA's certificate
//! OUT/ca-key.pem        the CA's key (0600): it stays here, only to sign more hosts later
//! OUT/HOST/ca.pem       the CA's certificate again
//! OUT/HOST/cert.pem     HOST's certificate: its names as subject alternative names
//! OUT/HOST/key.pem      HOST's key (0600)
//! ```
//!
//! A host is named `NAME[,OTHER...]`: `NAME` names its directory, and every name (a DNS name or
//! an IP address) goes into its certificate, so `node1,10.0.0.1` serves workers addressed
//! either way. `localhost` also covers 127.0.0.1 and ::1. Run again with more hosts, it signs
//! them with the CA already in OUT. Every certificate is checked against the CA as a server
//! certificate for each of its names before anything is written.
//!
//! Keys are ECDSA P-256; certificates are valid from the start of this year for ten years, for
//! TLS servers and clients (a worker is both).

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose,
};
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The CA's files in OUT.
const CA_CERT: &str = "ca.pem";
const CA_KEY: &str = "ca-key.pem";
/// The CA's subject, followed by a fingerprint of its key: the same CA has the same subject
/// when `dfc certs` signs more hosts with it, and two CAs have different ones (a certificate
/// from the other then reads as from an unknown issuer, not as a bad signature).
const CA_NAME: &str = "dfc cluster CA";
/// How long certificates are valid, in years.
const YEARS: i32 = 10;

/// What `make` wrote.
pub struct Made {
    /// Whether OUT had no CA and one was made.
    pub new_ca: bool,
    /// Each host's directory, with the names its certificate carries.
    pub hosts: Vec<(PathBuf, Vec<String>)>,
}

/// One host: its directory's name and its certificate's names.
struct Host {
    dir: String,
    names: Vec<String>,
}

/// Parses `NAME[,OTHER...]`; each name must be a DNS name or an IP address.
fn host(spec: &str) -> Result<Host, String> {
    let mut names: Vec<String> = spec.split(',').map(|n| n.trim().to_string()).collect();
    let dir = names[0].clone();
    for name in &names {
        if name.is_empty() || ServerName::try_from(name.as_str()).is_err() {
            return Err(format!("`{name}` (in `{spec}`) is neither a host name nor an IP address"));
        }
    }
    // A name that is an IP address may hold `:` (IPv6), which a directory name should not.
    if dir.starts_with('.') || dir.contains(['/', '\\', ':']) {
        return Err(format!("`{dir}` cannot name a directory: put a host name first (`NAME,{dir}`)"));
    }
    if dir == "localhost" {
        names.extend(["127.0.0.1".to_string(), "::1".to_string()]);
    }
    names.dedup();
    Ok(Host { dir, names })
}

/// This year, from the system clock (the start of the certificates' validity).
fn this_year() -> i32 {
    let seconds = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    // Mean Gregorian years: off by at most a day around New Year, which starts validity a year
    // early at worst.
    1970 + (seconds / 31_556_952) as i32
}

fn ca_params(key: &KeyPair) -> Result<CertificateParams, String> {
    use sha2::Digest;
    let fingerprint: String =
        sha2::Sha256::digest(key.public_key_raw())[..6].iter().map(|b| format!("{b:02x}")).collect();
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(|e| e.to_string())?;
    params.distinguished_name.push(DnType::CommonName, format!("{CA_NAME} {fingerprint}"));
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    params.not_before = rcgen::date_time_ymd(this_year(), 1, 1);
    params.not_after = rcgen::date_time_ymd(this_year() + YEARS, 1, 1);
    Ok(params)
}

/// Makes a CA in `out` (or uses the one there) and a directory per host of `hosts`.
pub fn make(out: &Path, hosts: &[String]) -> Result<Made, String> {
    if hosts.is_empty() {
        return Err("name at least one host: `dfc certs --out DIR HOST...`".into());
    }
    let hosts: Vec<Host> = hosts.iter().map(|h| host(h)).collect::<Result<_, _>>()?;
    for (i, h) in hosts.iter().enumerate() {
        if hosts[..i].iter().any(|other| other.dir == h.dir) {
            return Err(format!("host `{}` is named twice", h.dir));
        }
        let dir = out.join(&h.dir);
        if dir.exists() {
            return Err(format!(
                "`{}` exists already: remove it to make a new certificate for {}",
                dir.display(),
                h.dir
            ));
        }
    }
    let (ca_cert, ca_key) = (out.join(CA_CERT), out.join(CA_KEY));
    let (ca_pem, key, new_ca) = match (ca_cert.exists(), ca_key.exists()) {
        (true, true) => {
            let read = |path: &Path| {
                let bytes = dfc_diag::read::read_at_most(path, crate::tls::MAX_PEM_BYTES)
                    .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
                String::from_utf8(bytes).map_err(|_| format!("`{}` is not PEM text", path.display()))
            };
            let key =
                KeyPair::from_pem(&read(&ca_key)?).map_err(|e| format!("`{}` is not a key: {e}", ca_key.display()))?;
            (read(&ca_cert)?, key, false)
        }
        (false, false) => {
            let key = KeyPair::generate().map_err(|e| e.to_string())?;
            let ca = ca_params(&key)?.self_signed(&key).map_err(|e| e.to_string())?;
            (ca.pem(), key, true)
        }
        _ => {
            return Err(format!(
                "`{}` holds one of {CA_CERT} and {CA_KEY} without the other: give an empty directory, or one where `dfc certs` made a CA",
                out.display()
            ))
        }
    };
    let issuer = Issuer::new(ca_params(&key)?, key);
    let ca_der = certificate(&ca_pem, &ca_cert)?;
    // Everything is made and checked before anything is written.
    let mut made = Vec::new();
    for host in &hosts {
        let key = KeyPair::generate().map_err(|e| e.to_string())?;
        let mut params = CertificateParams::new(host.names.clone()).map_err(|e| format!("{}: {e}", host.dir))?;
        params.distinguished_name.push(DnType::CommonName, host.dir.as_str());
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        params.not_before = rcgen::date_time_ymd(this_year(), 1, 1);
        params.not_after = rcgen::date_time_ymd(this_year() + YEARS, 1, 1);
        let cert = params.signed_by(&key, &issuer).map_err(|e| format!("{}: {e}", host.dir))?;
        check(&ca_der, cert.der(), &host.names).map_err(|e| {
            format!("the certificate made for {} does not verify against `{}`: {e}", host.dir, ca_cert.display())
        })?;
        made.push((host, cert.pem(), key.serialize_pem()));
    }
    if new_ca {
        create_dir(out)?;
        write(&ca_cert, ca_pem.as_bytes(), 0o644)?;
        write(&ca_key, issuer.key().serialize_pem().as_bytes(), 0o600)?;
    }
    let mut hosts = Vec::new();
    for (host, cert, key) in made {
        let dir = out.join(&host.dir);
        create_dir(&dir)?;
        write(&dir.join("ca.pem"), ca_pem.as_bytes(), 0o644)?;
        write(&dir.join("cert.pem"), cert.as_bytes(), 0o644)?;
        write(&dir.join("key.pem"), key.as_bytes(), 0o600)?;
        hosts.push((dir, host.names.clone()));
    }
    Ok(Made { new_ca, hosts })
}

fn certificate(pem: &str, path: &Path) -> Result<CertificateDer<'static>, String> {
    use rustls::pki_types::pem::PemObject;
    CertificateDer::from_pem_slice(pem.as_bytes())
        .map_err(|e| format!("`{}` is not a PEM certificate: {e}", path.display()))
}

/// Whether `cert` verifies against `ca` as a TLS server certificate for every one of `names`
/// (as a worker's peers check it; a client certificate's check is the same chain).
fn check(ca: &CertificateDer<'static>, cert: &CertificateDer<'static>, names: &[String]) -> Result<(), String> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.clone()).map_err(|e| e.to_string())?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(|e| e.to_string())?;
    for name in names {
        let server = ServerName::try_from(name.as_str()).map_err(|e| e.to_string())?.to_owned();
        verifier.verify_server_cert(cert, &[], &server, &[], UnixTime::now()).map_err(|e| format!("{name}: {e}"))?;
    }
    Ok(())
}

fn create_dir(dir: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|e| format!("cannot make `{}`: {e}", dir.display()))
}

/// Writes a new file (never over an old one) with `mode`.
fn write(path: &Path, bytes: &[u8], mode: u32) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(path)
        .map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
    file.write_all(bytes).map_err(|e| format!("cannot write `{}`: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("dfc-certs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn each_host_gets_a_directory_that_loads_and_keys_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let out = scratch("layout");
        let made = make(&out, &["localhost".into(), "node1,10.0.0.1".into()]).unwrap();
        assert!(made.new_ca);
        assert_eq!(made.hosts[0].1, ["localhost", "127.0.0.1", "::1"]);
        assert_eq!(made.hosts[1].1, ["node1", "10.0.0.1"]);
        let mode = |path: PathBuf| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(out.join(CA_KEY)), 0o600);
        for host in ["localhost", "node1"] {
            crate::Tls::load(&out.join(host)).unwrap_or_else(|e| panic!("{host}: {e}"));
            assert_eq!(mode(out.join(host).join("key.pem")), 0o600);
        }
        // Run again: a new host signed by the same CA; an old one is not overwritten.
        let again = make(&out, &["node2".into()]).unwrap();
        assert!(!again.new_ca);
        assert_eq!(std::fs::read(out.join("node2/ca.pem")).unwrap(), std::fs::read(out.join(CA_CERT)).unwrap());
        let error = make(&out, &["node1".into()]).err().unwrap();
        assert!(error.contains("exists already"), "{error}");
        std::fs::remove_dir_all(&out).unwrap();
    }

    #[test]
    fn names_that_are_neither_hosts_nor_addresses_are_refused() {
        let out = scratch("refused");
        for (spec, says) in [
            ("no spaces", "neither"),
            ("node1,", "neither"),
            ("../etc", "neither"),
            ("::1", "cannot name a directory"),
            ("a,a\u{e9}", "neither"),
        ] {
            let error = make(&out, &[spec.to_string()]).err().unwrap_or_else(|| panic!("{spec} accepted"));
            assert!(error.contains(says), "{spec}: {error}");
        }
        let error = make(&out, &["node1".into(), "node1,10.0.0.1".into()]).err().unwrap();
        assert!(error.contains("named twice"), "{error}");
        assert!(make(&out, &[]).is_err());
        assert!(!out.exists(), "nothing is written when a host is refused");
    }
}
