//! The plan file: a 24-byte header, then the postcard-encoded `Plan`.
//!
//! | offset | size | field                                   |
//! |--------|------|-----------------------------------------|
//! | 0      | 8    | magic `b"DFCPLAN\0"`                    |
//! | 8      | 4    | format version, u32 LE                  |
//! | 12     | 8    | payload length, u64 LE                  |
//! | 20     | 4    | CRC-32 of the payload, u32 LE           |
//! | 24     | n    | payload                                 |
//!
//! The header is checked field by field before the payload is parsed, so each way a file can
//! be wrong (not a plan, other version, truncated, corrupted) gets its own message.

use crate::Plan;
use std::io::Write as _;
use std::path::Path;
use thiserror::Error;

pub const MAGIC: [u8; 8] = *b"DFCPLAN\0";
/// Bump on any change to the header or to the serialized types (postcard is not
/// self-describing: adding a field changes the format).
pub const FORMAT_VERSION: u32 = 15;
pub const HEADER_LEN: usize = 24;

#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlanError {
    #[error("the file is {len} bytes, too short to be a dfc plan (truncated?)")]
    TooShort { len: usize },
    #[error("not a dfc plan: the file does not start with the DFCPLAN magic bytes")]
    NotAPlan,
    #[error("the plan has format version {found} but this dfc reads version {FORMAT_VERSION}; use a newer dfc")]
    NewerVersion { found: u32 },
    #[error("the plan has format version {found} but this dfc reads version {FORMAT_VERSION}; recompile the model")]
    OlderVersion { found: u32 },
    #[error("the plan is truncated: expected {expected} payload bytes, found {found}")]
    Truncated { expected: u64, found: u64 },
    #[error("the plan has {extra} unexpected bytes after its end (corrupted, or two files joined?)")]
    TrailingBytes { extra: u64 },
    #[error("the plan is corrupted: checksum mismatch (header says {expected:#010x}, content has {found:#010x}); recompile the model")]
    ChecksumMismatch { expected: u32, found: u32 },
    #[error("the plan's content cannot be read: {0}")]
    Malformed(String),
    #[error("the plan is not valid: {0}")]
    Invalid(String),
}

pub fn encode(plan: &Plan) -> Vec<u8> {
    // Serializing our own types into memory fails only if a type cannot be serialized at all
    // (a bug caught by any test), never because of the data.
    let payload = postcard::to_allocvec(plan).expect("a Plan always serializes");
    let mut bytes = Vec::with_capacity(HEADER_LEN + payload.len());
    bytes.extend_from_slice(&MAGIC);
    bytes.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    bytes.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    bytes.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    bytes.extend_from_slice(&payload);
    bytes
}

/// Reads a plan and checks its content in full (`validate.rs`): what it returns may be run.
/// Never panics: every malformed or invalid input is an `Err` that says what is wrong.
pub fn decode(bytes: &[u8]) -> Result<Plan, PlanError> {
    // The magic first, even in a short file: a short file that is not a plan prefix is "not a
    // plan", not "truncated".
    let magic_len = bytes.len().min(MAGIC.len());
    if bytes[..magic_len] != MAGIC[..magic_len] {
        return Err(PlanError::NotAPlan);
    }
    if bytes.len() < HEADER_LEN {
        return Err(PlanError::TooShort { len: bytes.len() });
    }
    let (header, payload) = bytes.split_at(HEADER_LEN);
    let u32_at = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().expect("4 bytes"));
    let version = u32_at(8);
    let length = u64::from_le_bytes(header[12..20].try_into().expect("8 bytes"));
    let checksum = u32_at(20);

    if version > FORMAT_VERSION {
        return Err(PlanError::NewerVersion { found: version });
    }
    if version < FORMAT_VERSION {
        return Err(PlanError::OlderVersion { found: version });
    }
    let found = payload.len() as u64;
    if found < length {
        return Err(PlanError::Truncated { expected: length, found });
    }
    if found > length {
        return Err(PlanError::TrailingBytes { extra: found - length });
    }
    let actual = crc32fast::hash(payload);
    if actual != checksum {
        return Err(PlanError::ChecksumMismatch { expected: checksum, found: actual });
    }

    let malformed = |e: postcard::Error| PlanError::Malformed(e.to_string());
    let (mut plan, rest): (Plan, &[u8]) = postcard::take_from_bytes(payload).map_err(malformed)?;
    if !rest.is_empty() {
        return Err(PlanError::Malformed(format!("{} bytes follow the plan", rest.len())));
    }
    plan.expand_instances().map_err(PlanError::Invalid)?;
    crate::validate::validate(&plan).map_err(PlanError::Invalid)?;
    Ok(plan)
}

/// Writes `plan` to `path` atomically: into a temporary file in the same directory, then
/// renamed over `path`, so a reader never sees half a plan and a failed write leaves any
/// previous plan intact.
pub fn write(path: impl AsRef<Path>, plan: &Plan) -> std::io::Result<()> {
    let path = path.as_ref();
    let name = path.file_name().ok_or_else(|| {
        std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("`{}` is not a file path", path.display()))
    })?;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    // Same directory: a rename across file systems is not atomic (or fails).
    let mut tmp_name = std::ffi::OsString::from(".");
    tmp_name.push(name);
    tmp_name.push(format!(".{}.tmp", std::process::id()));
    let tmp = dir.join(tmp_name);

    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&encode(plan))?;
        // Flush to disk before the rename, else a crash can leave `path` empty.
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
