//! The data plane: plain TCP connections between workers for the ring all-reduce's segments
//! and the tensors sent to other workers' Recvs, beside gRPC, which keeps every control call.
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
//! - Handshake: the receiver sends a fresh nonce; the sender answers with SHA-256 of the shared
//!   token and the nonce (the token itself never crosses the wire) and the registration's id;
//!   the receiver checks the proof in constant time and answers one status byte.
//! - Then frames: a fixed header (step, key length, the segment's length, the chunk's offset
//!   and length), the key, the chunk's bytes. A frame that does not parse closes the
//!   connection; the step it was for then fails on its deadline or by the driver's abort.
//!
//! - Between workers on one machine, the sender offers a queue in shared memory right after
//!   the handshake (a frame of its own magic naming the queue, see [`crate::shm`]); if the
//!   receiver can open it, every later frame goes through the queue and the TCP connection
//!   only tells each side that the other is alive. Elsewhere the offer is declined and frames
//!   go over TCP.
//!
//! Not encrypted: with `--tls-dir`, workers offer no data port and segments go over gRPC,
//! through TLS.

use crate::shm;
use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use subtle::ConstantTimeEq;

/// The bytes of one frame at most, as sent: small enough that a segment is summed while its
/// rest is in flight, large enough that a frame costs few system calls.
pub const DATA_CHUNK: usize = 1 << 20;
/// The largest chunk a receiver accepts over TCP (a sender's chunks may be smaller); a queue's
/// slots hold [`shm::CHUNK`].
const MAX_CHUNK: u64 = 16 << 20;
const MAX_KEY: u32 = 4096;
const MAGIC: &[u8; 8] = b"dfcdata1";
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

/// The proof of the token for `nonce`.
fn proof(token: &str, nonce: &[u8]) -> [u8; 32] {
    use sha2::Digest;
    let mut hash = sha2::Sha256::new();
    hash.update(b"dfc data plane\0");
    hash.update(token.as_bytes());
    hash.update(nonce);
    hash.finalize().into()
}

/// Accepts data connections on `listener` for as long as the process lives, each on a thread
/// of its own.
pub fn serve(listener: TcpListener, token: String, lookup: Lookup) {
    let token = Arc::new(token);
    std::thread::Builder::new()
        .name("dfc-data-accept".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let (token, lookup) = (token.clone(), lookup.clone());
                let _ = std::thread::Builder::new().name("dfc-data".into()).spawn(move || {
                    // A connection ends when its sender closes it or sends what does not parse.
                    let _ = receive(stream, &token, &lookup);
                });
            }
        })
        .expect("a thread for the data port");
}

/// One connection, from handshake to end.
fn receive(mut stream: TcpStream, token: &str, lookup: &Lookup) -> Result<(), String> {
    let sink = handshake(&mut stream, token, lookup)?;
    // Between steps a connection may idle as long as the training loop does.
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
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

/// The receiver's side of the handshake: where the connection's chunks go.
fn handshake(stream: &mut TcpStream, token: &str, lookup: &Lookup) -> Result<Arc<dyn Deliver>, String> {
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
    let nonce = crate::auth::random_token().into_bytes();
    stream.write_all(&nonce).map_err(|e| e.to_string())?;
    let mut hello = [0u8; 8 + 32 + 2];
    stream.read_exact(&mut hello).map_err(|e| e.to_string())?;
    if &hello[..8] != MAGIC {
        return Err("not a dfc data connection".into());
    }
    let id_len = u16::from_le_bytes([hello[40], hello[41]]) as usize;
    let mut id = vec![0u8; id_len];
    stream.read_exact(&mut id).map_err(|e| e.to_string())?;
    if !bool::from(hello[8..40].ct_eq(&proof(token, &nonce))) {
        let _ = stream.write_all(&[BAD_TOKEN]);
        return Err("a data connection without the token".into());
    }
    let Some(sink) = lookup(&id) else {
        let _ = stream.write_all(&[UNKNOWN_ID]);
        return Err("a data connection for no registration here".into());
    };
    stream.write_all(&[ACCEPTED]).map_err(|e| e.to_string())?;
    Ok(sink)
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
    Tcp { stream: TcpStream, scratch: Vec<u8> },
    Shared { queue: shm::Receiver, stream: TcpStream },
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
            Frames::Tcp { stream, .. } => stream.set_read_timeout(timeout).map_err(|e| e.to_string()),
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
        stream.write_all(&[if queue.is_ok() { ACCEPTED } else { UNKNOWN_ID }]).map_err(|e| e.to_string())?;
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
/// has gone reads as ended or reset (a queue's connection carries nothing else).
fn alive(stream: &TcpStream) -> bool {
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
    connections: Vec<Mutex<Option<Connection>>>,
}

/// A sender's connection: frames over TCP, or through a queue in shared memory that the
/// receiver accepted (the TCP connection kept to tell whether the receiver is alive; dropping
/// the queue's sender closes the queue).
enum Connection {
    Tcp(TcpStream),
    Shared { queue: shm::Sender, stream: TcpStream },
}

impl Connection {
    /// Whether frames go through shared memory.
    fn is_shared(&self) -> bool {
        matches!(self, Connection::Shared { .. })
    }
}

impl Links {
    /// Links to the workers at `grpc_addresses` whose data ports are `data_ports` (0: none),
    /// offering each a shared-memory queue if `shared_memory`.
    pub fn new(
        token: &str,
        id: &[u8],
        rank: usize,
        grpc_addresses: &[String],
        data_ports: &[u32],
        shared_memory: bool,
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
        let has_port = (0..grpc_addresses.len()).map(|r| data_ports.get(r).is_some_and(|&p| p != 0)).collect();
        Links { token: token.to_string(), id: id.to_vec(), addresses, has_port, shared_memory, connections }
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

    fn connect(&self, rank: usize, timeout: Duration) -> Result<Connection, String> {
        let address = self.addresses[rank].as_deref().expect("a worker with a data port");
        let target: SocketAddr = address
            .to_socket_addrs()
            .map_err(|e| format!("data port {address}: {e}"))?
            .next()
            .ok_or_else(|| format!("data port {address}: no address"))?;
        let mut stream = TcpStream::connect_timeout(&target, Duration::from_secs(10))
            .map_err(|e| format!("data port {address}: {e}"))?;
        stream.set_nodelay(true).map_err(|e| e.to_string())?;
        stream.set_read_timeout(Some(Duration::from_secs(10))).map_err(|e| e.to_string())?;
        stream.set_write_timeout(Some(timeout)).map_err(|e| e.to_string())?;
        let mut nonce = [0u8; 64];
        stream.read_exact(&mut nonce).map_err(|e| format!("data port {address}: {e}"))?;
        let mut hello = Vec::with_capacity(8 + 32 + 2 + self.id.len());
        hello.extend_from_slice(MAGIC);
        hello.extend_from_slice(&proof(&self.token, &nonce));
        hello.extend_from_slice(&(self.id.len() as u16).to_le_bytes());
        hello.extend_from_slice(&self.id);
        stream.write_all(&hello).map_err(|e| format!("data port {address}: {e}"))?;
        let mut status = [0u8; 1];
        stream.read_exact(&mut status).map_err(|e| format!("data port {address}: {e}"))?;
        match status[0] {
            ACCEPTED => {}
            BAD_TOKEN => return Err(format!("data port {address} refused the token")),
            _ => return Err(format!("data port {address} does not know this run")),
        }
        if !self.shared_memory {
            return Ok(Connection::Tcp(stream));
        }
        match offer_queue(&mut stream).map_err(|e| format!("data port {address}: {e}"))? {
            Some(queue) => Ok(Connection::Shared { queue, stream }),
            None => Ok(Connection::Tcp(stream)),
        }
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
                Connection::Tcp(stream) => write_all_vectored(
                    stream,
                    &mut [IoSlice::new(&header), IoSlice::new(key.as_bytes()), IoSlice::new(chunk)],
                )
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
            offset = end;
            if offset >= bytes.len() {
                return Ok(());
            }
        }
    }
}

/// Offers the receiver at the other end of `stream` a shared-memory queue; the queue if it
/// took it. A machine without POSIX shared memory offers none.
fn offer_queue(stream: &mut TcpStream) -> Result<Option<shm::Sender>, String> {
    let Ok((queue, name, secret)) = shm::Sender::create() else { return Ok(None) };
    let mut header = [0u8; HEADER];
    header[0..4].copy_from_slice(&OFFER_MAGIC.to_le_bytes());
    header[4..8].copy_from_slice(&(name.len() as u32).to_le_bytes());
    header[16..24].copy_from_slice(&(secret.len() as u64).to_le_bytes());
    header[32..40].copy_from_slice(&(secret.len() as u64).to_le_bytes());
    let asked = write_all_vectored(
        stream,
        &mut [IoSlice::new(&header), IoSlice::new(name.as_bytes()), IoSlice::new(secret.as_bytes())],
    );
    let mut status = [0u8; 1];
    let answered = asked.and_then(|()| stream.read_exact(&mut status));
    // Both ends have it mapped, or never will: the name is not needed any more.
    let _ = rustix::shm::unlink(name.as_str());
    answered.map_err(|e| e.to_string())?;
    Ok((status[0] == ACCEPTED).then_some(queue))
}

/// Writes every slice (the standard library's `write_all_vectored` is not stable).
fn write_all_vectored(stream: &mut TcpStream, mut slices: &mut [IoSlice<'_>]) -> std::io::Result<()> {
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

    /// A data port whose one registration, `run`, records what it is handed.
    fn data_port() -> (SocketAddr, Arc<Recorder>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let address = listener.local_addr().unwrap();
        let recorder = Arc::new(Recorder::default());
        let sink = recorder.clone();
        serve(listener, TOKEN.into(), Arc::new(move |id| (id == b"run").then(|| sink.clone() as Arc<dyn Deliver>)));
        (address, recorder)
    }

    fn connected(address: SocketAddr) -> TcpStream {
        let mut stream = TcpStream::connect(address).unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let mut nonce = [0u8; 64];
        stream.read_exact(&mut nonce).unwrap();
        let mut hello = MAGIC.to_vec();
        hello.extend_from_slice(&proof(TOKEN, &nonce));
        hello.extend_from_slice(&3u16.to_le_bytes());
        hello.extend_from_slice(b"run");
        stream.write_all(&hello).unwrap();
        let mut status = [0u8];
        stream.read_exact(&mut status).unwrap();
        assert_eq!(status[0], ACCEPTED);
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
        let (address, recorder) = data_port();
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
        let (address, recorder) = data_port();
        // The data port above is worker 0's; this process sends as worker 1.
        let workers = ["127.0.0.1:1".to_string(), "127.0.0.1:2".to_string()];
        let links = Links::new(TOKEN, b"run", 1, &workers, &[u32::from(address.port()), 0], true);
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
        let (address, recorder) = data_port();
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
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let receiver = std::thread::spawn(move || {
            let (mut stream, _) = listener.accept().unwrap();
            stream.write_all(&[b'n'; 64]).unwrap();
            let mut hello = [0u8; 8 + 32 + 2 + 3];
            stream.read_exact(&mut hello).unwrap();
            stream.write_all(&[ACCEPTED]).unwrap();
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
        let links = Links::new(TOKEN, b"run", 1, &workers, &[u32::from(port), 0], true);
        links.send(0, 0, "k#0", &[5, 6, 7], 0, 3, Duration::from_secs(10)).unwrap();
        assert!(!links.is_shared(0));
        assert_eq!(receiver.join().unwrap(), (FRAME_MAGIC, b"k#0\x05\x06\x07".to_vec()));
    }
}
