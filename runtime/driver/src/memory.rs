//! How much memory this machine can give a run, so that what a plan asks for is refused with
//! a message instead of an abort mid-allocation.

/// The kernel's estimate of the memory available to new allocations (`MemAvailable` in
/// `/proc/meminfo`), or `None` where it cannot be read.
pub fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    #[test]
    fn this_machine_has_some_memory_available() {
        let bytes = super::available_bytes().expect("/proc/meminfo says");
        assert!(bytes > 16 << 20, "{bytes}");
    }
}
