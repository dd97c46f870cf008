//! The shared token. TensorFlow's gRPC server accepts anyone and runs whatever graph it is
//! sent; a dfc worker answers only calls that carry the token it was started with
//! (`authorization: Bearer TOKEN`), compared in constant time, and runs only plans that such a
//! call registered.
//!
//! Where the token may travel this way: see `crate::tls` (TLS beyond loopback, always).

use subtle::ConstantTimeEq;
use tonic::metadata::MetadataValue;
use tonic::{Request, Status};

/// The environment variable that holds the token when no `--token-file` is given.
pub const TOKEN_VARIABLE: &str = "DFC_TOKEN";

/// The most a token file may hold: its first line is the token.
const MAX_TOKEN_FILE_BYTES: u64 = 64 << 10;

/// The token from `file` (its first line, trimmed) or else from `DFC_TOKEN`.
pub fn load_token(file: Option<&std::path::Path>) -> Result<String, String> {
    let token = match file {
        Some(path) => String::from_utf8_lossy(
            &dfc_diag::read::read_at_most(path, MAX_TOKEN_FILE_BYTES)
                .map_err(|e| format!("cannot read the token file `{}`: {e}", path.display()))?,
        )
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .to_string(),
        None => std::env::var(TOKEN_VARIABLE).map_err(|_| {
            format!("no token: give --token-file FILE or set {TOKEN_VARIABLE} (workers refuse calls without one)")
        })?,
    };
    if token.len() < 16 {
        return Err(
            "the token is shorter than 16 characters; use a long random one (e.g. `openssl rand -hex 32`)".into()
        );
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("the token must be printable ASCII without spaces".into());
    }
    Ok(token)
}

/// `N` bytes from the OS's random source (`getrandom`): tokens, nonces, shared-memory names
/// and secrets.
pub fn random_bytes<const N: usize>() -> [u8; N] {
    let mut bytes = [0u8; N];
    // Linux's getrandom(2) fails only before the kernel's pool is first seeded (long before a
    // worker starts) or without the call at all (kernels before 3.17, which the crate then
    // reads /dev/urandom for); with no randomness at all there is nothing safe to go on with.
    getrandom::fill(&mut bytes).expect("the OS's random source (getrandom) failed");
    bytes
}

/// A fresh random token: 256 bits from the OS, as 64 hex digits (for the workers `dfc run
/// --spawn` starts, and wherever a secret name is needed).
pub fn random_token() -> String {
    random_bytes::<32>().iter().map(|b| format!("{b:02x}")).collect()
}

/// Checks each incoming call's token (a tonic interceptor).
#[derive(Clone)]
pub struct CheckToken {
    expected: std::sync::Arc<Vec<u8>>,
}

impl CheckToken {
    pub fn new(token: &str) -> CheckToken {
        CheckToken { expected: std::sync::Arc::new(format!("Bearer {token}").into_bytes()) }
    }
}

impl tonic::service::Interceptor for CheckToken {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        let given = request.metadata().get("authorization").map(|v| v.as_bytes()).unwrap_or(b"");
        // `ct_eq` on slices of different lengths is false without looking at the bytes.
        if bool::from(given.ct_eq(self.expected.as_slice())) {
            // The connection has proven the token: it is no longer held to the deadline and
            // the cap of connections that have not (`crate::limits`).
            if let Some(caller) = request.extensions().get::<crate::limits::Caller>() {
                caller.proven();
            }
            Ok(request)
        } else {
            Err(Status::unauthenticated("missing or wrong token"))
        }
    }
}

/// Adds the token to each outgoing call (a tonic interceptor).
#[derive(Clone)]
pub struct AddToken {
    value: MetadataValue<tonic::metadata::Ascii>,
}

impl AddToken {
    pub fn new(token: &str) -> AddToken {
        AddToken { value: format!("Bearer {token}").parse().expect("tokens are printable ASCII") }
    }
}

impl tonic::service::Interceptor for AddToken {
    fn call(&mut self, mut request: Request<()>) -> Result<Request<()>, Status> {
        request.metadata_mut().insert("authorization", self.value.clone());
        Ok(request)
    }
}
