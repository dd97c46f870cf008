//! `dfc bench-allreduce`: the ring all-reduce across local worker processes, as bus bandwidth,
//! next to the raw loopback TCP throughput measured in the same run; through the shared-memory
//! queues that workers on one machine use, and through the data plane's TCP connections.

use dfc_rpc::bench::Transport;
use std::time::Duration;

/// How the workers send to each other.
#[derive(Clone, Copy, clap::ValueEnum)]
enum TransportArg {
    /// Shared-memory queues, as workers on one machine use in training.
    SharedMemory,
    /// The data plane's TCP connections, as between machines.
    Tcp,
}

#[derive(clap::Args)]
pub struct BenchAllReduceArgs {
    /// Numbers of worker processes to reduce across.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    workers: Vec<usize>,
    /// Buffer sizes, MiB of f32.
    #[arg(long = "sizes-mib", value_delimiter = ',', default_value = "4,16,64,256")]
    sizes_mib: Vec<u64>,
    /// How the workers send to each other: each one given is measured.
    #[arg(long, value_delimiter = ',', default_value = "shared-memory,tcp")]
    transport: Vec<TransportArg>,
    /// Timed all-reduces per size (after one untimed); the median is reported.
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Run the workers with TLS (DIR as `dfc worker --tls-dir` takes it, with names for
    /// 127.0.0.1: `dfc certs --out PKI localhost` makes PKI/localhost): the data plane's
    /// connections then carry TLS records.
    #[arg(long, value_name = "DIR")]
    tls_dir: Option<std::path::PathBuf>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    /// Whether the workers ran with TLS (their data plane in TLS records).
    tls: bool,
    /// What one TCP connection on loopback carries alone.
    loopback_tcp_bytes_per_second: f64,
    /// Per number of workers n: what each of n loopback connections carries when all n stream
    /// at once, as the links of an n-worker ring do.
    loopback_ring_tcp_bytes_per_second: Vec<(usize, f64)>,
    /// Per number of workers n and size: the same with each end streaming through a buffer of
    /// that size, from and to memory, as the all-reduce of it does.
    loopback_ring_tcp_through_memory_bytes_per_second: Vec<(usize, u64, f64)>,
    results: Vec<dfc_rpc::bench::AllReduceResult>,
}

/// Raw loopback TCP per link with `links` links streaming at once (1 GiB each; 256 MiB each
/// for rings, whose links share the cores), each end going through `span` bytes of memory.
fn tcp(links: usize, span: u64, when: &str) -> Result<f64, String> {
    let total = if links == 1 { 1 << 30 } else { 256 << 20 };
    let rate = dfc_rpc::bench::loopback_tcp_bytes_per_second(links, total, span as usize)?;
    eprintln!(
        "loopback TCP, {links} link(s) at once through {} MiB ({when}): {:.2} GB/s per link",
        span >> 20,
        rate / 1e9
    );
    Ok(rate)
}

/// The TCP references, measured before and after the all-reduces, the better kept: the
/// machine is shared.
struct References {
    single: f64,
    rings: Vec<(usize, f64)>,
    through_memory: Vec<(usize, u64, f64)>,
}

impl References {
    fn measure(&mut self, when: &str) -> Result<(), String> {
        self.single = self.single.max(tcp(1, CACHED, when)?);
        for (n, rate) in &mut self.rings {
            *rate = rate.max(tcp(*n, CACHED, when)?);
        }
        for (n, bytes, rate) in &mut self.through_memory {
            *rate = rate.max(tcp(*n, *bytes, when)?);
        }
        Ok(())
    }
}

/// A buffer that stays in the caches.
const CACHED: u64 = 1 << 20;

pub fn bench_allreduce(args: &BenchAllReduceArgs) -> Result<std::process::ExitCode, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the dfc executable: {e}"))?;
    if args.workers.iter().any(|&n| n < 2) {
        return Err("an all-reduce needs at least 2 workers".into());
    }
    let mut references = References {
        single: 0.0,
        rings: args.workers.iter().map(|&n| (n, 0.0)).collect(),
        through_memory: args
            .workers
            .iter()
            .flat_map(|&n| args.sizes_mib.iter().map(move |&mib| (n, mib << 20, 0.0)))
            .collect(),
    };
    let tls = args.tls_dir.as_deref().map(dfc_rpc::Tls::load).transpose()?;
    references.measure("before")?;
    let mut results = Vec::new();
    for &n in &args.workers {
        let token = dfc_rpc::auth::random_token();
        let workers = dfc_rpc::LocalWorkers::spawn(&exe, n, &token, args.tls_dir.as_deref())?;
        for &mib in &args.sizes_mib {
            for &transport in &args.transport {
                let transport = match transport {
                    TransportArg::SharedMemory => Transport::SharedMemory,
                    TransportArg::Tcp => Transport::Tcp,
                };
                let result = dfc_rpc::bench::all_reduce(
                    &workers.addresses,
                    &token,
                    tls.as_ref(),
                    mib << 20,
                    args.iterations,
                    transport,
                )?;
                eprintln!(
                    "{n} workers, {mib:>4} MiB, {}: {:8.1} ms, bus bandwidth {:.2} GB/s",
                    transport_name(&result),
                    result.median_seconds * 1e3,
                    result.bus_bytes_per_second / 1e9
                );
                results.push(result);
            }
        }
        drop(workers);
        std::thread::sleep(Duration::from_millis(100));
    }
    references.measure("after")?;
    let report = Report {
        tls: tls.is_some(),
        loopback_tcp_bytes_per_second: references.single,
        loopback_ring_tcp_bytes_per_second: references.rings,
        loopback_ring_tcp_through_memory_bytes_per_second: references.through_memory,
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("reports serialise"));
        return Ok(std::process::ExitCode::SUCCESS);
    }
    if report.tls {
        println!("workers with TLS: every data-plane frame over TCP is encrypted (shared memory is not)");
    }
    println!("loopback TCP, one link alone: {:.2} GB/s", report.loopback_tcp_bytes_per_second / 1e9);
    for (n, rate) in &report.loopback_ring_tcp_bytes_per_second {
        println!("loopback TCP, {n} links at once (a {n}-worker ring): {:.2} GB/s per link", rate / 1e9);
    }
    for (n, bytes, rate) in &report.loopback_ring_tcp_through_memory_bytes_per_second {
        println!(
            "loopback TCP, {n} links at once through {} MiB buffers: {:.2} GB/s per link",
            bytes >> 20,
            rate / 1e9
        );
    }
    println!(
        "{:>7} {:>6} {:>9} {:>10} {:>11} {:>11} {:>12} {:>17} {:>12}",
        "workers",
        "MiB",
        "transport",
        "median ms",
        "algbw GB/s",
        "busbw GB/s",
        "of ring TCP",
        "of ring TCP, mem",
        "of one link"
    );
    for r in &report.results {
        let ring =
            report.loopback_ring_tcp_bytes_per_second.iter().find(|(n, _)| *n == r.workers).map_or(f64::NAN, |p| p.1);
        let memory = report
            .loopback_ring_tcp_through_memory_bytes_per_second
            .iter()
            .find(|(n, bytes, _)| *n == r.workers && *bytes == r.bytes)
            .map_or(f64::NAN, |p| p.2);
        let share = |of: f64| 100.0 * r.bus_bytes_per_second / of;
        println!(
            "{:>7} {:>6} {:>9} {:>10.1} {:>11.2} {:>11.2} {:>11.0}% {:>16.0}% {:>11.0}%",
            r.workers,
            r.bytes >> 20,
            transport_name(r),
            r.median_seconds * 1e3,
            r.algorithm_bytes_per_second / 1e9,
            r.bus_bytes_per_second / 1e9,
            share(ring),
            share(memory),
            share(report.loopback_tcp_bytes_per_second)
        );
    }
    println!("(of ring TCP, mem: each end of each link streams through a buffer of the tensor's size)");
    Ok(std::process::ExitCode::SUCCESS)
}

/// How a result's frames went: `shm` only where every worker's went through shared memory.
fn transport_name(result: &dfc_rpc::bench::AllReduceResult) -> &'static str {
    match (result.transport, result.shared_memory) {
        (Transport::SharedMemory, true) => "shm",
        (Transport::SharedMemory, false) => "shm->tcp",
        (Transport::Tcp, _) => "tcp",
    }
}
