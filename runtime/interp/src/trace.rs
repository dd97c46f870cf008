//! The timeline's recorder (`dfc run --timeline`): spans of work, each on a named track (the
//! driver, a partition's thread, a worker), kept in memory while a run lasts; the driver writes
//! them in the Trace Event Format (`dfc_driver::timeline`).
//!
//! Off unless [`enable`] was called, and then a span costs two clock reads and a lock; off, one
//! relaxed atomic load. Spans are recorded when they end, so a span that never ends (a hung
//! wait) is not in the timeline.

use std::borrow::Cow;
use std::cell::RefCell;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

static ENABLED: AtomicBool = AtomicBool::new(false);
static EVENTS: Mutex<Vec<Event>> = Mutex::new(Vec::new());

thread_local! {
    /// The track this thread's spans go on.
    static TRACK: RefCell<Arc<str>> = RefCell::new(Arc::from("main"));
}

/// The instant the timeline counts from, and when that was in microseconds since the Unix
/// epoch (a first guess at where another process's spans go on this one's time line; the
/// driver keeps a worker's within the exchanges of its runs). The two clocks are read between
/// two reads of the monotonic one, again while those lie far apart, so that a process
/// descheduled between its reads does not shift all its spans by as long.
fn origins() -> (Instant, f64) {
    static ORIGIN: OnceLock<(Instant, f64)> = OnceLock::new();
    *ORIGIN.get_or_init(|| {
        const CLOSE: std::time::Duration = std::time::Duration::from_micros(5);
        let mut best = None;
        for _ in 0..100 {
            let before = Instant::now();
            let unix = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64() * 1e6);
            let gap = before.elapsed();
            if best.is_none_or(|(_, _, best_gap)| gap < best_gap) {
                best = Some((before + gap / 2, unix, gap));
            }
            if gap <= CLOSE {
                break;
            }
        }
        let (instant, unix, _) = best.expect("read at least once");
        (instant, unix)
    })
}

fn origin() -> Instant {
    origins().0
}

/// When this process's timeline starts, in microseconds since the Unix epoch.
pub fn origin_unix_us() -> f64 {
    origins().1
}

/// `instant` on this process's time line, in microseconds (0 if before it started).
pub fn micros_at(instant: Instant) -> f64 {
    instant.saturating_duration_since(origin()).as_secs_f64() * 1e6
}

/// Now on this process's time line, in microseconds.
pub fn now_us() -> f64 {
    micros_at(Instant::now())
}

/// One span of work.
#[derive(Clone, Debug, PartialEq)]
pub struct Event {
    /// Where it ran: `driver`, a partition's device, a worker.
    pub track: Arc<str>,
    /// What kind of work: `step`, `data`, `kernel`, `matmul`, `all_reduce`, `recv`, ….
    pub category: Cow<'static, str>,
    pub name: Arc<str>,
    /// Microseconds since the recording started.
    pub start_us: f64,
    pub duration_us: f64,
    /// The bytes it moved, for exchanges.
    pub bytes: Option<u64>,
}

/// Starts recording (for the rest of the process, or until `set_enabled(false)`).
pub fn enable() {
    set_enabled(true);
}

/// Starts or stops recording (a worker records the runs a driver asks it to).
pub fn set_enabled(on: bool) {
    origin();
    ENABLED.store(on, Ordering::Relaxed);
}

pub fn enabled() -> bool {
    ENABLED.load(Ordering::Relaxed)
}

/// The track this thread's spans go on.
pub fn current_track() -> Arc<str> {
    TRACK.with(|t| t.borrow().clone())
}

/// Runs `work` with this thread's spans on `track`, then restores the thread's track.
pub fn on_track<T>(track: &str, work: impl FnOnce() -> T) -> T {
    if !enabled() {
        return work();
    }
    let previous = TRACK.with(|t| std::mem::replace(&mut *t.borrow_mut(), Arc::from(track)));
    let result = work();
    TRACK.with(|t| *t.borrow_mut() = previous);
    result
}

/// A span that is recorded when dropped.
#[must_use = "a span measures until it is dropped"]
pub struct Span {
    category: &'static str,
    name: Arc<str>,
    start: Instant,
    bytes: Option<u64>,
}

impl Span {
    /// Notes the bytes the span's work moved.
    pub fn set_bytes(&mut self, bytes: u64) {
        self.bytes = Some(bytes);
    }
}

/// A span of `category` named by `name` (called only when recording), from now until the
/// returned value is dropped; `None` when not recording.
pub fn span<N: Into<Arc<str>>>(category: &'static str, name: impl FnOnce() -> N) -> Option<Span> {
    enabled().then(|| Span { category, name: name().into(), start: Instant::now(), bytes: None })
}

impl Drop for Span {
    fn drop(&mut self) {
        let end = Instant::now();
        let event = Event {
            track: TRACK.with(|t| t.borrow().clone()),
            category: Cow::Borrowed(self.category),
            name: self.name.clone(),
            start_us: micros_at(self.start),
            duration_us: end.saturating_duration_since(self.start).as_secs_f64() * 1e6,
            bytes: self.bytes,
        };
        record(event);
    }
}

/// Records a span of `category` that ran from `start` to `end` on this thread's track (when
/// recording).
pub fn record_span(
    category: &'static str,
    name: impl FnOnce() -> String,
    start: Instant,
    end: Instant,
    bytes: Option<u64>,
) {
    if !enabled() {
        return;
    }
    record(Event {
        track: TRACK.with(|t| t.borrow().clone()),
        category: Cow::Borrowed(category),
        name: name().into(),
        start_us: micros_at(start),
        duration_us: end.saturating_duration_since(start).as_secs_f64() * 1e6,
        bytes,
    });
}

/// Adds a span measured elsewhere (another process's, on this process's time line).
pub fn record(event: Event) {
    EVENTS.lock().unwrap_or_else(|e| e.into_inner()).push(event);
}

/// The spans recorded so far, in the order they ended; the recorder keeps none of them.
pub fn take() -> Vec<Event> {
    std::mem::take(&mut *EVENTS.lock().unwrap_or_else(|e| e.into_inner()))
}
