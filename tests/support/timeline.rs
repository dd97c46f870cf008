//! Reading a timeline that `dfc run --timeline` or `dfc bench --timeline` wrote (Trace Event Format JSON), for
//! the tests of both (`#[path]`-included).
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::Path;

/// The file's events, and the name of each track (`thread_name` metadata) by its `tid`.
pub fn read(path: &Path) -> (Vec<serde_json::Value>, HashMap<u64, String>) {
    let document: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("written")).expect("JSON");
    let events = document["traceEvents"].as_array().expect("traceEvents").clone();
    let mut tracks = HashMap::new();
    for event in events.iter().filter(|e| e["ph"] == "M" && e["name"] == "thread_name") {
        let name = event["args"]["name"].as_str().expect("a name");
        tracks.insert(event["tid"].as_u64().expect("a tid"), name.to_string());
    }
    (events, tracks)
}
