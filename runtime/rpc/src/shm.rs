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
//! receiver), count frames; each sits on a cache line of its own with a flag saying that the
//! other side sleeps on it (the flag and the counter are a Dekker pair: a side that publishes
//! then finds no sleeper knows the sleeper will see what it published before it sleeps).
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
use std::sync::atomic::{fence, AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The largest chunk of a frame in the queue: the data plane's frame. (Measured on 2 and 4
/// workers, 4 to 256 MiB: quarter-MiB frames made large all-reduces about half as fast, as
/// every frame costs the ring a hand-off between threads.)
pub const CHUNK: usize = crate::data::DATA_CHUNK;
/// Frames in flight at most (8 were no faster).
pub const SLOTS: usize = 4;
/// Room for a frame's header and key at the start of a slot; the chunk follows.
pub const FRAME_ROOM: usize = 8192;
const SLOT_BYTES: usize = FRAME_ROOM + CHUNK;
/// The control page: identity and layout, then the counters on cache lines of their own.
const CONTROL: usize = 4096;
const BYTES: usize = CONTROL + SLOTS * SLOT_BYTES;
const MAGIC: &[u8; 8] = b"dfcshm01";
/// The secret's length (the hex digits of [`crate::auth::random_token`]).
pub const SECRET: usize = 64;

// Offsets in the control page.
const AT_MAGIC: usize = 0;
const AT_SECRET: usize = 8;
const AT_SLOTS: usize = AT_SECRET + SECRET;
const AT_SLOT_BYTES: usize = AT_SLOTS + 4;
const AT_PUBLISHED: usize = 256;
const AT_RECEIVER_SLEEPS: usize = AT_PUBLISHED + 4;
const AT_CONSUMED: usize = 320;
const AT_SENDER_SLEEPS: usize = AT_CONSUMED + 4;
const AT_CLOSED: usize = 384;

/// One side of a queue: the mapping.
pub struct Queue {
    base: *mut u8,
}

// SAFETY: the mapping is shared memory that both sides only touch through atomics (the control
// page) and through slots that the counters hand from one side to the other.
unsafe impl Send for Queue {}
unsafe impl Sync for Queue {}

impl std::fmt::Debug for Queue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Queue").field("base", &self.base).finish()
    }
}

/// What a receiver waiting for the next frame found.
pub enum Next {
    /// A frame is in the current slot: read it with [`Queue::head`] and [`Queue::chunk`], then
    /// [`Queue::release`].
    Frame,
    /// Nothing came within the wait.
    Idle,
    /// The sender closed the queue and every frame it published has been taken.
    Closed,
}

impl Queue {
    /// Creates a queue under a fresh name; returns it with its name and secret.
    pub fn create() -> Result<(Queue, String, String), String> {
        let name = format!("/dfc-{}-{}", std::process::id(), &crate::auth::random_token()[..32]);
        let secret = crate::auth::random_token();
        let flags = rustix::shm::OFlags::CREATE | rustix::shm::OFlags::EXCL | rustix::shm::OFlags::RDWR;
        let fd = rustix::shm::open(name.as_str(), flags, rustix::fs::Mode::RUSR | rustix::fs::Mode::WUSR)
            .map_err(|e| format!("shared memory {name}: {e}"))?;
        // Reserved now, so that a full /dev/shm fails here rather than as a SIGBUS on a slot.
        let queue = rustix::fs::fallocate(&fd, rustix::fs::FallocateFlags::empty(), 0, BYTES as u64)
            .map_err(|e| format!("shared memory {name}: {e}"))
            .and_then(|()| Queue::map(&fd, &name));
        let queue = match queue {
            Ok(queue) => queue,
            Err(e) => {
                let _ = rustix::shm::unlink(name.as_str());
                return Err(e);
            }
        };
        // SAFETY: the control page is ours alone until the name is given to the receiver.
        unsafe {
            let control = std::slice::from_raw_parts_mut(queue.base, CONTROL);
            control[AT_MAGIC..AT_MAGIC + 8].copy_from_slice(MAGIC);
            control[AT_SECRET..AT_SECRET + SECRET].copy_from_slice(secret.as_bytes());
            control[AT_SLOTS..AT_SLOTS + 4].copy_from_slice(&(SLOTS as u32).to_le_bytes());
            control[AT_SLOT_BYTES..AT_SLOT_BYTES + 4].copy_from_slice(&(SLOT_BYTES as u32).to_le_bytes());
        }
        Ok((queue, name, secret))
    }

    /// Opens the queue a sender offered under `name` with `secret`, if it is one: a name of the
    /// form [`create`](Queue::create) makes, a file of the queue's size, and the same secret
    /// and layout inside.
    pub fn open(name: &str, secret: &[u8]) -> Result<Queue, String> {
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
        let queue = Queue::map(&fd, name)?;
        // SAFETY: the file has the queue's size; the control page's identity is written once,
        // before the name was offered.
        let control = unsafe { std::slice::from_raw_parts(queue.base, CONTROL) };
        let word = |at: usize| u32::from_le_bytes(control[at..at + 4].try_into().expect("4 bytes"));
        let same_secret: bool = subtle::ConstantTimeEq::ct_eq(&control[AT_SECRET..AT_SECRET + SECRET], secret).into();
        if &control[AT_MAGIC..AT_MAGIC + 8] != MAGIC
            || !same_secret
            || word(AT_SLOTS) != SLOTS as u32
            || word(AT_SLOT_BYTES) != SLOT_BYTES as u32
        {
            return Err(format!("shared memory {name} is not the queue offered"));
        }
        Ok(queue)
    }

    fn map(fd: &OwnedFd, name: &str) -> Result<Queue, String> {
        // SAFETY: a fresh shared mapping of the whole file; unmapped on drop.
        let base = unsafe {
            rustix::mm::mmap(std::ptr::null_mut(), BYTES, ProtFlags::READ | ProtFlags::WRITE, MapFlags::SHARED, fd, 0)
        }
        .map_err(|e| format!("shared memory {name}: {e}"))?;
        Ok(Queue { base: base.cast() })
    }

    fn counter(&self, at: usize) -> &AtomicU32 {
        // SAFETY: within the control page, 4-aligned (the mapping is page-aligned); shared
        // memory that both sides touch only atomically.
        unsafe { &*self.base.add(at).cast::<AtomicU32>() }
    }

    fn slot(&self, frame: u32) -> *mut u8 {
        // SAFETY: slot `frame mod SLOTS` lies within the mapping.
        unsafe { self.base.add(CONTROL + (frame as usize % SLOTS) * SLOT_BYTES) }
    }

    /// Sends one frame: `head` (its header and key, at most [`FRAME_ROOM`] bytes in all) and `chunk`
    /// (at most [`CHUNK`] bytes), waiting for a free slot until `deadline`; `alive` is asked
    /// every so often while it waits whether the receiver is still there.
    pub fn push(
        &self,
        head: &[&[u8]],
        chunk: &[u8],
        deadline: Instant,
        alive: &mut dyn FnMut() -> bool,
    ) -> Result<(), String> {
        assert!(head.iter().map(|h| h.len()).sum::<usize>() <= FRAME_ROOM && chunk.len() <= CHUNK);
        let published = self.counter(AT_PUBLISHED).load(Ordering::Relaxed);
        let consumed = self.counter(AT_CONSUMED);
        let has_room = || published.wrapping_sub(consumed.load(Ordering::Acquire)) < SLOTS as u32;
        if !has_room() {
            let sleeps = self.counter(AT_SENDER_SLEEPS);
            wait_until(consumed, sleeps, has_room, deadline, alive)
                .map_err(|why| format!("the receiving worker's queue stayed full: {why}"))?;
        }
        let slot = self.slot(published);
        // SAFETY: the slot is free (the receiver has consumed it) and ours until published.
        unsafe {
            let mut at = slot;
            for part in head {
                std::ptr::copy_nonoverlapping(part.as_ptr(), at, part.len());
                at = at.add(part.len());
            }
            std::ptr::copy_nonoverlapping(chunk.as_ptr(), slot.add(FRAME_ROOM), chunk.len());
        }
        self.counter(AT_PUBLISHED).store(published.wrapping_add(1), Ordering::SeqCst);
        wake_if_asleep(self.counter(AT_PUBLISHED), self.counter(AT_RECEIVER_SLEEPS));
        Ok(())
    }

    /// Waits up to `wait` for the next frame.
    pub fn next(&self, wait: Duration) -> Next {
        let consumed = self.counter(AT_CONSUMED).load(Ordering::Relaxed);
        let published = self.counter(AT_PUBLISHED);
        let closed = self.counter(AT_CLOSED);
        let has_frame = || published.load(Ordering::Acquire) != consumed;
        let ready = || has_frame() || closed.load(Ordering::Acquire) != 0;
        if !ready() {
            let sleeps = self.counter(AT_RECEIVER_SLEEPS);
            if wait_until(published, sleeps, ready, Instant::now() + wait, &mut || true).is_err() {
                return Next::Idle;
            }
        }
        // The sender closes after its last publication, so a closed queue shows every frame.
        if has_frame() {
            Next::Frame
        } else {
            Next::Closed
        }
    }

    /// Copies the current frame's head bytes from `at` (its header, then its key) into `into`.
    pub fn head(&self, at: usize, into: &mut [u8]) {
        assert!(at + into.len() <= FRAME_ROOM);
        let slot = self.slot(self.counter(AT_CONSUMED).load(Ordering::Relaxed));
        // SAFETY: the slot was published and is not written again until released.
        unsafe { std::ptr::copy_nonoverlapping(slot.add(at), into.as_mut_ptr(), into.len()) }
    }

    /// The first `len` bytes of the current frame's chunk; valid until [`release`](Queue::release).
    pub fn chunk(&self, len: usize) -> &[u8] {
        assert!(len <= CHUNK);
        let slot = self.slot(self.counter(AT_CONSUMED).load(Ordering::Relaxed));
        // SAFETY: as in `head`.
        unsafe { std::slice::from_raw_parts(slot.add(FRAME_ROOM), len) }
    }

    /// Hands the current slot back to the sender.
    pub fn release(&self) {
        let consumed = self.counter(AT_CONSUMED);
        consumed.store(consumed.load(Ordering::Relaxed).wrapping_add(1), Ordering::SeqCst);
        wake_if_asleep(consumed, self.counter(AT_SENDER_SLEEPS));
    }

    /// The sender is done: the receiver ends once it has taken what was published.
    pub fn close(&self) {
        self.counter(AT_CLOSED).store(1, Ordering::SeqCst);
        // The receiver sleeps on `published`.
        let _ = futex::wake(self.counter(AT_PUBLISHED), futex::Flags::empty(), 1);
    }
}

impl Drop for Queue {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, no longer used.
        let _ = unsafe { rustix::mm::munmap(self.base.cast(), BYTES) };
    }
}

/// Waits until `ready()`, which turns true only after `counter` changes: sleeps on the counter
/// with `sleeps` raised, so that the other side wakes it. (It does not spin first: workers on
/// one machine often outnumber its cores, and spinning was no faster.) Fails at the deadline,
/// or when `alive()` (asked every 100 ms of sleep) says the other side is gone.
fn wait_until(
    counter: &AtomicU32,
    sleeps: &AtomicU32,
    ready: impl Fn() -> bool,
    deadline: Instant,
    alive: &mut dyn FnMut() -> bool,
) -> Result<(), &'static str> {
    loop {
        let seen = counter.load(Ordering::SeqCst);
        sleeps.store(1, Ordering::SeqCst);
        if ready() {
            sleeps.store(0, Ordering::Relaxed);
            return Ok(());
        }
        let now = Instant::now();
        if now >= deadline {
            sleeps.store(0, Ordering::Relaxed);
            return Err("timed out");
        }
        let nap = (deadline - now).min(Duration::from_millis(100));
        let timeout = futex::Timespec { tv_sec: nap.as_secs() as _, tv_nsec: nap.subsec_nanos() as _ };
        // Returns at once if the counter moved since `seen`; errors (a timeout, a signal) are
        // answered by looking again.
        let _ = futex::wait(counter, futex::Flags::empty(), seen, Some(&timeout));
        sleeps.store(0, Ordering::Relaxed);
        if ready() {
            return Ok(());
        }
        if nap == Duration::from_millis(100) && !alive() {
            return Err("the other worker went away");
        }
    }
}

/// After storing `counter`: wakes the other side if it said it sleeps on it.
fn wake_if_asleep(counter: &AtomicU32, sleeps: &AtomicU32) {
    fence(Ordering::SeqCst);
    if sleeps.load(Ordering::SeqCst) != 0 {
        let _ = futex::wake(counter, futex::Flags::empty(), 1);
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
        let (sender, name, secret) = Queue::create().unwrap();
        let receiver = Queue::open(&name, secret.as_bytes()).unwrap();
        rustix::shm::unlink(name.as_str()).unwrap();
        let frames = 5 * SLOTS as u32 + 3;
        let consumer = std::thread::spawn(move || {
            let mut seen = Vec::new();
            loop {
                match receiver.next(Duration::from_millis(50)) {
                    Next::Frame => {
                        let mut head = [0u8; 8];
                        receiver.head(0, &mut head);
                        let chunk = receiver.chunk(CHUNK);
                        let n = u32::from_le_bytes(head[..4].try_into().unwrap());
                        let len = u32::from_le_bytes(head[4..].try_into().unwrap()) as usize;
                        assert!(chunk[..len].iter().all(|&b| b == n as u8), "frame {n}'s bytes");
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
        sender.close();
        assert_eq!(consumer.join().unwrap(), (0..frames).collect::<Vec<_>>());
    }

    #[test]
    fn a_full_queue_whose_receiver_is_gone_fails_the_sender() {
        let (sender, name, _) = Queue::create().unwrap();
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
    fn only_the_offered_queue_opens() {
        let (_sender, name, secret) = Queue::create().unwrap();
        assert!(Queue::open(&name, b"another secret, of the same length as the real one, 64 bytes...")
            .unwrap_err()
            .contains("not the queue offered"));
        for bad in ["/dfc-../../etc/passwd", "dfc-x", "/dfc-", "/other-1", "/dfc-a/b"] {
            assert!(Queue::open(bad, secret.as_bytes()).is_err(), "{bad}");
        }
        assert!(Queue::open("/dfc-0-doesnotexist", secret.as_bytes()).is_err());
        rustix::shm::unlink(name.as_str()).unwrap();
        assert!(Queue::open(&name, secret.as_bytes()).is_err(), "gone once unlinked");
    }
}
