//! How long each stage of a compile took and the process's resident memory after it, for
//! `dfc compile --timings` (as rustc's `-Z time-passes` prints them).

use std::fmt;
use std::time::Instant;

/// One stage: its name, its wall time, and the resident memory after it (`None` where the
/// system does not say, off Linux).
#[derive(Clone, Debug)]
pub struct StageTiming {
    pub stage: String,
    pub seconds: f64,
    pub resident_bytes: Option<u64>,
}

/// The stages of one compile, in the order they ran.
#[derive(Clone, Debug, Default)]
pub struct Timings {
    pub stages: Vec<StageTiming>,
}

impl Timings {
    pub fn total_seconds(&self) -> f64 {
        self.stages.iter().map(|s| s.seconds).sum()
    }
}

/// A stopwatch whose laps become stages.
pub(crate) struct Clock {
    last: Instant,
    pub(crate) timings: Timings,
}

impl Clock {
    pub(crate) fn start() -> Clock {
        Clock { last: Instant::now(), timings: Timings::default() }
    }

    /// Ends the stage `stage` now.
    pub(crate) fn lap(&mut self, stage: &str) {
        let now = Instant::now();
        let seconds = now.duration_since(self.last).as_secs_f64();
        self.timings.stages.push(StageTiming { stage: stage.to_string(), seconds, resident_bytes: resident_bytes() });
        self.last = now;
    }
}

/// The process's resident set (`VmRSS` of /proc/self/status).
pub fn resident_bytes() -> Option<u64> {
    status_kib("VmRSS:").map(|kib| kib * 1024)
}

/// The process's peak resident set so far (`VmHWM`).
pub fn peak_resident_bytes() -> Option<u64> {
    status_kib("VmHWM:").map(|kib| kib * 1024)
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with(field))?;
    line[field.len()..].trim().trim_end_matches("kB").trim().parse().ok()
}

impl fmt::Display for Timings {
    /// `time:   0.012 s  rss:    45 MiB  place`, a line per stage, then the total.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mib = |bytes: Option<u64>| bytes.map_or_else(|| "-".to_string(), |b| format!("{}", b >> 20));
        for stage in &self.stages {
            writeln!(f, "time: {:8.3} s  rss: {:>6} MiB  {}", stage.seconds, mib(stage.resident_bytes), stage.stage)?;
        }
        writeln!(f, "time: {:8.3} s  peak rss: {:>6} MiB  total", self.total_seconds(), mib(peak_resident_bytes()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn laps_are_stages_in_order_with_the_memory_after_them() {
        let mut clock = Clock::start();
        clock.lap("first");
        let block = vec![1u8; 64 << 20];
        clock.lap("second");
        assert_eq!(block.iter().map(|&b| b as usize).sum::<usize>(), 64 << 20);
        let stages: Vec<&str> = clock.timings.stages.iter().map(|s| s.stage.as_str()).collect();
        assert_eq!(stages, ["first", "second"]);
        if cfg!(target_os = "linux") {
            let (before, after) = (clock.timings.stages[0].resident_bytes, clock.timings.stages[1].resident_bytes);
            assert!(after.unwrap() >= before.unwrap() + (60 << 20), "{before:?} -> {after:?}");
        }
        let text = clock.timings.to_string();
        assert!(text.lines().count() == 3 && text.contains("second") && text.ends_with("total\n"), "{text}");
    }
}
