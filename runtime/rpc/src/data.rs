//! The data plane: TCP connections (in TLS with `--tls-dir`) between workers for the ring
//! all-reduce's segments and the tensors sent to other workers' Recvs, beside gRPC, which keeps
//! every control call.
//!
//! Over gRPC a segment cost an HTTP/2 stream, protobuf framing and a copy into one buffer on
//! arrival; here a segment is written straight from the tensor's memory in chunks
//! ([`DATA_CHUNK`]) and each chunk is summed into the receiver's tensor as soon as it has
//! arrived, while the next is still on the wire.
//!
//! - Each worker listens on a second port ([`serve`]); `Health` tells its number, and the driver
//!   gives every worker the others' ports with the registration.
//! - A connection goes one way, from a sender to a receiver, and is opened on first use; it
//!   serves one registration (or benchmark), named in its handshake.
//! - Handshake, a mutual proof of the token bound to the connection and the registration:
//!   the receiver sends a fresh 256-bit nonce; the sender answers with a nonce of its own, the
//!   registration's id and HMAC-SHA256(token; "sender", both nonces, id); the receiver checks
//!   it in constant time and answers one status byte and, if it accepts, HMAC-SHA256(token;
//!   "receiver", both nonces, id), which the sender checks. The token itself never crosses the
//!   wire; a proof seen once is worth nothing on another connection (other nonces).
//! - Before the proof, a connection costs its receiver a tokio task, not a thread, for at most
//!   [`crate::limits::UNPROVEN_DEADLINE`], and at most [`crate::limits::MAX_UNPROVEN`] of them
//!   wait at once (a new one closes the oldest); a proven connection gets its reader thread.
//! - With TLS (`--tls-dir`), each connection is TLS 1.3 with client certificates from the
//!   same CA as gRPC's, and the handshake and frames run inside it. Without it the receiver
//!   listens on loopback only and senders connect to loopback addresses only (`crate::tls`).
//! - Then frames: a fixed header (step, key length, the segment's length, the chunk's offset
//!   and length), the key, the chunk's bytes. A frame that does not parse closes the
//!   connection; the step it was for then fails on its deadline or by the driver's abort.
//!
//! - Between workers on one machine, the sender offers a queue in shared memory right after
//!   the handshake (a frame of its own magic naming the queue, see [`crate::shm`]); if the
//!   receiver can open it, every later frame goes through the queue and the TCP connection
//!   only tells each side that the other is alive. Elsewhere the offer is declined and frames
//!   go over TCP.

use crate::limits::{Admitted, Unproven, MAX_UNPROVEN, UNPROVEN_DEADLINE};
use crate::shm;
use hmac::{Hmac, Mac};
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The bytes of one frame at most, as sent: small enough that a segment is summed while its
/// rest is in flight, large enough that a frame costs few system calls.
pub const DATA_CHUNK: usize = 1 << 20;
/// The largest chunk a receiver accepts over TCP (a sender's chunks may be smaller); a queue's
/// slots hold [`shm::CHUNK`].
const MAX_CHUNK: u64 = 16 << 20;
const MAX_KEY: u32 = 4096;
/// The first bytes each side sends (the version of the handshake).
const MAGIC: &[u8; 8] = b"dfcdata2";
const NONCE: usize = 32;
const PROOF: usize = 32;
/// The longest registration (or benchmark) id a handshake names.
const MAX_ID: usize = 256;
/// What the receiver sends first: the magic and its nonce.
const GREETING: usize = 8 + NONCE;
/// The fixed part of what the sender answers: the magic, its nonce, its proof, the id's length.
const HELLO: usize = 8 + NONCE + PROOF + 2;
const FRAME_MAGIC: u32 = 0x6466_6331;
/// The magic of a frame offering a shared-memory queue: its key is the queue's name, its
/// chunk the queue's secret; the receiver answers one status byte.
const OFFER_MAGIC: u32 = 0x6466_6373;
const HEADER: usize = 40;

/// Status bytes of the handshake's answer.
const ACCEPTED: u8 = 0;
const BAD_TOKEN: u8 = 1;
const UNKNOWN_ID: u8 = 2;

/// Where a receiver's chunks go: the rendezvous of their step in the registration (or
/// benchmark) that a connection names.
pub trait Deliver: Send + Sync {
    /// A chunk of `len` bytes at `offset` in a segment of `total` sent under `key` in `step`.
    fn deliver_chunk(&self, step: u64, key: &str, total: u64, offset: u64, chunk: Chunk) -> Result<(), String>;

    /// Where such a chunk goes, if it is for a ring under way: the reader then reads it there
    /// (or sums it into what is there) and calls `placed`.
    fn place(&self, step: u64, key: &str, total: u64, offset: u64, len: u64) -> Option<Placement>;

    /// The chunk given to `place` has been read (`ok`), or its connection failed midway.
    fn placed(&self, step: u64, key: &str, offset: u64, len: u64, ok: bool);

    /// How long the rest of a chunk may take to come once its header has.
    fn chunk_timeout(&self) -> Duration;
}

/// Memory lent to the reader for one chunk, until it calls [`Deliver::placed`].
pub struct Placement {
    pub(crate) at: *mut u8,
    pub(crate) len: usize,
    /// How to combine the chunk's bytes with what is there (`None`: they replace it).
    pub(crate) combine: Option<Combine>,
}

/// Combines bytes into others in place (a sum of little-endian elements).
pub type Combine = fn(&mut [u8], &[u8]);

/// A chunk to be summed is read in pieces of this size, each summed while it is in cache.
const PIECE: usize = 256 << 10;

/// Finds the registration or benchmark a connection's handshake names (waiting a little for a
/// benchmark not set up here yet).
pub type Lookup = Arc<dyn Fn(&[u8]) -> Option<Arc<dyn Deliver>> + Send + Sync>;

type HmacSha256 = Hmac<sha2::Sha256>;

/// Who proves the token with a tag: the two sides' tags differ, so that neither is the other's.
#[derive(Clone, Copy)]
enum Side {
    Sender,
    Receiver,
}

/// HMAC-SHA256 keyed by the token over the side, both nonces and the registration's id.
fn tag(token: &[u8], side: Side, receiver_nonce: &[u8], sender_nonce: &[u8], id: &[u8]) -> HmacSha256 {
    let mut mac = HmacSha256::new_from_slice(token).expect("HMAC takes a key of any length");
    mac.update(match side {
        Side::Sender => b"dfc data plane 2: sender\0",
        Side::Receiver => b"dfc data plane 2: receiver\0",
    });
    mac.update(receiver_nonce);
    mac.update(sender_nonce);
    mac.update(&(id.len() as u16).to_le_bytes());
    mac.update(id);
    mac
}

/// Accepts data connections on `listener` for as long as the process lives, from the tokio
/// runtime this is called in: each connection's handshake (in TLS with `tls`) is a task, held to
/// the deadline and the cap of [`crate::limits`]; a connection that has proven the token gets a
/// thread of its own to read its frames.
pub fn serve(
    listener: tokio::net::TcpListener,
    token: &str,
    tls: Option<Arc<rustls::ServerConfig>>,
    lookup: Lookup,
) -> Result<(), String> {
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| "the data plane needs a tokio runtime")?;
    let token: Arc<[u8]> = token.as_bytes().into();
    let acceptor = tls.map(tokio_rustls::TlsAcceptor::from);
    let unproven = Unproven::new(MAX_UNPROVEN);
    runtime.spawn(async move {
        loop {
            let Some(stream) = crate::limits::accept(&listener).await else { continue };
            let admitted = unproven.admit();
            let (token, lookup, acceptor) = (token.clone(), lookup.clone(), acceptor.clone());
            tokio::spawn(async move {
                let handshake =
                    tokio::time::timeout(UNPROVEN_DEADLINE, accept(stream, &token, &lookup, acceptor, &admitted));
                let accepted = tokio::select! {
                    done = handshake => done.ok().and_then(Result::ok),
                    () = admitted.evicted() => None,
                };
                drop(admitted);
                if let Some((wire, sink)) = accepted {
                    // Without a thread to be had, the connection closes and the sender's step fails.
                    let _ = std::thread::Builder::new().name("dfc-data".into()).spawn(move || {
                        // A connection ends when its sender closes it or sends what does not parse.
                        let _ = receive(wire, &*sink);
                    });
                }
            });
        }
    });
    Ok(())
}

/// A connection's handshake, in TLS with `acceptor`: the connection, made blocking for its
/// reader thread, and where its chunks go.
async fn accept(
    stream: tokio::net::TcpStream,
    token: &[u8],
    lookup: &Lookup,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    admitted: &Admitted,
) -> Result<(Wire, Arc<dyn Deliver>), String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let blocking = |stream: tokio::net::TcpStream| -> Result<TcpStream, String> {
        let stream = stream.into_std().map_err(|e| e.to_string())?;
        stream.set_nonblocking(false).map_err(|e| e.to_string())?;
        Ok(stream)
    };
    match acceptor {
        None => {
            let mut stream = stream;
            let sink = handshake(&mut stream, token, lookup, admitted).await?;
            Ok((Wire::Plain(blocking(stream)?), sink))
        }
        Some(acceptor) => {
            let mut stream = acceptor.accept(stream).await.map_err(|e| e.to_string())?;
            let sink = handshake(&mut stream, token, lookup, admitted).await?;
            // What rustls has read beyond the handshake stays in the connection's buffers.
            let (stream, connection) = stream.into_inner();
            Ok((Wire::Server(Box::new(rustls::StreamOwned::new(connection, Socket::new(blocking(stream)?)))), sink))
        }
    }
}

/// The receiver's side of the handshake: where the connection's chunks go.
async fn handshake<S>(
    stream: &mut S,
    token: &[u8],
    lookup: &Lookup,
    admitted: &Admitted,
) -> Result<Arc<dyn Deliver>, String>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let io = |e: std::io::Error| e.to_string();
    let nonce = crate::auth::random_bytes::<NONCE>();
    stream.write_all(&[MAGIC.as_slice(), &nonce].concat()).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    let mut hello = [0u8; HELLO];
    stream.read_exact(&mut hello).await.map_err(io)?;
    if &hello[..8] != MAGIC {
        return Err("not a dfc data connection (of this version)".into());
    }
    let (sender_nonce, proof) = (&hello[8..8 + NONCE], &hello[8 + NONCE..8 + NONCE + PROOF]);
    let id_len = u16::from_le_bytes([hello[HELLO - 2], hello[HELLO - 1]]) as usize;
    if id_len > MAX_ID {
        return Err("a data connection naming an id too long".into());
    }
    let mut id = vec![0u8; id_len];
    stream.read_exact(&mut id).await.map_err(io)?;
    // `verify_slice` compares in constant time.
    if tag(token, Side::Sender, &nonce, sender_nonce, &id).verify_slice(proof).is_err() {
        let _ = stream.write_all(&[BAD_TOKEN]).await;
        let _ = stream.flush().await;
        return Err("a data connection without the token".into());
    }
    admitted.prove();
    let lookup = lookup.clone();
    let found = tokio::task::spawn_blocking({
        let id = id.clone();
        move || lookup(&id)
    });
    let Some(sink) = found.await.ok().flatten() else {
        let _ = stream.write_all(&[UNKNOWN_ID]).await;
        let _ = stream.flush().await;
        return Err("a data connection for no registration here".into());
    };
    let ours = tag(token, Side::Receiver, &nonce, sender_nonce, &id).finalize().into_bytes();
    stream.write_all(&[&[ACCEPTED], ours.as_slice()].concat()).await.map_err(io)?;
    stream.flush().await.map_err(io)?;
    Ok(sink)
}

/// One proven connection's frames, to the end.
fn receive(stream: Wire, sink: &dyn Deliver) -> Result<(), String> {
    // Between steps a connection may idle as long as the training loop does.
    stream.socket().set_read_timeout(None).map_err(|e| e.to_string())?;
    let mut frames = Frames::Tcp { stream, scratch: vec![0u8; PIECE] };
    let mut key = Vec::new();
    while let Some(header) = frames.header()? {
        let Header { magic, key_len, step, total, offset, len } = Header::parse(&header)?;
        key.resize(key_len as usize, 0);
        frames.key(&mut key)?;
        if magic == OFFER_MAGIC {
            frames = frames.offered(&key, len as usize)?;
            continue;
        }
        let key = std::str::from_utf8(&key).map_err(|_| "a key that is not UTF-8")?;
        if let Some(place) = sink.place(step, key, total, offset, len) {
            // A peer that stops mid-chunk must not hold the lent memory for ever.
            frames.set_chunk_timeout(Some(sink.chunk_timeout()))?;
            // SAFETY: `place` lent `len` bytes at `at` to this reader until `placed`.
            let into = unsafe { std::slice::from_raw_parts_mut(place.at, place.len) };
            let read = frames.read_into(into, place.combine);
            sink.placed(step, key, offset, len, read.is_ok());
            read?;
            frames.set_chunk_timeout(None)?;
        } else {
            let chunk = frames.read_chunk(len as usize)?;
            sink.deliver_chunk(step, key, total, offset, chunk)?;
        }
        frames.done();
    }
    Ok(())
}

/// A data connection's bytes: plain TCP on loopback, or TLS over TCP (the receiver's end or
/// the sender's).
pub(crate) enum Wire {
    Plain(TcpStream),
    Server(Box<rustls::StreamOwned<rustls::ServerConnection, Socket>>),
    Client(Box<rustls::StreamOwned<rustls::ClientConnection, Socket>>),
}

/// TLS's side of a TCP connection, read through a buffer: rustls reads at most 4 KiB at a
/// time, a system call each, where a chunk is 1 MiB.
pub(crate) struct Socket(std::io::BufReader<TcpStream>);

impl Socket {
    fn new(stream: TcpStream) -> Socket {
        Socket(std::io::BufReader::with_capacity(PIECE, stream))
    }
}

impl Read for Socket {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Socket {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.get_mut().write(buf)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.0.get_mut().flush()
    }
}

impl Wire {
    /// The TCP connection underneath, for its timeouts and to see whether the peer is there
    /// (a queue's connection carries nothing, so nothing waits in the TLS side's buffer).
    fn socket(&self) -> &TcpStream {
        match self {
            Wire::Plain(stream) => stream,
            Wire::Server(tls) => tls.get_ref().0.get_ref(),
            Wire::Client(tls) => tls.get_ref().0.get_ref(),
        }
    }

    /// Writes every slice and hands it all to the kernel (TLS records included).
    fn send(&mut self, slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
        write_all_vectored(self, slices)?;
        self.flush()
    }
}

impl Read for Wire {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Wire::Plain(stream) => stream.read(buf),
            Wire::Server(tls) => tls.read(buf),
            Wire::Client(tls) => tls.read(buf),
        }
    }
}

impl Write for Wire {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Wire::Plain(stream) => stream.write(buf),
            Wire::Server(tls) => tls.write(buf),
            Wire::Client(tls) => tls.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            Wire::Plain(stream) => stream.write_vectored(bufs),
            Wire::Server(tls) => tls.write_vectored(bufs),
            Wire::Client(tls) => tls.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Wire::Plain(stream) => stream.flush(),
            Wire::Server(tls) => tls.flush(),
            Wire::Client(tls) => tls.flush(),
        }
    }
}

/// A frame's fixed header.
struct Header {
    magic: u32,
    key_len: u32,
    step: u64,
    total: u64,
    offset: u64,
    len: u64,
}

impl Header {
    fn parse(header: &[u8; HEADER]) -> Result<Header, String> {
        let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8 bytes"));
        let magic = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
        let key_len = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        let (step, total, offset, len) = (word(8), word(16), word(24), word(32));
        let offer = magic == OFFER_MAGIC && len == shm::SECRET as u64;
        if (magic != FRAME_MAGIC && !offer)
            || key_len > MAX_KEY
            || len > MAX_CHUNK
            || total > crate::MAX_MESSAGE_BYTES as u64
            || offset.checked_add(len).is_none_or(|end| end > total)
        {
            return Err("a malformed frame".into());
        }
        Ok(Header { magic, key_len, step, total, offset, len })
    }
}

/// Where a receiver reads frames from: the TCP connection, or the shared-memory queue its
/// sender offered (the connection then only tells whether the sender is alive).
enum Frames {
    Tcp { stream: Wire, scratch: Vec<u8> },
    Shared { queue: shm::Receiver, stream: Wire },
}

impl Frames {
    /// The next frame's header; `None` once the sender has closed its end.
    fn header(&mut self) -> Result<Option<[u8; HEADER]>, String> {
        let mut header = [0u8; HEADER];
        match self {
            Frames::Tcp { stream, .. } => match stream.read_exact(&mut header) {
                Ok(()) => Ok(Some(header)),
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
                Err(e) => Err(e.to_string()),
            },
            Frames::Shared { queue, stream } => loop {
                match queue.next(Duration::from_millis(100)) {
                    shm::Next::Frame => {
                        queue.head(0, &mut header);
                        return Ok(Some(header));
                    }
                    shm::Next::Closed => return Ok(None),
                    shm::Next::Idle if !alive(stream) => return Err("the sending worker went away".into()),
                    shm::Next::Idle => {}
                }
            },
        }
    }

    /// The current frame's key, `key.len()` bytes.
    fn key(&mut self, key: &mut [u8]) -> Result<(), String> {
        match self {
            Frames::Tcp { stream, .. } => stream.read_exact(key).map_err(|e| e.to_string()),
            Frames::Shared { queue, .. } => {
                if HEADER + key.len() > shm::FRAME_ROOM {
                    return Err("a key longer than a queue's slot holds".into());
                }
                queue.head(HEADER, key);
                Ok(())
            }
        }
    }

    /// Reads the current frame's chunk into `into`, or combines it with what is there.
    fn read_into(&mut self, into: &mut [u8], combine: Option<Combine>) -> Result<(), String> {
        match self {
            Frames::Tcp { stream, scratch } => match combine {
                None => stream.read_exact(into),
                Some(combine) => into.chunks_mut(PIECE).try_for_each(|into| {
                    let piece = &mut scratch[..into.len()];
                    stream.read_exact(piece)?;
                    combine(into, piece);
                    Ok(())
                }),
            }
            .map_err(|e| e.to_string()),
            Frames::Shared { queue, .. } => {
                fits_a_slot(into.len())?;
                queue.read_chunk(into.len(), |chunk| match combine {
                    None => into.copy_from_slice(chunk),
                    Some(combine) => combine(into, chunk),
                });
                Ok(())
            }
        }
    }

    /// The current frame's chunk, `len` bytes, in a buffer of its own.
    fn read_chunk(&mut self, len: usize) -> Result<Chunk, String> {
        let mut chunk = Chunk::new(len);
        match self {
            Frames::Tcp { stream, .. } => stream.read_exact(chunk.as_mut_slice()).map_err(|e| e.to_string())?,
            Frames::Shared { queue, .. } => {
                fits_a_slot(len)?;
                queue.read_chunk(len, |bytes| chunk.as_mut_slice().copy_from_slice(bytes));
            }
        }
        Ok(chunk)
    }

    /// The current frame has been taken.
    fn done(&mut self) {
        if let Frames::Shared { queue, .. } = self {
            queue.release();
        }
    }

    /// How long the rest of a chunk may take once its header has come (a queue's frames come
    /// whole).
    fn set_chunk_timeout(&mut self, timeout: Option<Duration>) -> Result<(), String> {
        match self {
            Frames::Tcp { stream, .. } => stream.socket().set_read_timeout(timeout).map_err(|e| e.to_string()),
            Frames::Shared { .. } => Ok(()),
        }
    }

    /// Answers an offer of a shared-memory queue named `name` (its secret is the frame's chunk,
    /// `len` bytes): the frames to read from now on.
    fn offered(self, name: &[u8], len: usize) -> Result<Frames, String> {
        let Frames::Tcp { mut stream, scratch } = self else {
            return Err("a queue offered inside a queue".into());
        };
        let mut secret = vec![0u8; len];
        stream.read_exact(&mut secret).map_err(|e| e.to_string())?;
        let queue = std::str::from_utf8(name).map_err(|e| e.to_string()).and_then(|n| shm::Receiver::open(n, &secret));
        let answer = [if queue.is_ok() { ACCEPTED } else { UNKNOWN_ID }];
        stream.send(&mut [IoSlice::new(&answer)]).map_err(|e| e.to_string())?;
        Ok(match queue {
            Ok(queue) => Frames::Shared { queue, stream },
            // Another machine, or another /dev/shm: frames go on over TCP.
            Err(_) => Frames::Tcp { stream, scratch },
        })
    }
}

/// Whether a chunk of `len` bytes fits a queue's slot (a sender's header may claim more).
fn fits_a_slot(len: usize) -> Result<(), String> {
    if len > shm::CHUNK {
        return Err("a chunk longer than a queue's slot holds".into());
    }
    Ok(())
}

/// Whether the worker at the other end of `stream` is still there: a connection whose peer
/// has gone reads as ended or reset (a queue's connection carries nothing else, TLS records
/// included: no session tickets, no close_notify).
fn alive(stream: &Wire) -> bool {
    let stream = stream.socket();
    if stream.set_nonblocking(true).is_err() {
        return false;
    }
    let peeked = stream.peek(&mut [0u8; 1]);
    let alive = match peeked {
        Ok(0) => false,
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
    };
    stream.set_nonblocking(false).is_ok() && alive
}

/// A received chunk's bytes, in a buffer that goes back to a pool when dropped (fresh buffers
/// would be zeroed and faulted in for every chunk).
pub struct Chunk {
    buffer: Vec<u8>,
    len: usize,
}

static POOL: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());
const POOLED: usize = 64;

impl Chunk {
    fn new(len: usize) -> Chunk {
        let pooled = if len <= DATA_CHUNK { POOL.lock().unwrap_or_else(|e| e.into_inner()).pop() } else { None };
        Chunk { buffer: pooled.unwrap_or_else(|| vec![0; len.max(DATA_CHUNK)]), len }
    }

    /// A chunk holding `bytes`.
    #[cfg(test)]
    pub(crate) fn for_tests(bytes: &[u8]) -> Chunk {
        let mut chunk = Chunk::new(bytes.len());
        chunk.as_mut_slice().copy_from_slice(bytes);
        chunk
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.buffer[..self.len]
    }

    fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buffer[..self.len]
    }
}

impl Drop for Chunk {
    fn drop(&mut self) {
        if self.buffer.len() == DATA_CHUNK {
            let mut pool = POOL.lock().unwrap_or_else(|e| e.into_inner());
            if pool.len() < POOLED {
                pool.push(std::mem::take(&mut self.buffer));
            }
        }
    }
}

/// The sending side: a connection to each other worker that has a data port, opened on first
/// use and kept for the registration's life.
pub struct Links {
    token: String,
    /// The registration's (or benchmark's) id, named in each handshake.
    id: Vec<u8>,
    /// Each worker's data address (`None`: it has no data port, or it is this worker).
    addresses: Vec<Option<String>>,
    /// Which workers have a data port (this one included).
    has_port: Vec<bool>,
    /// Whether to offer receivers a shared-memory queue.
    shared_memory: bool,
    /// TLS for every connection; without it, connections only to loopback addresses.
    tls: Option<Arc<rustls::ClientConfig>>,
    connections: Vec<Mutex<Option<Connection>>>,
    /// Payload bytes sent to each worker (frames' chunks, not headers), for benchmarks.
    sent: Vec<std::sync::atomic::AtomicU64>,
}

/// Why a connection could not be made: a refusal, which trying again would not change, or a
/// transport failure (a connection closed or reset midway, as a receiver flooded with other
/// connections may close one), which it may.
enum Failed {
    Refused(String),
    Transport(String),
}

impl From<std::io::Error> for Failed {
    fn from(error: std::io::Error) -> Failed {
        // rustls reports a failed TLS handshake (a certificate from another CA, say) as data
        // that is not valid.
        match error.kind() {
            std::io::ErrorKind::InvalidData => Failed::Refused(error.to_string()),
            _ => Failed::Transport(error.to_string()),
        }
    }
}

/// A sender's connection: frames over TCP, or through a queue in shared memory that the
/// receiver accepted (the TCP connection kept to tell whether the receiver is alive; dropping
/// the queue's sender closes the queue).
enum Connection {
    Tcp(Wire),
    Shared { queue: shm::Sender, stream: Wire },
}

impl Connection {
    /// Whether frames go through shared memory.
    fn is_shared(&self) -> bool {
        matches!(self, Connection::Shared { .. })
    }
}

impl Links {
    /// Links to the workers at `grpc_addresses` whose data ports are `data_ports` (0: none),
    /// offering each a shared-memory queue if `shared_memory`, over TLS with `tls`.
    pub fn new(
        token: &str,
        id: &[u8],
        rank: usize,
        grpc_addresses: &[String],
        data_ports: &[u32],
        shared_memory: bool,
        tls: Option<&crate::Tls>,
    ) -> Links {
        let addresses: Vec<Option<String>> = grpc_addresses
            .iter()
            .enumerate()
            .map(|(r, address)| {
                let port = data_ports.get(r).copied().unwrap_or(0);
                let host = address.rsplit_once(':').map(|(host, _)| host)?;
                (r != rank && port != 0 && port <= u16::MAX as u32).then(|| format!("{host}:{port}"))
            })
            .collect();
        let connections = addresses.iter().map(|_| Mutex::new(None)).collect();
        let sent = addresses.iter().map(|_| Default::default()).collect();
        let has_port = (0..grpc_addresses.len()).map(|r| data_ports.get(r).is_some_and(|&p| p != 0)).collect();
        let tls = tls.map(crate::Tls::data_client);
        Links { token: token.to_string(), id: id.to_vec(), addresses, has_port, shared_memory, tls, connections, sent }
    }

    /// Payload bytes sent to worker `rank` so far.
    pub fn bytes_sent(&self, rank: usize) -> u64 {
        self.sent.get(rank).map_or(0, |s| s.load(std::sync::atomic::Ordering::Relaxed))
    }

    /// Whether tensors can be sent to worker `rank` on the data plane: it has a data port, and
    /// it is another worker.
    pub fn reaches(&self, rank: usize) -> bool {
        self.addresses.get(rank).is_some_and(Option::is_some)
    }

    /// Whether a ring over `ranks` runs on the data plane: every one of them has a data port
    /// (every worker decides alike, from the same list of ports).
    pub fn ring_ready(&self, ranks: &[usize]) -> bool {
        ranks.iter().all(|&r| self.has_port.get(r).copied().unwrap_or(false))
    }

    /// Whether the connection to worker `rank` is open and goes through shared memory.
    pub fn is_shared(&self, rank: usize) -> bool {
        self.connections
            .get(rank)
            .is_some_and(|c| c.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(Connection::is_shared))
    }

    /// A connection to worker `rank`'s data port, tried again a few times after transport
    /// failures.
    fn connect(&self, rank: usize, timeout: Duration) -> Result<Connection, String> {
        let address = self.addresses[rank].as_deref().expect("a worker with a data port");
        let mut attempt = 0;
        loop {
            match self.try_connect(address, timeout) {
                Ok(connection) => return Ok(connection),
                Err(Failed::Transport(_)) if attempt < 3 => {
                    attempt += 1;
                    std::thread::sleep(Duration::from_millis(100 * attempt));
                }
                Err(Failed::Refused(e) | Failed::Transport(e)) => return Err(format!("data port {address}: {e}")),
            }
        }
    }

    fn try_connect(&self, address: &str, timeout: Duration) -> Result<Connection, Failed> {
        let transport = Failed::from;
        let target: SocketAddr = match &self.tls {
            Some(_) => address
                .to_socket_addrs()
                .map_err(transport)?
                .next()
                .ok_or_else(|| Failed::Refused("no address".into()))?,
            None => crate::tls::plaintext_address(address).map_err(Failed::Refused)?,
        };
        let stream = TcpStream::connect_timeout(&target, Duration::from_secs(10)).map_err(transport)?;
        stream.set_nodelay(true).map_err(transport)?;
        stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(transport)?;
        stream.set_write_timeout(Some(timeout)).map_err(transport)?;
        let mut stream = match &self.tls {
            None => Wire::Plain(stream),
            Some(config) => {
                let name = rustls::pki_types::ServerName::try_from(crate::tls::host_of(address).to_string())
                    .map_err(|e| Failed::Refused(e.to_string()))?;
                let connection =
                    rustls::ClientConnection::new(config.clone(), name).map_err(|e| Failed::Refused(e.to_string()))?;
                Wire::Client(Box::new(rustls::StreamOwned::new(connection, Socket::new(stream))))
            }
        };
        self.prove(&mut stream)?;
        if !self.shared_memory {
            return Ok(Connection::Tcp(stream));
        }
        match offer_queue(&mut stream).map_err(Failed::Transport)? {
            Some(queue) => Ok(Connection::Shared { queue, stream }),
            None => Ok(Connection::Tcp(stream)),
        }
    }

    /// The sender's side of the handshake (see the module's documentation).
    fn prove(&self, stream: &mut Wire) -> Result<(), Failed> {
        let transport = Failed::from;
        let mut greeting = [0u8; GREETING];
        stream.read_exact(&mut greeting).map_err(|e| match e.kind() {
            // A receiver in TLS waits for a TLS handshake this sender does not begin, and closes
            // the connection at its deadline (or one flooded closed it to make room).
            std::io::ErrorKind::UnexpectedEof if self.tls.is_none() => Failed::Transport(
                "closed the connection before greeting it (if that worker runs with --tls-dir, this one needs it too)"
                    .into(),
            ),
            _ => transport(e),
        })?;
        if &greeting[..8] != MAGIC {
            return Err(Failed::Refused("not a dfc data port (of this version)".into()));
        }
        let receiver_nonce = &greeting[8..];
        let nonce = crate::auth::random_bytes::<NONCE>();
        let token = self.token.as_bytes();
        let proof = tag(token, Side::Sender, receiver_nonce, &nonce, &self.id).finalize().into_bytes();
        let id_len = (self.id.len() as u16).to_le_bytes();
        let mut hello = [
            IoSlice::new(MAGIC),
            IoSlice::new(&nonce),
            IoSlice::new(&proof),
            IoSlice::new(&id_len),
            IoSlice::new(&self.id),
        ];
        stream.send(&mut hello).map_err(transport)?;
        let mut status = [0u8; 1];
        stream.read_exact(&mut status).map_err(transport)?;
        match status[0] {
            ACCEPTED => {}
            BAD_TOKEN => return Err(Failed::Refused("refused the token".into())),
            _ => return Err(Failed::Refused("does not know this run".into())),
        }
        let mut theirs = [0u8; PROOF];
        stream.read_exact(&mut theirs).map_err(transport)?;
        // Whoever listens there must hold the token too before it is sent a tensor.
        tag(token, Side::Receiver, receiver_nonce, &nonce, &self.id)
            .verify_slice(&theirs)
            .map_err(|_| Failed::Refused("did not prove the token (is something else listening there?)".into()))
    }

    /// Sends `bytes`, which lie at `at` in a segment of `total` bytes, under `key` for `step`
    /// to worker `rank`, in chunks, from the caller's memory; returns once the last chunk is
    /// handed to the kernel.
    #[allow(clippy::too_many_arguments)]
    pub fn send(
        &self,
        rank: usize,
        step: u64,
        key: &str,
        bytes: &[u8],
        at: usize,
        total: usize,
        timeout: Duration,
    ) -> Result<(), String> {
        if !self.addresses.get(rank).is_some_and(Option::is_some) {
            return Err(format!("worker {rank} has no data port"));
        }
        let mut offset = 0;
        loop {
            // One frame at a time holds the connection, so that segments of several
            // all-reduces under way at once interleave by whole frames.
            let mut connection = self.connections[rank].lock().unwrap_or_else(|e| e.into_inner());
            if connection.is_none() {
                *connection = Some(self.connect(rank, timeout)?);
            }
            let link = connection.as_mut().expect("connected");
            let end = (offset + DATA_CHUNK).min(bytes.len());
            let mut header = [0u8; HEADER];
            header[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
            header[4..8].copy_from_slice(&(key.len() as u32).to_le_bytes());
            let words = [(8, step), (16, total as u64), (24, (at + offset) as u64), (32, (end - offset) as u64)];
            for (place, word) in words {
                header[place..place + 8].copy_from_slice(&word.to_le_bytes());
            }
            let chunk = &bytes[offset..end];
            let sent = match link {
                Connection::Tcp(stream) => stream
                    .send(&mut [IoSlice::new(&header), IoSlice::new(key.as_bytes()), IoSlice::new(chunk)])
                    .map_err(|e| e.to_string()),
                Connection::Shared { queue, stream } => {
                    queue.push(&[&header, key.as_bytes()], chunk, Instant::now() + timeout, &mut || alive(stream))
                }
            };
            if let Err(e) = sent {
                *connection = None;
                let address = self.addresses[rank].as_deref().unwrap_or("?");
                return Err(format!("sending `{key}` to the data port {address}: {e}"));
            }
            self.sent[rank].fetch_add(chunk.len() as u64, std::sync::atomic::Ordering::Relaxed);
            offset = end;
            if offset >= bytes.len() {
                return Ok(());
            }
        }
    }
}

/// Offers the receiver at the other end of `stream` a shared-memory queue; the queue if it
/// took it. A machine without POSIX shared memory offers none.
fn offer_queue(stream: &mut Wire) -> Result<Option<shm::Sender>, String> {
    let Ok((queue, name, secret)) = shm::Sender::create() else { return Ok(None) };
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&OFFER_MAGIC.to_le_bytes());
    header[4..8].copy_from_slice(&(name.len() as u32).to_le_bytes());
    header[16..24].copy_from_slice(&(secret.len() as u64).to_le_bytes());
    header[32..40].copy_from_slice(&(secret.len() as u64).to_le_bytes());
    let asked =
        stream.send(&mut [IoSlice::new(&header), IoSlice::new(name.as_bytes()), IoSlice::new(secret.as_bytes())]);
    let mut status = [0u8; 1];
    let answered = asked.and_then(|()| stream.read_exact(&mut status));
    // Both ends have it mapped, or never will: the name is not needed any more.
    let _ = rustix::shm::unlink(name.as_str());
    answered.map_err(|e| e.to_string())?;
    Ok((status[0] == ACCEPTED).then_some(queue))
}

/// Writes every slice (the standard library's `write_all_vectored` is not stable).
fn write_all_vectored(stream: &mut impl Write, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
    IoSlice::advance_slices(&mut slices, 0);
    while !slices.is_empty() {
        match stream.write_vectored(slices) {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! What a data port does with frames that do not parse: it hangs up on their sender, hands
    //! nothing on, and goes on serving others.

    use super::*;

    const TOKEN: &str = "data-frames-test-token-0123456789";

    /// A chunk as handed on: step, key, the segment's bytes, the offset, the chunk's bytes.
    type Handed = (u64, String, u64, u64, Vec<u8>);

    #[derive(Default)]
    struct Recorder {
        chunks: Mutex<Vec<Handed>>,
    }

    impl Deliver for Recorder {
        fn deliver_chunk(&self, step: u64, key: &str, total: u64, offset: u64, chunk: Chunk) -> Result<(), String> {
            let chunk = chunk.as_slice().to_vec();
            self.chunks.lock().unwrap().push((step, key.to_string(), total, offset, chunk));
            Ok(())
        }

        fn place(&self, _: u64, _: &str, _: u64, _: u64, _: u64) -> Option<Placement> {
            None
        }

        fn placed(&self, _: u64, _: &str, _: u64, _: u64, _: bool) {}

        fn chunk_timeout(&self) -> Duration {
            Duration::from_secs(5)
        }
    }

    /// A data port whose one registration, `run`, records what it is handed, served from the
    /// runtime returned with it.
    fn data_port() -> (tokio::runtime::Runtime, SocketAddr, Arc<Recorder>) {
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
        let address = listener.local_addr().unwrap();
        let recorder = Arc::new(Recorder::default());
        let sink = recorder.clone();
        let lookup: Lookup = Arc::new(move |id| (id == b"run").then(|| sink.clone() as Arc<dyn Deliver>));
        runtime.block_on(async { serve(listener, TOKEN, None, lookup) }).unwrap();
        (runtime, address, recorder)
    }

    /// The hello of a sender holding `token` for the id `run`, after the receiver's `greeting`.
    fn hello(token: &str, greeting: &[u8]) -> (Vec<u8>, [u8; NONCE]) {
        assert_eq!(&greeting[..8], MAGIC);
        let nonce = [7u8; NONCE];
        let proof = tag(token.as_bytes(), Side::Sender, &greeting[8..], &nonce, b"run").finalize().into_bytes();
        ([MAGIC.as_slice(), &nonce, &proof, &3u16.to_le_bytes(), b"run"].concat(), nonce)
    }

    /// A connection through the handshake, done by hand; checks the receiver's proof.
    fn connected(address: SocketAddr) -> TcpStream {
        let mut stream = TcpStream::connect(address).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut greeting = [0u8; GREETING];
        stream.read_exact(&mut greeting).unwrap();
        let (hello, nonce) = hello(TOKEN, &greeting);
        stream.write_all(&hello).unwrap();
        let mut answer = [0u8; 1 + PROOF];
        stream.read_exact(&mut answer).unwrap();
        assert_eq!(answer[0], ACCEPTED);
        tag(TOKEN.as_bytes(), Side::Receiver, &greeting[8..], &nonce, b"run").verify_slice(&answer[1..]).unwrap();
        stream
    }

    fn header(magic: u32, key_len: u32, step: u64, total: u64, offset: u64, len: u64) -> Vec<u8> {
        let mut header = magic.to_le_bytes().to_vec();
        header.extend_from_slice(&key_len.to_le_bytes());
        for word in [step, total, offset, len] {
            header.extend_from_slice(&word.to_le_bytes());
        }
        assert_eq!(header.len(), HEADER);
        header
    }

    /// Whether the port hung up: end of stream, or a reset where it left bytes unread.
    fn hung_up(mut stream: TcpStream) -> bool {
        match stream.read(&mut [0u8; 16]) {
            Ok(0) => true,
            Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
            Ok(_) => false,
        }
    }

    #[test]
    fn frames_that_do_not_parse_end_their_connection_and_deliver_nothing() {
        let (_runtime, address, recorder) = data_port();
        let max_total = crate::MAX_MESSAGE_BYTES as u64;
        let malformed: Vec<(&str, Vec<u8>)> = vec![
            ("another magic", header(0x1234_5678, 3, 0, 8, 0, 8)),
            ("a key too long", header(FRAME_MAGIC, MAX_KEY + 1, 0, 8, 0, 8)),
            ("a chunk too long", header(FRAME_MAGIC, 3, 0, MAX_CHUNK + 1, 0, MAX_CHUNK + 1)),
            ("a segment too long", header(FRAME_MAGIC, 3, 0, max_total + 1, 0, 8)),
            ("a chunk past its segment", header(FRAME_MAGIC, 3, 0, 8, 4, 8)),
            ("an offset that overflows", header(FRAME_MAGIC, 3, 0, 8, u64::MAX, 8)),
            ("a key that is not UTF-8", [header(FRAME_MAGIC, 3, 0, 8, 0, 8), vec![0xff, 0xfe, 0xfd]].concat()),
        ];
        for (what, bytes) in malformed {
            let mut stream = connected(address);
            stream.write_all(&bytes).unwrap();
            assert!(hung_up(stream), "{what}: the port hangs up");
        }
        // A frame cut short: its sender hangs up midway.
        let mut stream = connected(address);
        stream.write_all(&[header(FRAME_MAGIC, 3, 0, 8, 0, 8), b"k#0".to_vec(), vec![1; 4]].concat()).unwrap();
        drop(stream);

        // A good frame after all that is handed on, byte for byte.
        let mut stream = connected(address);
        let payload: Vec<u8> = (1..=8).collect();
        stream.write_all(&[header(FRAME_MAGIC, 3, 7, 16, 8, 8), b"k#0".to_vec(), payload.clone()].concat()).unwrap();
        stream.shutdown(std::net::Shutdown::Write).unwrap();
        assert!(hung_up(stream), "the port closes its end when the sender closes its own");
        assert_eq!(*recorder.chunks.lock().unwrap(), [(7, "k#0".to_string(), 16, 8, payload)]);
    }

    /// The chunks recorded once there are `n` (or after 10 s, what there is).
    fn recorded(recorder: &Recorder, n: usize) -> Vec<Handed> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let chunks = recorder.chunks.lock().unwrap().clone();
            if chunks.len() >= n || Instant::now() > deadline {
                return chunks;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// An offer of the queue `name` with `secret`, as a sender writes it.
    fn offer(name: &[u8], secret: &[u8]) -> Vec<u8> {
        let len = secret.len() as u64;
        [header(OFFER_MAGIC, name.len() as u32, 0, len, 0, len), name.to_vec(), secret.to_vec()].concat()
    }

    #[test]
    fn a_sender_on_the_same_machine_sends_through_shared_memory() {
        let (_runtime, address, recorder) = data_port();
        // The data port above is worker 0's; this process sends as worker 1.
        let workers = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let links = Links::new(TOKEN, b"run", 1, &workers, &[u32::from(address.port()), 0], true, None);
        let bytes: Vec<u8> = (0..2 * shm::CHUNK + 100).map(|i| (i % 251) as u8).collect();
        links.send(0, 3, "k#0", &bytes, 0, bytes.len(), Duration::from_secs(10)).unwrap();
        assert!(links.is_shared(0), "the receiver took the queue");
        let chunks = recorded(&recorder, 3);
        let offsets: Vec<u64> = chunks.iter().map(|c| c.3).collect();
        assert_eq!(offsets, [0, shm::CHUNK as u64, 2 * shm::CHUNK as u64], "whole frames, in order");
        assert!(chunks.iter().all(|c| c.0 == 3 && c.1 == "k#0" && c.2 == bytes.len() as u64));
        assert_eq!(chunks.iter().flat_map(|c| c.4.clone()).collect::<Vec<u8>>(), bytes);
    }

    #[test]
    fn offers_the_receiver_cannot_take_are_declined_and_frames_go_on_over_tcp() {
        let (_runtime, address, recorder) = data_port();
        let mut stream = connected(address);
        let declined = |stream: &mut TcpStream, offer: Vec<u8>| {
            stream.write_all(&offer).unwrap();
            let mut status = [0u8];
            stream.read_exact(&mut status).unwrap();
            status[0] != ACCEPTED
        };
        // A queue on another machine: no such name here.
        assert!(declined(&mut stream, offer(b"/dfc-0-onanothermachine", &[b'7'; shm::SECRET])));
        // A queue here, offered with another secret.
        let (_queue, name, _) = shm::Sender::create().unwrap();
        assert!(declined(&mut stream, offer(name.as_bytes(), &[b'7'; shm::SECRET])));
        rustix::shm::unlink(name.as_str()).unwrap();
        // A name that is no queue's.
        assert!(declined(&mut stream, offer(b"/../../etc/passwd", &[b'7'; shm::SECRET])));

        let payload: Vec<u8> = (1..=8).collect();
        stream.write_all(&[header(FRAME_MAGIC, 3, 7, 8, 0, 8), b"k#0".to_vec(), payload.clone()].concat()).unwrap();
        assert_eq!(recorded(&recorder, 1), [(7, "k#0".to_string(), 8, 0, payload)]);
    }

    #[test]
    fn a_sender_whose_offer_is_declined_sends_over_tcp() {
        // A receiver on "another machine": it does the handshake by hand and declines the queue.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let receiver = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            let greeting = [MAGIC.as_slice(), &[b'n'; NONCE]].concat();
            stream.write_all(&greeting).unwrap();
            let mut hello = [0u8; HELLO + 3];
            stream.read_exact(&mut hello).unwrap();
            let ours = tag(TOKEN.as_bytes(), Side::Receiver, &greeting[8..], &hello[8..8 + NONCE], b"run");
            stream.write_all(&[&[ACCEPTED], ours.finalize().into_bytes().as_slice()].concat()).unwrap();
            let mut header = [0u8; HEADER];
            stream.read_exact(&mut header).unwrap();
            let offered = Header::parse(&header).unwrap();
            assert_eq!(offered.magic, OFFER_MAGIC);
            let mut rest = vec![0u8; offered.key_len as usize + offered.len as usize];
            stream.read_exact(&mut rest).unwrap();
            stream.write_all(&[UNKNOWN_ID]).unwrap();
            // The frame comes on the connection itself.
            stream.read_exact(&mut header).unwrap();
            let frame = Header::parse(&header).unwrap();
            let mut rest = vec![0u8; frame.key_len as usize + frame.len as usize];
            stream.read_exact(&mut rest).unwrap();
            (frame.magic, rest)
        });
        let workers = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let links = Links::new(TOKEN, b"run", 1, &workers, &[u32::from(port), 0], true, None);
        links.send(0, 0, "k#0", &[5, 6, 7], 0, 3, Duration::from_secs(10)).unwrap();
        assert!(!links.is_shared(0));
        assert_eq!(receiver.join().unwrap(), (FRAME_MAGIC, b"k#0\x05\x06\x07".to_vec()));
    }
}
