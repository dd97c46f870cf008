//! The ring all-reduce across workers: reduce-scatter, then all-gather, each in n − 1 steps of
//! one segment to the next worker, so that each link carries 2(n − 1)/n of the tensor. Each
//! segment's sum is made by one worker and passed on, so every worker ends with the same bits.
//! Either phase also runs alone ([`Phases`]), as the hierarchical all-reduce's steps within a
//! host do.
//!
//! On the data plane ([`crate::data`]) the ring is pipelined by chunks, as NCCL's is: what a
//! worker receives in step s is exactly what it sends in step s + 1, so each chunk is passed on
//! as soon as it has been summed (or, in the all-gather, copied) into the tensor, while the
//! rest of its segment is still on the wire. The data plane's reader thread applies incoming
//! chunks into the tensor's memory; the all-reduce's own thread sends this worker's segment,
//! then every chunk the reader has applied. Over gRPC (workers without a data port) the steps
//! run one after another, each a whole segment.
//!
//! Why the tensor's memory may be shared this way: the ranges applied and sent at the same
//! time never overlap. A segment is written again (its final sum, in the all-gather) only after
//! every worker's share of it has been summed, which needs this worker's partial sum of it to
//! have been sent (and so read) first. This holds chunk by chunk, since every segment is cut in
//! chunks of [`DATA_CHUNK`] from its start, and every worker passes them on with the same cuts.
//!
//! That argument rests on the other workers keeping to the protocol; the ring does not take it
//! on trust, since a chunk written while the same bytes are being sent would be a data race:
//! - a chunk must lie on the grid of the cuts, and each chunk of a step is taken once (a
//!   duplicate fails the ring);
//! - a chunk of the all-gather, which overwrites a chunk this worker sent in the reduce-scatter,
//!   is applied only once that send has returned: the reader waits for it (a correct ring
//!   sends it back only after it has left, so the wait is the moment between the bytes leaving
//!   and the send's return), and a chunk that came before the ring was under way here fails it;
//! - the ring's thread sends each chunk from a slice of that chunk alone, and marks it sent.
//!
//! An all-gather run alone writes segments me, me − 1, …, each before it passes it on, and
//! only sends segment me + 1, which it never writes: its chunks need no wait.

use super::{byte_len, NetRendezvous, Received, State};
use crate::data::{Chunk, Placement, DATA_CHUNK};
use dfc_interp::{InterpError, Tensor};
use dfc_ir::{DType, TensorType};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;

/// Adds little-endian elements into others.
pub(super) type AddInto = crate::data::Combine;

/// An all-reduce under way on the data plane: where its incoming chunks go and what is left
/// to pass on.
pub(super) struct RingProgress {
    /// The tensor's memory, lent by the ring's thread until it closes the ring.
    buffer: SharedBytes,
    /// The segment received at each step (the one sent at the next).
    segments: Vec<Range<usize>>,
    /// Steps below this sum what they receive; the others copy it.
    reducing_steps: usize,
    /// Whether the copying steps overwrite bytes this ring sent before (the whole ring's
    /// all-gather does; an all-gather alone does not), so that their chunks wait for the sends.
    guard_overwrites: bool,
    add: AddInto,
    /// Per step: bytes applied, and whether any chunk came (an empty segment is one chunk).
    filled: Vec<usize>,
    arrived: Vec<bool>,
    /// Chunks applied but not yet passed on: (step to send them as, offset, length).
    forwards: VecDeque<(usize, usize, usize)>,
    /// Chunks being applied outside the lock.
    applying: usize,
    /// Per receiving step, per chunk: lent to be applied (or applied).
    taken: Vec<Vec<bool>>,
    /// Per sending step (0: this worker's own segment; s: what step s − 1 received), per chunk:
    /// sent, so that its bytes are no longer read.
    sent: Vec<Vec<bool>>,
    /// Readers waiting in `lend` for a chunk to be sent (`mark_sent` wakes them only then).
    awaiting_sends: usize,
    open: bool,
    error: Option<String>,
}

#[derive(Clone, Copy)]
struct SharedBytes(*mut u8);
// SAFETY: the pointer is the start of the tensor the ring's thread lends (`pipelined_ring`);
// every use of it is an `unsafe` block that keeps to the module's rules (ranges lent once,
// all-gather chunks only after their send, nothing after `close_ring`, which returns before
// the lending borrow ends). Moving the pointer to the data plane's reader thread does nothing
// of itself.
unsafe impl Send for SharedBytes {}

/// The chunks of a segment of `len` bytes (one, empty, for an empty segment).
fn chunks_of(len: usize) -> usize {
    len.div_ceil(DATA_CHUNK).max(1)
}

impl RingProgress {
    fn complete(&self, step: usize) -> bool {
        self.arrived[step] && self.filled[step] == self.segments[step].len()
    }

    /// Whether every step's segment has come and every chunk there is to pass on has been.
    fn finished(&self) -> bool {
        self.forwards.is_empty() && (0..self.segments.len()).all(|s| self.complete(s))
    }
}

/// The data plane's key of step `step` of the all-reduce `key`, and back.
fn wire_key(key: &str, step: usize) -> String {
    format!("{key}#{step}")
}

fn parse_wire_key(wire: &str) -> Option<(&str, usize)> {
    let (key, step) = wire.rsplit_once('#')?;
    Some((key, step.parse().ok()?))
}

impl NetRendezvous {
    /// The ring over `ranks` (this worker among them) of `value`, this worker's sum, in place in
    /// the tensor's memory (in a copy of its little-endian bytes where that memory is not them).
    pub(super) fn ring(&self, key: &str, ranks: &[usize], value: Tensor) -> Result<Tensor, InterpError> {
        self.in_place(key, value, |ty, add, bytes| self.ring_phases(key, ranks, ty, add, bytes, Phases::Both))
    }

    /// The ring over `ranks` in `bytes`, the little-endian bytes of a value of `ty`, which then
    /// hold this worker's sum.
    pub(super) fn ring_in_place(
        &self,
        key: &str,
        ranks: &[usize],
        ty: &TensorType,
        bytes: &mut [u8],
    ) -> Result<(), InterpError> {
        let add = adder(ty.dtype).ok_or_else(|| self.fail(format!("all-reduce `{key}` of {ty}: not a number type")))?;
        if Some(bytes.len()) != byte_len(ty) {
            return Err(self.fail(format!("all-reduce `{key}` of {ty}: given {} bytes", bytes.len())));
        }
        self.ring_phases(key, ranks, ty, add, bytes, Phases::Both)
    }

    /// Runs `reduce` on the little-endian bytes of `value` (its own memory where it can), with
    /// the sum of its element type; the tensor they then hold.
    pub(super) fn in_place(
        &self,
        key: &str,
        mut value: Tensor,
        reduce: impl FnOnce(&TensorType, AddInto, &mut [u8]) -> Result<(), InterpError>,
    ) -> Result<Tensor, InterpError> {
        let ty = value.ty();
        let add = adder(ty.dtype).ok_or_else(|| self.fail(format!("all-reduce `{key}` of {ty}: not a number type")))?;
        if let Some(bytes) = value.le_bytes_mut() {
            reduce(&ty, add, bytes)?;
            return Ok(value);
        }
        let mut bytes = value.to_le_bytes();
        reduce(&ty, add, &mut bytes)?;
        Ok(Tensor::from_le_bytes(&ty, &bytes).expect("the bytes of the tensor's type"))
    }

    /// The ring's `phases` over `ranks` in `buffer`, a tensor of type `ty`. After the
    /// reduce-scatter alone, this worker holds the sum of segment `me + 1` (of n, cut as
    /// [`segment`] cuts); the all-gather alone starts from there.
    pub(super) fn ring_phases(
        &self,
        key: &str,
        ranks: &[usize],
        ty: &TensorType,
        add: AddInto,
        buffer: &mut [u8],
        phases: Phases,
    ) -> Result<(), InterpError> {
        let n = ranks.len();
        let me = ranks.iter().position(|&r| r == self.routes.rank).expect("a worker in its group");
        let next = ranks[(me + 1) % n];
        let (size, len) = (ty.dtype.size_in_bytes(), ty.shape.n_elements());
        let range = |i: usize| segment(len, size, n, i);
        // Step s < n − 1 (reduce-scatter) sends segment me − s and sums segment me − s − 1 into
        // this worker's; then (all-gather) step n − 1 + t sends me + 1 − t and copies me − t.
        // After the reduce-scatter this worker holds all of segment me + 1.
        let received =
            |s: usize| if s < n - 1 { range((me + 2 * n - s - 1) % n) } else { range((me + 2 * n - (s + 1 - n)) % n) };
        let (steps, own, reducing_steps) = match phases {
            Phases::Both => (0..2 * (n - 1), range(me), n - 1),
            Phases::ReduceScatter => (0..n - 1, range(me), n - 1),
            Phases::AllGather => (n - 1..2 * (n - 1), range((me + 1) % n), 0),
        };
        let segments: Vec<Range<usize>> = steps.map(received).collect();
        // Alone, the all-gather overwrites no bytes this ring sends: nothing to hold chunks for.
        let guard = phases == Phases::Both;
        if self.peers.links.ring_ready(ranks) {
            self.pipelined_ring(key, next, own, segments, reducing_steps, guard, add, buffer)
        } else {
            self.stepped_ring(key, next, own, &segments, reducing_steps, ty.dtype, add, buffer)
        }
    }

    /// The ring on the data plane, pipelined by chunks (see the module's comment).
    #[allow(clippy::too_many_arguments)]
    fn pipelined_ring(
        &self,
        key: &str,
        next: usize,
        own: Range<usize>,
        segments: Vec<Range<usize>>,
        reducing_steps: usize,
        guard_overwrites: bool,
        add: AddInto,
        buffer: &mut [u8],
    ) -> Result<(), InterpError> {
        let steps = segments.len();
        let base = SharedBytes(buffer.as_mut_ptr());
        let taken = segments.iter().map(|s| vec![false; chunks_of(s.len())]).collect();
        let sent =
            std::iter::once(&own).chain(&segments[..steps - 1]).map(|s| vec![false; chunks_of(s.len())]).collect();
        let early: Vec<(usize, u64, u64, Chunk)> = {
            let mut state = self.lock();
            state.rings.insert(
                key.to_string(),
                RingProgress {
                    buffer: base,
                    filled: vec![0; steps],
                    arrived: vec![false; steps],
                    segments,
                    reducing_steps,
                    guard_overwrites,
                    add,
                    forwards: VecDeque::new(),
                    applying: 0,
                    taken,
                    sent,
                    awaiting_sends: 0,
                    open: true,
                    error: None,
                },
            );
            (0..steps)
                .flat_map(|s| {
                    state.early.remove(&wire_key(key, s)).unwrap_or_default().into_iter().map(move |c| (s, c))
                })
                .map(|(s, (total, offset, chunk))| (s, total, offset, chunk))
                .collect()
        };
        for (step, total, offset, chunk) in early {
            // This thread sends what all-gather chunks wait for: it must not wait itself.
            self.apply_chunk(key, step, total, offset, chunk, false);
        }
        let result = self.send_ring(key, next, base, own, reducing_steps);
        // Closed before `buffer`'s borrow ends: nothing is applied into it after this.
        self.close_ring(key);
        let mut state = self.lock();
        state.rings.remove(key);
        for s in 0..steps {
            state.early.remove(&wire_key(key, s));
        }
        result
    }

    /// Sends this worker's own segment, then each chunk the data plane's reader has applied, as
    /// the next step's, until every step's segment has come and all are passed on.
    ///
    /// On the timeline, the ring's two phases as this worker sends them: the reduce-scatter
    /// until its first all-gather chunk goes out, then the all-gather, each with its bytes.
    fn send_ring(
        &self,
        key: &str,
        next: usize,
        base: SharedBytes,
        own: Range<usize>,
        reducing_steps: usize,
    ) -> Result<(), InterpError> {
        let links = &self.peers.links;
        let started = std::time::Instant::now();
        // An all-gather alone (no reducing steps) starts with it.
        let (mut gathering_from, mut scattered, mut gathered) =
            if reducing_steps == 0 { (Some(started), 0, own.len() as u64) } else { (None, own.len() as u64, 0u64) };
        let phases = |gathering_from: Option<std::time::Instant>, scattered, gathered| {
            let now = std::time::Instant::now();
            let middle = gathering_from.unwrap_or(now);
            if reducing_steps > 0 {
                let name = || format!("reduce-scatter {key}");
                dfc_interp::trace::record_span("all_reduce", name, started, middle, Some(scattered));
            }
            if gathering_from.is_some() {
                let name = || format!("all-gather {key}");
                dfc_interp::trace::record_span("all_reduce", name, middle, now, Some(gathered));
            }
        };
        for c in 0..chunks_of(own.len()) {
            let offset = c * DATA_CHUNK;
            let len = DATA_CHUNK.min(own.len() - offset);
            // SAFETY: a chunk of this worker's own segment, within the tensor, which nothing
            // writes until the chunk is marked sent (`lend` holds all-gather chunks until then;
            // the reduce-scatter never writes this segment).
            let chunk = unsafe { std::slice::from_raw_parts(base.0.add(own.start + offset), len) };
            links
                .send(next, self.step, &wire_key(key, 0), chunk, offset, own.len(), self.wait)
                .map_err(|e| self.fail(e))?;
            self.mark_sent(key, 0, offset);
        }
        loop {
            let job = self.wait_for(key, |state| {
                let ring = state.rings.get_mut(key).expect("a ring stays while it sends");
                if let Some(error) = &ring.error {
                    return Some(Err(error.clone()));
                }
                match ring.forwards.pop_front() {
                    Some((step, offset, len)) => Some(Ok(Some((step, offset, len, ring.segments[step - 1].clone())))),
                    None => ring.finished().then_some(Ok(None)),
                }
            })?;
            let Some((step, offset, len, segment)) = job.map_err(|message| self.fail(message))? else {
                phases(gathering_from, scattered, gathered);
                return Ok(());
            };
            if step < reducing_steps {
                scattered += len as u64;
            } else {
                gathering_from.get_or_insert_with(std::time::Instant::now);
                gathered += len as u64;
            }
            // SAFETY: the chunk was applied (it is taken once) and is not written again until it
            // is marked sent (see the module's comment).
            let chunk = unsafe { std::slice::from_raw_parts(base.0.add(segment.start + offset), len) };
            links
                .send(next, self.step, &wire_key(key, step), chunk, offset, segment.len(), self.wait)
                .map_err(|e| self.fail(e))?;
            self.mark_sent(key, step, offset);
        }
    }

    /// The chunk at `offset` of step `step`'s segment has been sent: an all-gather chunk may now
    /// overwrite it.
    fn mark_sent(&self, key: &str, step: usize, offset: usize) {
        let mut state = self.lock();
        let Some(ring) = state.rings.get_mut(key) else { return };
        if let Some(sent) = ring.sent.get_mut(step) {
            sent[offset / DATA_CHUNK] = true;
        }
        let awaited = ring.awaiting_sends > 0;
        drop(state);
        if awaited {
            self.changed.notify_all();
        }
    }

    /// A chunk from the data plane: into its ring's tensor if that ring is under way here (and
    /// queued to be passed on), else kept until it is.
    pub(super) fn deliver_ring_chunk(&self, wire: &str, total: u64, offset: u64, chunk: Chunk) {
        let mut state = self.lock();
        let ring = parse_wire_key(wire).filter(|(key, _)| state.rings.get(*key).is_some_and(|r| r.open));
        match ring {
            Some((key, step)) => {
                drop(state);
                self.apply_chunk(key, step, total, offset, chunk, true);
            }
            None => state.early.entry(wire.to_string()).or_default().push((total, offset, chunk)),
        }
    }

    /// Sums (or copies) a chunk of step `step` into the ring `key`'s tensor (`may_wait`: see
    /// `lend`).
    fn apply_chunk(&self, key: &str, step: usize, total: u64, offset: u64, chunk: Chunk, may_wait: bool) {
        let bytes = chunk.as_slice();
        let Some((into, add)) = self.lend(key, step, total, offset, bytes.len() as u64, may_wait) else { return };
        // SAFETY: `lend` lent these bytes to this thread alone until `applied` (see there).
        let into = unsafe { std::slice::from_raw_parts_mut(into, bytes.len()) };
        match add {
            Some(add) => add(into, bytes),
            None => into.copy_from_slice(bytes),
        }
        self.applied(key, step, offset as usize, bytes.len(), true);
    }

    /// Where the data plane's reader reads a chunk of a ring under way here to: straight into
    /// the tensor in the all-gather, summed into it in the reduce-scatter.
    pub(crate) fn place_ring_chunk(&self, wire: &str, total: u64, offset: u64, len: u64) -> Option<Placement> {
        let (key, step) = parse_wire_key(wire)?;
        if !self.lock().rings.get(key).is_some_and(|r| r.open) {
            return None;
        }
        let (at, add) = self.lend(key, step, total, offset, len, true)?;
        Some(Placement { at, len: len as usize, combine: add })
    }

    pub(crate) fn placed_ring_chunk(&self, wire: &str, offset: u64, len: u64, ok: bool) {
        if let Some((key, step)) = parse_wire_key(wire) {
            self.applied(key, step, offset as usize, len as usize, ok);
        }
    }

    /// Lends the bytes of a chunk of step `step` in the ring `key`'s tensor (with the sum to
    /// apply the chunk by, `None` where it is copied), if the ring is under way, the chunk is
    /// one of the step's cuts and was not taken before; the ring does not close until they are
    /// `applied`. An all-gather chunk is lent only once this worker has sent the bytes it
    /// overwrites: until then the caller waits if `may_wait`, else the ring fails.
    fn lend(
        &self,
        key: &str,
        step: usize,
        total: u64,
        offset: u64,
        len: u64,
        may_wait: bool,
    ) -> Option<(*mut u8, Option<AddInto>)> {
        let mut state = self.lock();
        let (offset, total, len) = (offset as usize, total as usize, len as usize);
        let deadline = std::time::Instant::now() + self.wait;
        loop {
            let ring = state.rings.get_mut(key).filter(|r| r.open && r.error.is_none())?;
            let fits = step < ring.segments.len()
                && total == ring.segments[step].len()
                && offset % DATA_CHUNK == 0
                && offset <= total
                && len == DATA_CHUNK.min(total - offset)
                && (offset < total || total == 0);
            let chunk = offset / DATA_CHUNK;
            let problem = if !fits {
                Some("which is not one of its segment's chunks")
            } else if ring.taken[step][chunk] {
                Some("which came twice")
            } else {
                None
            };
            if let Some(problem) = problem {
                ring.error = Some(format!(
                    "all-reduce `{key}`: a chunk of {len} bytes at {offset} of {total} for step {step}, {problem}"
                ));
                drop(state);
                self.changed.notify_all();
                return None;
            }
            // An all-gather step's segment is the one sent at step `step - reducing_steps`.
            let sent =
                step < ring.reducing_steps || !ring.guard_overwrites || ring.sent[step - ring.reducing_steps][chunk];
            if sent {
                ring.taken[step][chunk] = true;
                let add = (step < ring.reducing_steps).then_some(ring.add);
                ring.applying += 1;
                // SAFETY: within the tensor (the segment lies in it, the chunk in the segment).
                return Some((unsafe { ring.buffer.0.add(ring.segments[step].start + offset) }, add));
            }
            let now = std::time::Instant::now();
            if !may_wait || now >= deadline || state.aborted.is_some() {
                let ring = state.rings.get_mut(key).expect("looked up above");
                ring.error = Some(format!(
                    "all-reduce `{key}`: the all-gather's chunk at {offset} of step {step} came before this worker sent it"
                ));
                drop(state);
                self.changed.notify_all();
                return None;
            }
            state.rings.get_mut(key).expect("looked up above").awaiting_sends += 1;
            state = self.changed.wait_timeout(state, deadline - now).unwrap_or_else(|e| e.into_inner()).0;
            if let Some(ring) = state.rings.get_mut(key) {
                ring.awaiting_sends -= 1;
            }
        }
    }

    /// A lent chunk is applied (or, `ok` false, its connection failed midway): it counts, and
    /// is passed on at the next step.
    fn applied(&self, key: &str, step: usize, offset: usize, len: usize, ok: bool) {
        let mut state = self.lock();
        let ring = state.rings.get_mut(key).expect("a ring with lent bytes stays");
        ring.applying -= 1;
        if !ok {
            ring.error = Some(format!("all-reduce `{key}`: the connection from the previous worker broke in a chunk"));
        } else {
            ring.filled[step] += len;
            ring.arrived[step] = true;
            if step + 1 < ring.segments.len() {
                ring.forwards.push_back((step + 1, offset, len));
            }
        }
        drop(state);
        self.changed.notify_all();
    }

    /// Stops applying chunks into the ring `key`'s tensor; returns once none is being applied.
    fn close_ring(&self, key: &str) {
        let mut state = self.lock();
        if let Some(ring) = state.rings.get_mut(key) {
            ring.open = false;
        }
        self.changed.notify_all();
        while state.rings.get(key).is_some_and(|r| r.applying > 0) {
            // Applying is arithmetic on memory, never a wait: this ends.
            state = self.changed.wait(state).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// The ring over gRPC, one whole segment per step: push the segment sent, then wait for the
    /// one received and apply it.
    #[allow(clippy::too_many_arguments)]
    fn stepped_ring(
        &self,
        key: &str,
        next: usize,
        own: Range<usize>,
        segments: &[Range<usize>],
        reducing_steps: usize,
        dtype: DType,
        add: AddInto,
        buffer: &mut [u8],
    ) -> Result<(), InterpError> {
        let size = dtype.size_in_bytes();
        for (s, into) in segments.iter().enumerate() {
            let out = if s == 0 { own.clone() } else { segments[s - 1].clone() };
            let wire = format!("{key}#rpc{s}");
            let segment = TensorType::new(dtype, vec![out.len() / size]);
            let bytes = prost::bytes::Bytes::copy_from_slice(&buffer[out]);
            self.peers.push_bytes(next, self.step, &wire, &segment, bytes, self.wait).map_err(|e| self.fail(e))?;
            let got =
                self.wait_for(&wire, |state: &mut State| state.received.remove(&wire)).map(Received::into_bytes)?;
            if got.len() != into.len() {
                return Err(self.fail(format!(
                    "all-reduce `{wire}`: a segment of {} bytes, not {}",
                    got.len(),
                    into.len()
                )));
            }
            let apply = if s < reducing_steps { add } else { copy };
            apply(&mut buffer[into.clone()], &got);
        }
        Ok(())
    }
}

/// Which of the ring's phases to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Phases {
    Both,
    ReduceScatter,
    AllGather,
}

/// The bytes of segment `i` of `n` of a tensor of `len` elements of `size` bytes.
pub(super) fn segment(len: usize, size: usize, n: usize, i: usize) -> Range<usize> {
    (len * i / n * size)..(len * (i + 1) / n * size)
}

fn copy(into: &mut [u8], from: &[u8]) {
    into.copy_from_slice(from);
}

/// `acc[i] += other[i]` over little-endian elements of `dtype` (the interpreter's `add`: IEEE for
/// floats, wrapping for integers); `None` for types that do not add.
pub(super) fn adder(dtype: DType) -> Option<AddInto> {
    macro_rules! add {
        ($t:ty, $op:expr) => {{
            fn add(acc: &mut [u8], other: &[u8]) {
                const N: usize = std::mem::size_of::<$t>();
                for (a, b) in acc.chunks_exact_mut(N).zip(other.chunks_exact(N)) {
                    let (x, y) =
                        (<$t>::from_le_bytes(a.try_into().unwrap()), <$t>::from_le_bytes(b.try_into().unwrap()));
                    let op: fn($t, $t) -> $t = $op;
                    a.copy_from_slice(&op(x, y).to_le_bytes());
                }
            }
            Some(add as AddInto)
        }};
    }
    match dtype {
        DType::F32 => add!(f32, |x, y| x + y),
        DType::F64 => add!(f64, |x, y| x + y),
        DType::I32 => add!(i32, i32::wrapping_add),
        DType::I64 => add!(i64, i64::wrapping_add),
        DType::U8 | DType::Bool => None,
    }
}

/// Chunks that came before their ring was under way here, by their data-plane key: (the
/// segment's bytes, the chunk's offset, the chunk).
pub(super) type EarlyChunks = HashMap<String, Vec<(u64, u64, Chunk)>>;

#[cfg(test)]
mod tests {
    //! What the ring takes from the previous worker: only its segments' chunks, each once, and
    //! an all-gather chunk only once this worker has sent the bytes it overwrites.

    use super::*;
    use std::time::Duration;

    /// Worker 0 of 2, with a ring `k` over `buffer` under way: it receives bytes 8..16 in the
    /// reduce-scatter (step 0) and 0..8, its own segment, in the all-gather (step 1).
    fn ring_here(buffer: &mut [u8; 16], wait: Duration) -> (tokio::runtime::Runtime, NetRendezvous) {
        let (runtime, rendezvous) = crate::rendezvous::tests::worker_of_two(wait);
        let segments = vec![8..16, 0..8];
        let progress = RingProgress {
            buffer: SharedBytes(buffer.as_mut_ptr()),
            filled: vec![0; 2],
            arrived: vec![false; 2],
            taken: vec![vec![false]; 2],
            sent: vec![vec![false]; 2],
            awaiting_sends: 0,
            segments,
            reducing_steps: 1,
            guard_overwrites: true,
            add: adder(DType::U8).unwrap_or(copy),
            forwards: VecDeque::new(),
            applying: 0,
            open: true,
            error: None,
        };
        rendezvous.lock().rings.insert("k".to_string(), progress);
        (runtime, rendezvous)
    }

    fn error(rendezvous: &NetRendezvous) -> String {
        rendezvous.lock().rings["k"].error.clone().unwrap_or_default()
    }

    #[test]
    fn a_chunk_off_the_cuts_or_sent_twice_fails_the_ring() {
        let mut buffer = [0u8; 16];
        let (_runtime, rendezvous) = ring_here(&mut buffer, Duration::from_secs(5));
        assert!(rendezvous.place_ring_chunk("k#0", 8, 4, 4).is_none());
        assert!(error(&rendezvous).contains("not one of its segment's chunks"), "{}", error(&rendezvous));

        let (_runtime, rendezvous) = ring_here(&mut buffer, Duration::from_secs(5));
        let placed = rendezvous.place_ring_chunk("k#0", 8, 0, 8).expect("the step's chunk");
        assert_eq!(placed.at, buffer[8..].as_mut_ptr());
        rendezvous.placed_ring_chunk("k#0", 0, 8, true);
        assert!(rendezvous.place_ring_chunk("k#0", 8, 0, 8).is_none());
        assert!(error(&rendezvous).contains("came twice"), "{}", error(&rendezvous));
    }

    #[test]
    fn an_all_gather_chunk_waits_for_the_send_of_the_bytes_it_overwrites() {
        let mut buffer = [0u8; 16];
        // Never sent: the chunk fails the ring once the wait is over.
        let (_runtime, rendezvous) = ring_here(&mut buffer, Duration::from_millis(50));
        assert!(rendezvous.place_ring_chunk("k#1", 8, 0, 8).is_none());
        assert!(error(&rendezvous).contains("came before this worker sent it"), "{}", error(&rendezvous));

        // Sent while the reader waits: it is lent then.
        let (_runtime, rendezvous) = ring_here(&mut buffer, Duration::from_secs(30));
        let started = std::time::Instant::now();
        let placed = std::thread::scope(|scope| {
            let reader = scope.spawn(|| rendezvous.place_ring_chunk("k#1", 8, 0, 8).map(|p| p.at as usize));
            std::thread::sleep(Duration::from_millis(100));
            assert!(!reader.is_finished(), "the reader waits for the send");
            rendezvous.mark_sent("k", 0, 0);
            reader.join().unwrap()
        });
        assert_eq!(placed, Some(buffer.as_mut_ptr() as usize));
        assert!(started.elapsed() < Duration::from_secs(10));

        // Early (applied by the ring's own thread, which must not wait): it fails the ring.
        let (_runtime, rendezvous) = ring_here(&mut buffer, Duration::from_secs(30));
        let chunk = crate::data::Chunk::for_tests(&[1; 8]);
        rendezvous.apply_chunk("k", 1, 8, 0, chunk, false);
        assert!(error(&rendezvous).contains("came before this worker sent it"), "{}", error(&rendezvous));
    }
}
