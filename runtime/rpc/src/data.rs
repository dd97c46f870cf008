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
//! Not encrypted: with `--tls-dir`, workers offer no data port and segments go over gRPC,
//! through TLS.

use std::io::{IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use subtle::ConstantTimeEq;

/// The bytes of one frame at most, as sent: small enough that a segment is summed while its
/// rest is in flight, large enough that a frame costs few system calls.
pub const DATA_CHUNK: usize = 1 << 20;
/// The largest chunk a receiver accepts (a sender's chunks may be smaller).
const MAX_CHUNK: u64 = 16 << 20;
const MAX_KEY: u32 = 4096;
const MAGIC: &[u8; 8] = b"dfcdata1";
const FRAME_MAGIC: u32 = 0x6466_6331;
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
    // Between steps a connection may idle as long as the training loop does.
    stream.set_read_timeout(None).map_err(|e| e.to_string())?;
    let mut key = Vec::new();
    let mut scratch = vec![0u8; PIECE];
    loop {
        let mut header = [0u8; HEADER];
        match stream.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.to_string()),
        }
        let word = |at: usize| u64::from_le_bytes(header[at..at + 8].try_into().expect("8 bytes"));
        let magic = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes"));
        let key_len = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
        let (step, total, offset, len) = (word(8), word(16), word(24), word(32));
        if magic != FRAME_MAGIC
            || key_len > MAX_KEY
            || len > MAX_CHUNK
            || total > crate::MAX_MESSAGE_BYTES as u64
            || offset.checked_add(len).is_none_or(|end| end > total)
        {
            return Err("a malformed frame".into());
        }
        key.resize(key_len as usize, 0);
        stream.read_exact(&mut key).map_err(|e| e.to_string())?;
        let key = std::str::from_utf8(&key).map_err(|_| "a key that is not UTF-8")?;
        if let Some(place) = sink.place(step, key, total, offset, len) {
            // A peer that stops mid-chunk must not hold the lent memory for ever.
            stream.set_read_timeout(Some(sink.chunk_timeout())).map_err(|e| e.to_string())?;
            // SAFETY: `place` lent `len` bytes at `at` to this reader until `placed`.
            let into = unsafe { std::slice::from_raw_parts_mut(place.at, place.len) };
            let read = match place.combine {
                None => stream.read_exact(into),
                Some(combine) => into.chunks_mut(PIECE).try_for_each(|into| {
                    let piece = &mut scratch[..into.len()];
                    stream.read_exact(piece)?;
                    combine(into, piece);
                    Ok(())
                }),
            };
            sink.placed(step, key, offset, len, read.is_ok());
            read.map_err(|e| e.to_string())?;
            stream.set_read_timeout(None).map_err(|e| e.to_string())?;
            continue;
        }
        let mut chunk = Chunk::new(len as usize);
        stream.read_exact(chunk.as_mut_slice()).map_err(|e| e.to_string())?;
        sink.deliver_chunk(step, key, total, offset, chunk)?;
    }
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
    connections: Vec<Mutex<Option<TcpStream>>>,
}

impl Links {
    /// Links to the workers at `grpc_addresses` whose data ports are `data_ports` (0: none).
    pub fn new(token: &str, id: &[u8], rank: usize, grpc_addresses: &[String], data_ports: &[u32]) -> Links {
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
        Links { token: token.to_string(), id: id.to_vec(), addresses, has_port, connections }
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

    fn connect(&self, rank: usize, timeout: Duration) -> Result<TcpStream, String> {
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
            ACCEPTED => Ok(stream),
            BAD_TOKEN => Err(format!("data port {address} refused the token")),
            _ => Err(format!("data port {address} does not know this run")),
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
            let end = (offset + DATA_CHUNK).min(bytes.len());
            // One frame at a time holds the connection, so that segments of several
            // all-reduces under way at once interleave by whole frames.
            let mut connection = self.connections[rank].lock().unwrap_or_else(|e| e.into_inner());
            if connection.is_none() {
                *connection = Some(self.connect(rank, timeout)?);
            }
            let stream = connection.as_mut().expect("connected");
            let mut header = [0u8; HEADER];
            header[0..4].copy_from_slice(&FRAME_MAGIC.to_le_bytes());
            header[4..8].copy_from_slice(&(key.len() as u32).to_le_bytes());
            let words = [(8, step), (16, total as u64), (24, (at + offset) as u64), (32, (end - offset) as u64)];
            for (place, word) in words {
                header[place..place + 8].copy_from_slice(&word.to_le_bytes());
            }
            if let Err(e) = write_all_vectored(
                stream,
                &mut [IoSlice::new(&header), IoSlice::new(key.as_bytes()), IoSlice::new(&bytes[offset..end])],
            ) {
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
}
