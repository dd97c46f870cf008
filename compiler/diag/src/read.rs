//! Reading the files dfc is given, within bounds: a file named on a command line or in a plan
//! may be a device that never ends (`/dev/zero`), a pipe, or just far larger than any source,
//! plan or cluster is; reading it whole would take the machine's memory.

use std::fs::{File, OpenOptions};
use std::io::{Error, ErrorKind, Read};
use std::path::Path;

/// The most a `.df` source may hold (the largest models written are a few hundred KiB).
pub const MAX_SOURCE_BYTES: u64 = 16 << 20;

/// The file at `path`, refused (`ErrorKind::FileTooLarge`) past `limit` bytes, read no further
/// than that. Pipes and `/dev/stdin` are read like files: the user named them.
pub fn read_at_most(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    read_stream_at_most(File::open(path)?, limit)
}

/// As [`read_at_most`], for a name that came from data rather than from the user (a plan's
/// source file): only a regular file is read, and opening a FIFO does not wait for a writer.
pub fn read_regular_at_most(path: &Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = OpenOptions::new().read(true).custom_flags(libc::O_NONBLOCK).open(path)?;
    if !file.metadata()?.is_file() {
        return Err(Error::new(ErrorKind::InvalidInput, "it is not a regular file"));
    }
    read_stream_at_most(file, limit)
}

/// As [`read_at_most`], from a stream (standard input).
pub fn read_stream_at_most(stream: impl Read, limit: u64) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    stream.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(Error::new(ErrorKind::FileTooLarge, format!("it holds more than {}", size(limit))));
    }
    Ok(bytes)
}

/// `64 MiB`, `16 KiB` or `100 bytes`.
fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endless_device_is_refused_after_the_limit() {
        let error = read_at_most(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert_eq!(error.kind(), ErrorKind::FileTooLarge);
        assert_eq!(error.to_string(), "it holds more than 1 MiB");
        let error = read_regular_at_most(Path::new("/dev/zero"), 1 << 20).unwrap_err();
        assert_eq!(error.to_string(), "it is not a regular file");
    }

    #[test]
    fn files_up_to_the_limit_are_read_whole() {
        let path = std::env::temp_dir().join(format!("dfc-diag-read-{}", std::process::id()));
        std::fs::write(&path, b"0123456789").unwrap();
        assert_eq!(read_at_most(&path, 10).unwrap(), b"0123456789");
        assert_eq!(read_regular_at_most(&path, 10).unwrap(), b"0123456789");
        assert_eq!(read_at_most(&path, 9).unwrap_err().to_string(), "it holds more than 9 bytes");
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_fifo_without_a_writer_is_refused_at_once() {
        let path = std::env::temp_dir().join(format!("dfc-diag-fifo-{}", std::process::id()));
        let name = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: `name` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
        let error = read_regular_at_most(&path, 1 << 20).unwrap_err();
        assert_eq!(error.to_string(), "it is not a regular file");
        std::fs::remove_file(&path).unwrap();
    }
}
