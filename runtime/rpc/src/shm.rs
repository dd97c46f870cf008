//! A one-way queue of data-plane frames in shared memory, between two workers on one machine,
//! as NCCL's and Gloo's shared-memory transports serve processes that share a host.
//!
//! Over loopback TCP every chunk is copied into the kernel and out again, with system calls and
//! the TCP stack's work on both sides. Here the sender copies a frame into a slot of a mapping
//! both processes share, and the receiver sums (or copies) its chunk straight out of the slot
//! into the tensor. A futex wakes a side only when it sleeps.
//!
//! The queue is a ring of [`SLOTS`] slots, each room for a frame's header and key and a chunk
//! of up to [`CHUNK`] bytes. Two counters, `published` (by the sender) and `consumed` (by the
//! receiver), count frames modulo 2³¹; the top bit of `published` says that the sender has
//! closed the queue (in the word the receiver sleeps on, so that closing wakes it like a frame
//! does). Each counter sits on a cache line of its own with a flag saying that the other side
//! sleeps on it: a side stores its counter, then (after a `SeqCst` fence) looks at the other's
//! flag; a side that is about to sleep raises its flag, then (after a `SeqCst` fence) looks at
//! the counter once more. Of two fences one comes first, so either the waker sees the flag and
//! wakes the sleeper, or the sleeper sees the counter and does not sleep.
//!
//! Soundness. A slot belongs to the sender from the receiver's release of it until its
//! publication, then to the receiver until it releases it; the counters hand it over with
//! release/acquire, so that the bytes written before a hand-over are seen after it. Each side
//! is one value, [`Sender`] or [`Receiver`], that is `Send` but not `Sync`, and whose methods
//! that move a counter take `&mut self`: no two threads of a process act for one side at once,
//! a frame's bytes are borrowed from the receiver only until it releases the frame, and a
//! queue has one sender (the one that created it) and one receiver (opening claims the
//! queue's receiver flag, so a second `open` fails). The other process is a dfc worker that
//! proved the shared token; one that broke the protocol could only garble the bytes of frames
//! (plain bytes, valid whatever they hold), never make this one read or write out of bounds.
//! `shm_loom` models the protocol (the real code over loom's atomics and cells, futexes as
//! condition variables) and checks every interleaving for lost wake-ups and unordered slots.
//!
//! How it is set up ([`crate::data`]): the sender creates the queue as a POSIX shared-memory
//! object (mode 0600, a random name) holding a random secret, and offers its name and secret
//! over the authenticated TCP connection; the receiver opens it, checks the secret and the
//! layout, and answers; the sender then unlinks the name. From then on the memory lives as
//! long as the two mappings. A receiver on another machine (or in another mount namespace)
//! cannot open the name, and the two go on over TCP.

use rustix::fd::OwnedFd;
use rustix::mm::{MapFlags, ProtFlags};
use rustix::thread::futex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The largest chunk of a frame in the queue: the data plane's frame. (Measured on 2 and 4
/// workers, 4 to 256 MiB: quarter-MiB frames made large all-reduces about half as fast, as
/// every frame costs the ring a hand-off between threads.)
pub const CHUNK: usize = crate::data::DATA_CHUNK;
/// Frames in flight at most (8 were no faster); a power of two, so that slots follow the
/// counters across their wrap.
pub const SLOTS: usize = 4;
/// Room for a frame's header and key at the start of a slot; the chunk follows.
pub const FRAME_ROOM: usize = 8192;
const SLOT_BYTES: usize = FRAME_ROOM + CHUNK;
/// The control page: identity and layout, then the counters on cache lines of their own.
const CONTROL: usize = 4096;
const BYTES: usize = CONTROL + SLOTS * SLOT_BYTES;
const MAGIC: &[u8; 8] = b"dfcshm02";
/// The secret's length (the hex digits of [`crate::auth::random_token`]).
pub const SECRET: usize = 64;

/// The top bit of `published`: the sender has closed the queue.
const CLOSED: u32 = 1 << 31;
/// The counters count frames modulo 2³¹, below [`CLOSED`].
const COUNT: u32 = CLOSED - 1;

// Offsets in the control page.
const AT_MAGIC: usize = 0;
const AT_SECRET: usize = 8;
const AT_SLOTS: usize = AT_SECRET + SECRET;
const AT_SLOT_BYTES: usize = AT_SLOTS + 4;

/// A word of the control page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Word {
    /// Frames published (the sender's), and [`CLOSED`].
    Published,
    /// The receiver sleeps on `Published`.
    ReceiverSleeps,
    /// Frames consumed (the receiver's).
    Consumed,
    /// The sender sleeps on `Consumed`.
    SenderSleeps,
    /// A receiver has opened the queue.
    ReceiverTaken,
}

impl Word {
    #[cfg(test)]
    const ALL: [Word; 5] =
        [Word::Published, Word::ReceiverSleeps, Word::Consumed, Word::SenderSleeps, Word::ReceiverTaken];

    /// Its offset in the control page: each side's words on a cache line of their own.
    fn offset(self) -> usize {
        match self {
            Word::Published => 256,
            Word::ReceiverSleeps => 260,
            Word::Consumed => 320,
            Word::SenderSleeps => 324,
            Word::ReceiverTaken => 384,
        }
    }

    #[cfg(test)]
    fn index(self) -> usize {
        self as usize
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Where a queue's control words and slots live: a [`Mapping`] of shared memory, or (in the
/// tests) loom's model of one. Sealed: the queue's soundness rests on these methods doing
/// what they say.
pub trait Memory: sealed::Sealed {
    /// The number of slots (a power of two).
    fn slots(&self) -> u32;
    fn load(&self, word: Word, order: Ordering) -> u32;
    fn store(&self, word: Word, value: u32, order: Ordering);
    /// A `SeqCst` fence.
    fn fence(&self);
    /// Sleeps while `word` holds `seen`, until woken, for at most about `timeout` (or returns
    /// at once, or early: callers look again).
    fn wait(&self, word: Word, seen: u32, timeout: Duration);
    /// Wakes a side sleeping on `word`.
    fn wake(&self, word: Word);
    /// Copies `bytes` into slot `slot` from byte `at` on.
    ///
    /// # Safety
    /// The caller's side holds the slot (see the module's documentation), and
    /// `at + bytes.len()` is at most [`FRAME_ROOM`] + [`CHUNK`].
    unsafe fn write_slot(&self, slot: u32, at: usize, bytes: &[u8]);
    /// Calls `read` on `len` bytes of slot `slot` from byte `at` on.
    ///
    /// # Safety
    /// As for [`write_slot`](Memory::write_slot).
    unsafe fn read_slot<R>(&self, slot: u32, at: usize, len: usize, read: impl FnOnce(&[u8]) -> R) -> R;
}

/// A queue's shared mapping.
pub struct Mapping {
    base: std::ptr::NonNull<u8>,
}

// SAFETY: a mapping is owned by the one `Sender` or `Receiver` that made it, and nothing in it
// is tied to the thread that mapped it; moving it moves that side's only handle. It is not
// `Sync`: a side's methods assume one thread at a time.
unsafe impl Send for Mapping {}

impl std::fmt::Debug for Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mapping").field("base", &self.base).finish()
    }
}

impl Mapping {
    fn new(fd: &OwnedFd, name: &str) -> Result<Mapping, String> {
        // SAFETY: a fresh shared mapping of the whole file, at an address the kernel picks;
        // nothing else in this process refers to it, and `Drop` unmaps it.
        let base = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), BYTES, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0)
        }
        .map_err(|e| format!("shared memory {name}: {e}"))?;
        let base = std::ptr::NonNull::new(base.cast()).ok_or_else(|| format!("shared memory {name}: mapped at 0"))?;
        Ok(Mapping { base })
    }

    fn atomic(&self, word: Word) -> &AtomicU32 {
        // SAFETY: every word's offset is within the control page and 4-aligned (the mapping is
        // page-aligned); an `AtomicU32` has `u32`'s layout, the mapping lives as long as
        // `self`, and both processes touch these words only atomically.
        unsafe { &*self.base.as_ptr().add(word.offset()).cast::<AtomicU32>() }
    }

    fn slot(&self, slot: u32, at: usize, len: usize) -> *mut u8 {
        assert!(slot < SLOTS as u32 && at.checked_add(len).is_some_and(|end| end <= SLOT_BYTES));
        // SAFETY: by the assertion, within the mapping (`CONTROL + SLOTS * SLOT_BYTES` bytes).
        unsafe { self.base.as_ptr().add(CONTROL + slot as usize * SLOT_BYTES + at) }
    }

    /// The control page's identity and layout, written by the creator before it offers the name.
    fn control(&self) -> &[u8] {
        // SAFETY: the control page is the mapping's first `CONTROL` bytes. Its identity bytes
        // are written once, by `Sender::create` before the name is offered, and never again;
        // the words past them change, but only atomically, and this slice is only read for the
        // identity (plain bytes, valid whatever they hold).
        unsafe { std::slice::from_raw_parts(self.base.as_ptr(), AT_SLOT_BYTES + 4) }
    }
}

impl sealed::Sealed for Mapping {}

impl Memory for Mapping {
    fn slots(&self) -> u32 {
        SLOTS as u32
    }

    fn load(&self, word: Word, order: Ordering) -> u32 {
        self.atomic(word).load(order)
    }

    fn store(&self, word: Word, value: u32, order: Ordering) {
        self.atomic(word).store(value, order)
    }

    fn fence(&self) {
        std::sync::atomic::fence(Ordering::SeqCst);
    }

    fn wait(&self, word: Word, seen: u32, timeout: Duration) {
        let timeout = futex::Timespec { tv_sec: timeout.as_secs() as _, tv_nsec: timeout.subsec_nanos() as _ };
        // Returns at once if the word moved since `seen`; errors (a timeout, a signal) are
        // answered by the caller looking again.
        let _ = futex::wait(self.atomic(word), futex::Flags::empty(), seen, Some(&timeout));
    }

    fn wake(&self, word: Word) {
        let _ = futex::wake(self.atomic(word), futex::Flags::empty(), 1);
    }

    unsafe fn write_slot(&self, slot: u32, at: usize, bytes: &[u8]) {
        let to = self.slot(slot, at, bytes.len());
        // SAFETY: `slot` checked the range; the caller holds the slot, so the other side
        // neither reads nor writes it now; `bytes` is our own memory, not the mapping.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), to, bytes.len()) }
    }

    unsafe fn read_slot<R>(&self, slot: u32, at: usize, len: usize, read: impl FnOnce(&[u8]) -> R) -> R {
        let from = self.slot(slot, at, len);
        // SAFETY: `slot` checked the range; the caller holds the slot, so the other side does
        // not write it while `read` runs (the slice does not outlive the call).
        read(unsafe { std::slice::from_raw_parts(from, len) })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, which nothing refers to any more (every borrow of
        // it is tied to `&self`).
        let _ = unsafe { rustix::mm::munmap(self.base.as_ptr().cast(), BYTES) };
    }
}

/// The sending side of a queue. Dropping it closes the queue: the receiver ends once it has
/// taken what was published.
///
/// Either side may move to another thread, but not be shared by two:
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<dfc_rpc::shm::Sender>();
/// ```
/// ```compile_fail
/// fn shared<T: Sync>() {}
/// shared::<dfc_rpc::shm::Receiver>();
/// ```
/// ```
/// fn moved<T: Send>() {}
/// moved::<dfc_rpc::shm::Sender>();
/// moved::<dfc_rpc::shm::Receiver>();
/// ```
pub struct Sender<M: Memory = Mapping> {
    memory: M,
}

/// The receiving side of a queue.
pub struct Receiver<M: Memory = Mapping> {
    memory: M,
    /// Whether the receiver holds the frame in the slot `consumed` names (from [`Next::Frame`]
    /// until [`Receiver::release`]).
    holding: bool,
}

impl<M: Memory> std::fmt::Debug for Sender<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender").field("published", &self.memory.load(Word::Published, Ordering::Relaxed)).finish()
    }
}

impl<M: Memory> std::fmt::Debug for Receiver<M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Receiver").field("consumed", &self.memory.load(Word::Consumed, Ordering::Relaxed)).finish()
    }
}

/// What a receiver waiting for the next frame found.
#[derive(Debug, PartialEq, Eq)]
pub enum Next {
    /// A frame is in the current slot: read it with [`Receiver::head`] and
    /// [`Receiver::read_chunk`], then [`Receiver::release`] it.
    Frame,
    /// Nothing came within the wait.
    Idle,
    /// The sender closed the queue and every frame it published has been taken.
    Closed,
}

impl Sender<Mapping> {
    /// Creates a queue under a fresh name; returns its sender with the name and secret.
    pub fn create() -> Result<(Sender, String, String), String> {
        let name = format!("/dfc-{}-{}", std::process::id(), &crate::auth::random_token()[..32]);
        let secret = crate::auth::random_token();
        let flags = rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR;
        let fd = rustix::shm::open(name.as_str(), flags, rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR)
            .map_err(|e| format!("shared memory {name}: {e}"))?;
        // Reserved now, so that a full /dev/shm fails here rather than as a SIGBUS on a slot.
        let mapping = rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, BYTES as u64)
            .map_err(|e| format!("shared memory {name}: {e}"))
            .and_then(|()| Mapping::new(&fd, &name));
        let mapping = match mapping {
            Ok(mapping) => mapping,
            Err(e) => {
                let _ = rustix::shm::unlink(name.as_str());
                return Err(e);
            }
        };
        // SAFETY: the mapping's first `CONTROL` bytes are the control page, which is ours
        // alone until the name is given to the receiver (no other process knows it, and the
        // mapping is fresh: no reference into it exists).
        let control = unsafe { std::slice::from_raw_parts_mut(mapping.base.as_ptr(), CONTROL) };
        control[AT_MAGIC..AT_MAGIC + 8].copy_from_slice(MAGIC);
        control[AT_SECRET..AT_SECRET + SECRET].copy_from_slice(secret.as_bytes());
        control[AT_SLOTS..AT_SLOTS + 4].copy_from_slice(&(SLOTS as u32).to_le_bytes());
        control[AT_SLOT_BYTES..AT_SLOT_BYTES + 4].copy_from_slice(&(SLOT_BYTES as u32).to_le_bytes());
        Ok((Sender { memory: mapping }, name, secret))
    }
}

impl Receiver<Mapping> {
    /// Opens the queue a sender offered under `name` with `secret`, if it is one: a name of the
    /// form [`Sender::create`] makes, a file of the queue's size, the same secret and layout
    /// inside, and no receiver yet.
    pub fn open(name: &str, secret: &[u8]) -> Result<Receiver, String> {
        let well_formed = name
            .strip_prefix("/dfc-")
            .is_some_and(|rest| !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-'));
        if !well_formed || name.len() > 128 {
            return Err(format!("`{name}` is not the name of a dfc queue"));
        }
        let fd = rustix::shm::open(name, rustix::shm::OFlags::RDWR, rustix::fs::Mode::empty())
            .map_err(|e| format!("shared memory {name}: {e}"))?;
        let size = rustix::fs::fstat(&fd).map_err(|e| format!("shared memory {name}: {e}"))?.st_size;
        if size != BYTES as i64 {
            return Err(format!("shared memory {name}: {size} bytes, not a queue's {BYTES}"));
        }
        let mapping = Mapping::new(&fd, name)?;
        let control = mapping.control();
        let word = |at: usize| u32::from_le_bytes(control[at..at + 4].try_into().expect("4 bytes"));
        let same_secret: bool = subtle::ConstantTimeEq::ct_eq(&control[AT_SECRET..AT_SECRET + SECRET], secret).into();
        if &control[AT_MAGIC..AT_MAGIC + 8] != MAGIC
            || !same_secret
            || word(AT_SLOTS) != SLOTS as u32
            || word(AT_SLOT_BYTES) != SLOT_BYTES as u32
        {
            return Err(format!("shared memory {name} is not the queue offered"));
        }
        if mapping.atomic(Word::ReceiverTaken).compare_exchange(0, 1, Ordering::AcqRel, Ordering::Relaxed).is_err() {
            return Err(format!("shared memory {name} already has a receiver"));
        }
        Ok(Receiver { memory: mapping, holding: false })
    }
}

impl<M: Memory> Sender<M> {
    /// Sends one frame: `head` (its header and key, at most [`FRAME_ROOM`] bytes in all) and `chunk`
    /// (at most [`CHUNK`] bytes), waiting for a free slot until `deadline`; `alive` is asked
    /// every so often while it waits whether the receiver is still there.
    pub fn push(
        &mut self,
        head: &[&[u8]],
        chunk: &[u8],
        deadline: Instant,
        alive: &mut dyn FnMut() -> bool,
    ) -> Result<(), String> {
        assert!(head.iter().map(|h| h.len()).sum::<usize>() <= FRAME_ROOM && chunk.len() <= CHUNK);
        let memory = &self.memory;
        // Only this side writes `published`, and a sender is closed only when dropped.
        let published = memory.load(Word::Published, Ordering::Relaxed) & COUNT;
        let has_room =
            || published.wrapping_sub(memory.load(Word::Consumed, Ordering::Acquire)) & COUNT < memory.slots();
        if !has_room() {
            wait_until(memory, Word::Consumed, Word::SenderSleeps, has_room, deadline, alive)
                .map_err(|why| format!("the receiving worker's queue stayed full: {why}"))?;
        }
        let slot = published % memory.slots();
        let mut at = 0;
        for part in head {
            // SAFETY: the slot is the sender's: the receiver has consumed it (`has_room`'s
            // acquire load saw its release), and it is not published yet; the head parts fit
            // in `FRAME_ROOM` (asserted above).
            unsafe { memory.write_slot(slot, at, part) };
            at += part.len();
        }
        // SAFETY: as above; the chunk fits in `CHUNK` after the head's room.
        unsafe { memory.write_slot(slot, FRAME_ROOM, chunk) };
        self.publish(published.wrapping_add(1) & COUNT);
        Ok(())
    }

    /// Stores `published` (handing the slots before it to the receiver) and wakes the receiver
    /// if it sleeps.
    fn publish(&self, published: u32) {
        self.memory.store(Word::Published, published, Ordering::Release);
        self.memory.fence();
        if self.memory.load(Word::ReceiverSleeps, Ordering::Relaxed) != 0 {
            self.memory.wake(Word::Published);
        }
    }
}

impl<M: Memory> Drop for Sender<M> {
    fn drop(&mut self) {
        let published = self.memory.load(Word::Published, Ordering::Relaxed);
        self.publish(published | CLOSED);
    }
}

impl<M: Memory> Receiver<M> {
    /// Waits up to `wait` for the next frame (or, while one is held, returns it again).
    pub fn next(&mut self, wait: Duration) -> Next {
        if self.holding {
            return Next::Frame;
        }
        let memory = &self.memory;
        // Only this side writes `consumed`.
        let consumed = memory.load(Word::Consumed, Ordering::Relaxed);
        let ready = || {
            let published = memory.load(Word::Published, Ordering::Acquire);
            published & COUNT != consumed || published & CLOSED != 0
        };
        if !ready() {
            let deadline = Instant::now() + wait;
            if wait_until(memory, Word::Published, Word::ReceiverSleeps, ready, deadline, &mut || true).is_err() {
                return Next::Idle;
            }
        }
        // The sender closes after its last publication, in the same word: a closed queue shows
        // every frame.
        if memory.load(Word::Published, Ordering::Acquire) & COUNT != consumed {
            self.holding = true;
            Next::Frame
        } else {
            Next::Closed
        }
    }

    /// The slot of the frame held.
    fn held(&self) -> u32 {
        assert!(self.holding, "no frame is held: `next` has not returned `Next::Frame` since the last release");
        self.memory.load(Word::Consumed, Ordering::Relaxed) % self.memory.slots()
    }

    /// Copies the held frame's head bytes from `at` (its header, then its key) into `into`.
    pub fn head(&self, at: usize, into: &mut [u8]) {
        assert!(at.checked_add(into.len()).is_some_and(|end| end <= FRAME_ROOM));
        let slot = self.held();
        // SAFETY: the receiver holds the slot (`held`): published (`next`'s acquire load saw
        // the sender's release) and not released; the range lies in the head's room.
        unsafe { self.memory.read_slot(slot, at, into.len(), |head| into.copy_from_slice(head)) }
    }

    /// Calls `read` on the first `len` bytes of the held frame's chunk.
    pub fn read_chunk<R>(&self, len: usize, read: impl FnOnce(&[u8]) -> R) -> R {
        assert!(len <= CHUNK);
        let slot = self.held();
        // SAFETY: as in `head`; the range lies in the chunk's room.
        unsafe { self.memory.read_slot(slot, FRAME_ROOM, len, read) }
    }

    /// Hands the held frame's slot back to the sender.
    pub fn release(&mut self) {
        self.held();
        self.holding = false;
        let consumed = self.memory.load(Word::Consumed, Ordering::Relaxed).wrapping_add(1) & COUNT;
        self.memory.store(Word::Consumed, consumed, Ordering::Release);
        self.memory.fence();
        if self.memory.load(Word::SenderSleeps, Ordering::Relaxed) != 0 {
            self.memory.wake(Word::Consumed);
        }
    }
}

/// Waits until `ready()`, which turns true only after `counter` changes: sleeps on the counter
/// with `sleeps` raised, so that the other side wakes it. (It does not spin first: workers on
/// one machine often outnumber its cores, and spinning was no faster.) Fails at the deadline,
/// or when `alive()` (asked every 100 ms of sleep) says the other side is gone.
fn wait_until<M: Memory>(
    memory: &M,
    counter: Word,
    sleeps: Word,
    ready: impl Fn() -> bool,
    deadline: Instant,
    alive: &mut dyn FnMut() -> bool,
) -> Result<(), &'static str> {
    loop {
        let seen = memory.load(counter, Ordering::Relaxed);
        memory.store(sleeps, 1, Ordering::Relaxed);
        // The other half of the Dekker pair (see the module's documentation): the other side
        // stores the counter, fences, then reads the flag.
        memory.fence();
        if ready() {
            memory.store(sleeps, 0, Ordering::Relaxed);
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            memory.store(sleeps, 0, Ordering::Relaxed);
            return Err("timed out");
        }
        let nap = (deadline - now).min(Duration::from_millis(100));
        memory.wait(counter, seen, nap);
        memory.store(sleeps, 0, Ordering::Relaxed);
        if ready() {
            return Ok(());
        }
        if nap == Duration::from_millis(100) && !alive() {
            return Err("the other worker went away");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(30)
    }

    #[test]
    fn frames_cross_in_order_through_a_full_queue() {
        let (mut sender, name, secret) = Sender::create().unwrap();
        let mut receiver = Receiver::open(&name, secret.as_bytes()).unwrap();
        rustix::shm::unlink(name.as_str()).unwrap();
        let frames = 5 * SLOTS as u32 + 3;
        let consumer = std::thread::spawn(move || {
            let mut seen = Vec::new();
            loop {
                match receiver.next(Duration::from_millis(50)) {
                    Next::Frame => {
                        let mut head = [0u8; 8];
                        receiver.head(0, &mut head);
                        let n = u32::from_le_bytes(head[..4].try_into().unwrap());
                        let len = u32::from_le_bytes(head[4..].try_into().unwrap()) as usize;
                        let whole = receiver.read_chunk(len, |chunk| chunk.iter().all(|&b| b == n as u8));
                        assert!(whole, "frame {n}'s bytes");
                        seen.push(n);
                        receiver.release();
                    }
                    Next::Idle => {}
                    Next::Closed => return seen,
                }
            }
        });
        for n in 0..frames {
            let len = (n as usize * 7919) % CHUNK + 1;
            let chunk = vec![n as u8; len];
            sender.push(&[&n.to_le_bytes(), &(len as u32).to_le_bytes()], &chunk, far(), &mut || true).unwrap();
        }
        drop(sender);
        assert_eq!(consumer.join().unwrap(), (0..frames).collect::<Vec<_>>());
    }

    #[test]
    fn a_full_queue_whose_receiver_is_gone_fails_the_sender() {
        let (mut sender, name, _) = Sender::create().unwrap();
        rustix::shm::unlink(name.as_str()).unwrap();
        for _ in 0..SLOTS {
            sender.push(&[b"x"], &[1, 2, 3], far(), &mut || true).unwrap();
        }
        let started = Instant::now();
        let error = sender.push(&[b"x"], &[1], far(), &mut || false).unwrap_err();
        assert!(error.contains("went away"), "{error}");
        assert!(started.elapsed() < Duration::from_secs(5));
        let error = sender.push(&[b"x"], &[1], Instant::now() + Duration::from_millis(30), &mut || true).unwrap_err();
        assert!(error.contains("timed out"), "{error}");
    }

    #[test]
    fn only_the_offered_queue_opens_and_only_once() {
        let (_sender, name, secret) = Sender::create().unwrap();
        assert!(Receiver::open(&name, b"another secret, of the same length as the real one, 64 bytes...")
            .unwrap_err()
            .contains("not the queue offered"));
        for bad in ["/dfc-../../etc/passwd", "dfc-x", "/dfc-", "/other-1", "/dfc-a/b"] {
            assert!(Receiver::open(bad, secret.as_bytes()).is_err(), "{bad}");
        }
        assert!(Receiver::open("/dfc-0-doesnotexist", secret.as_bytes()).is_err());
        let _receiver = Receiver::open(&name, secret.as_bytes()).unwrap();
        let second = Receiver::open(&name, secret.as_bytes()).unwrap_err();
        assert!(second.contains("already has a receiver"), "{second}");
        rustix::shm::unlink(name.as_str()).unwrap();
        assert!(Receiver::open(&name, secret.as_bytes()).is_err(), "gone once unlinked");
    }

    #[test]
    fn a_receiver_reads_only_the_frame_it_holds() {
        let (mut sender, name, secret) = Sender::create().unwrap();
        let mut receiver = Receiver::open(&name, secret.as_bytes()).unwrap();
        rustix::shm::unlink(name.as_str()).unwrap();
        sender.push(&[b"one"], &[1], far(), &mut || true).unwrap();
        assert_eq!(receiver.next(Duration::ZERO), Next::Frame);
        assert_eq!(receiver.next(Duration::ZERO), Next::Frame, "the held frame, again");
        receiver.release();
        assert_eq!(receiver.next(Duration::ZERO), Next::Idle);
        let unheld = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| receiver.read_chunk(1, |c| c[0])));
        assert!(unheld.is_err(), "reading with no frame held is refused");
        drop(sender);
        assert_eq!(receiver.next(Duration::ZERO), Next::Closed);
    }
}

/// The protocol under loom: every interleaving (up to a bound on preemptions) of a sender and
/// a receiver running the code above over loom's atomics, with each slot a loom cell (which
/// reports a slot touched by both sides without a hand-over between) and each futex a
/// condition variable with no timeout (so that a lost wake-up is a deadlock, which loom
/// reports, instead of a 100 ms stall).
#[cfg(test)]
mod shm_loom {
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::{Arc, Condvar, Mutex};

    /// The shared memory of one queue, as loom sees it.
    struct Model {
        words: [loom::sync::atomic::AtomicU32; Word::ALL.len()],
        slots: Vec<UnsafeCell<Vec<u8>>>,
        futex: Mutex<()>,
        woken: Condvar,
    }

    #[derive(Clone)]
    struct Shared(Arc<Model>);

    impl sealed::Sealed for Shared {}

    impl Memory for Shared {
        fn slots(&self) -> u32 {
            self.0.slots.len() as u32
        }

        fn load(&self, word: Word, order: Ordering) -> u32 {
            self.0.words[word.index()].load(order)
        }

        fn store(&self, word: Word, value: u32, order: Ordering) {
            self.0.words[word.index()].store(value, order)
        }

        fn fence(&self) {
            loom::sync::atomic::fence(Ordering::SeqCst);
        }

        fn wait(&self, word: Word, seen: u32, _timeout: Duration) {
            // A futex: the check and the sleep are one step as far as a waker is concerned.
            let guard = self.0.futex.lock().unwrap();
            if self.0.words[word.index()].load(Ordering::Relaxed) == seen {
                drop(self.0.woken.wait(guard).unwrap());
            }
        }

        fn wake(&self, _word: Word) {
            let _guard = self.0.futex.lock().unwrap();
            self.0.woken.notify_all();
        }

        unsafe fn write_slot(&self, slot: u32, at: usize, bytes: &[u8]) {
            self.0.slots[slot as usize].with_mut(|cell| {
                // SAFETY: loom checks the caller's claim to hold the slot: this access to the cell
                // is exclusive unless loom reports otherwise.
                let cell = unsafe { &mut *cell };
                cell[at..at + bytes.len()].copy_from_slice(bytes)
            })
        }

        unsafe fn read_slot<R>(&self, slot: u32, at: usize, len: usize, read: impl FnOnce(&[u8]) -> R) -> R {
            self.0.slots[slot as usize].with(|cell| {
                // SAFETY: as in `write_slot`, for a shared access.
                let cell = unsafe { &*cell };
                read(&cell[at..at + len])
            })
        }
    }

    /// A queue of `slots` slots: its two sides.
    fn queue(slots: usize) -> (Sender<Shared>, Receiver<Shared>) {
        let model = Model {
            words: Word::ALL.map(|_| loom::sync::atomic::AtomicU32::new(0)),
            slots: (0..slots).map(|_| UnsafeCell::new(vec![0u8; FRAME_ROOM + 8])).collect(),
            futex: Mutex::new(()),
            woken: Condvar::new(),
        };
        let shared = Shared(Arc::new(model));
        (Sender { memory: shared.clone() }, Receiver { memory: shared, holding: false })
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    /// Sends `frames` frames through a queue of `slots` slots and checks that they come in order,
    /// each with its own bytes, then the end.
    fn model_frames(slots: usize, frames: u8) {
        let mut builder = loom::model::Builder::new();
        builder.preemption_bound = Some(3);
        builder.check(move || {
            let (mut sender, mut receiver) = queue(slots);
            let sending = loom::thread::spawn(move || {
                for n in 1..=frames {
                    sender.push(&[&[n]], &[n, n], far(), &mut || true).unwrap();
                }
            });
            let mut seen = Vec::new();
            loop {
                match receiver.next(Duration::from_secs(3600)) {
                    Next::Frame => {
                        let mut head = [0u8];
                        receiver.head(0, &mut head);
                        assert_eq!(receiver.read_chunk(2, |chunk| chunk.to_vec()), [head[0]; 2]);
                        seen.push(head[0]);
                        receiver.release();
                    }
                    Next::Idle => panic!("an untimed wait timed out"),
                    Next::Closed => break,
                }
            }
            sending.join().unwrap();
            assert_eq!(seen, (1..=frames).collect::<Vec<u8>>());
        });
    }

    #[test]
    fn shm_loom_frames_through_a_full_queue() {
        model_frames(1, 3);
    }

    #[test]
    fn shm_loom_frames_through_two_slots() {
        model_frames(2, 3);
    }
}
