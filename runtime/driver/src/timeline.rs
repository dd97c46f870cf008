//! `dfc run --timeline FILE`: the spans `dfc_interp::trace` recorded, written in the Trace Event
//! Format (the JSON that Perfetto and chrome://tracing open): one process per machine's share
//! of the run (this process, each worker), one thread per track (the driver, each partition's
//! device), a complete event (`"ph": "X"`) per span, with the bytes of exchanges in its `args`.

use dfc_interp::trace::Event;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;

/// One process of the timeline: its name and its spans.
pub struct Process<'a> {
    pub name: String,
    pub events: &'a [Event],
}

/// The timeline of `processes` as a Trace Event Format document.
pub fn to_json(processes: &[Process]) -> Value {
    let mut trace_events = Vec::new();
    for (p, process) in processes.iter().enumerate() {
        let pid = p as u64 + 1;
        trace_events.push(json!({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": process.name}}));
        // Tracks numbered in order of first appearance, the driver's first.
        let mut tracks: BTreeMap<&str, u64> = BTreeMap::new();
        let mut order: Vec<&str> = Vec::new();
        if process.events.iter().any(|e| &*e.track == "driver") {
            order.push("driver");
            tracks.insert("driver", 1);
        }
        for event in process.events {
            if !tracks.contains_key(&*event.track) {
                order.push(&event.track);
                tracks.insert(&event.track, order.len() as u64);
            }
        }
        for (i, track) in order.iter().enumerate() {
            let tid = i as u64 + 1;
            trace_events
                .push(json!({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": track}}));
            trace_events.push(
                json!({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid, "args": {"sort_index": tid}}),
            );
        }
        for event in process.events {
            let mut value = json!({
                "name": &*event.name,
                "cat": event.category,
                "ph": "X",
                "ts": event.start_us,
                "dur": event.duration_us,
                "pid": pid,
                "tid": tracks[&*event.track],
            });
            if let Some(bytes) = event.bytes {
                value["args"] = json!({ "bytes": bytes });
            }
            trace_events.push(value);
        }
    }
    json!({ "traceEvents": trace_events, "displayTimeUnit": "ms" })
}

/// Writes the timeline of `processes` to `path`.
pub fn write(path: &Path, processes: &[Process]) -> std::io::Result<()> {
    let mut file = std::io::BufWriter::new(std::fs::File::create(path)?);
    serde_json::to_writer(&mut file, &to_json(processes))?;
    file.write_all(b"\n")?;
    file.flush()
}
