//! The language server's stdio transport: LSP's base protocol (`Content-Length` headers, then
//! a JSON body) read within bounds. lsp-server's own transport sizes its buffer by whatever
//! `Content-Length` says and reads header lines of any length, so one bad header from a client
//! could take the machine's memory; here a header line past 8 KiB or a body past 64 MiB ends
//! the session with an error naming it.

use std::io::{self, BufRead, Read};
use std::thread::JoinHandle;

use crossbeam_channel::bounded;
use lsp_server::{Connection, Message};

/// The longest header line accepted (`Content-Length: N`, `Content-Type: ...`).
const MAX_HEADER_LINE: u64 = 8 << 10;
/// The largest message body accepted: a document at dfc's source limit, escaped as JSON.
const MAX_BODY: usize = 64 << 20;

/// The reading and writing threads behind a [`Connection`].
pub struct IoThreads {
    reader: JoinHandle<io::Result<()>>,
    writer: JoinHandle<io::Result<()>>,
}

impl IoThreads {
    /// Waits for both threads (the writer ends when the connection is dropped): the first error.
    pub fn join(self) -> io::Result<()> {
        let reader = self.reader.join().unwrap_or_else(|_| Err(io::Error::other("the reader panicked")));
        let writer = self.writer.join().unwrap_or_else(|_| Err(io::Error::other("the writer panicked")));
        reader.and(writer)
    }
}

/// A connection on this process's stdin and stdout.
pub fn stdio() -> (Connection, IoThreads) {
    let (to_client, outgoing) = bounded::<Message>(0);
    let writer = std::thread::spawn(move || {
        let mut stdout = io::stdout().lock();
        outgoing.into_iter().try_for_each(|message| message.write(&mut stdout))
    });
    let (incoming, from_client) = bounded::<Message>(0);
    let reader = std::thread::spawn(move || {
        let mut stdin = io::stdin().lock();
        while let Some(message) = read_message(&mut stdin)? {
            let exit = matches!(&message, Message::Notification(n) if n.method == "exit");
            if incoming.send(message).is_err() || exit {
                break;
            }
        }
        Ok(())
    });
    (Connection { sender: to_client, receiver: from_client }, IoThreads { reader, writer })
}

/// The next message, or `None` at the end of the input before one begins.
pub fn read_message(input: &mut impl BufRead) -> io::Result<Option<Message>> {
    let mut length = None;
    let (mut line, mut started) = (String::new(), false);
    loop {
        line.clear();
        if input.take(MAX_HEADER_LINE).read_line(&mut line)? == 0 {
            return if started { Err(invalid("the input ended within a message's headers")) } else { Ok(None) };
        }
        started = true;
        let Some(header) = line.strip_suffix("\r\n") else {
            return Err(invalid(if line.len() as u64 >= MAX_HEADER_LINE {
                format!("a header line longer than {} KiB", MAX_HEADER_LINE >> 10)
            } else {
                format!("a header line that does not end in CR LF: {:?}", shorten(&line))
            }));
        };
        if header.is_empty() {
            break;
        }
        let (name, value) =
            header.split_once(": ").ok_or_else(|| invalid(format!("a malformed header: {:?}", shorten(header))))?;
        if name.eq_ignore_ascii_case("Content-Length") {
            let bytes = value
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|&bytes| bytes <= MAX_BODY)
                .ok_or_else(|| invalid(format!("Content-Length {value}: a body of 0 to {} MiB", MAX_BODY >> 20)))?;
            length = Some(bytes);
        }
    }
    let length = length.ok_or_else(|| invalid("a message without a Content-Length header"))?;
    let mut body = vec![0; length];
    input.read_exact(&mut body)?;
    serde_json::from_slice(&body).map(Some).map_err(|e| invalid(format!("a body that is no LSP message: {e}")))
}

fn invalid(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// The first 80 characters of `text`, for a message.
fn shorten(text: &str) -> String {
    text.chars().take(80).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(bytes: &[u8]) -> io::Result<Option<Message>> {
        read_message(&mut io::Cursor::new(bytes))
    }

    #[test]
    fn a_message_is_read_from_its_headers_and_body() {
        let body = r#"{"jsonrpc":"2.0","method":"exit"}"#;
        let framed =
            format!("Content-Type: application/vscode-jsonrpc\r\nContent-Length: {}\r\n\r\n{body}", body.len());
        let Some(Message::Notification(n)) = read(framed.as_bytes()).unwrap() else { panic!("a notification") };
        assert_eq!(n.method, "exit");
        assert!(read(b"").unwrap().is_none());
    }

    #[test]
    fn lengths_and_headers_past_their_bounds_are_errors_not_allocations() {
        let error = read(b"Content-Length: 100000000000\r\n\r\n").unwrap_err();
        assert!(error.to_string().contains("a body of 0 to 64 MiB"), "{error}");
        let error = read(b"Content-Length: 99999999999999999999999\r\n\r\n").unwrap_err();
        assert!(error.to_string().contains("Content-Length 99999999999999999999999"), "{error}");
        let endless = vec![b'x'; 1 << 20];
        let error = read(&endless).unwrap_err();
        assert!(error.to_string().contains("longer than 8 KiB"), "{error}");
        for bad in [
            &b"Content-Length 5\r\n\r\n"[..],
            b"\r\n",
            b"Content-Type: x\r\n",
            b"Content-Length: 5\r\n",
            b"Content-Length: 5\r\n\r\n{\"a\":",
        ] {
            assert!(read(bad).is_err(), "{:?}", String::from_utf8_lossy(bad));
        }
    }
}
