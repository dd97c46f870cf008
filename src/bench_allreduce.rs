//! `dfc bench-allreduce`: the ring all-reduce across local worker processes, as bus bandwidth,
//! next to the raw loopback TCP throughput measured in the same run.

use std::time::Duration;

#[derive(clap::Args)]
pub struct BenchAllReduceArgs {
    /// Numbers of worker processes to reduce across.
    #[arg(long, value_delimiter = ',', default_value = "2,4")]
    workers: Vec<usize>,
    /// Buffer sizes, MiB of f32.
    #[arg(long = "sizes-mib", value_delimiter = ',', default_value = "4,16,64,256")]
    sizes_mib: Vec<u64>,
    /// Timed all-reduces per size (after one untimed); the median is reported.
    #[arg(long, default_value_t = 5)]
    iterations: u32,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(serde::Serialize)]
struct Report {
    /// What one TCP connection on loopback carries alone.
    loopback_tcp_bytes_per_second: f64,
    /// Per number of workers n: what each of n loopback connections carries when all n stream
    /// at once, as the links of an n-worker ring do.
    loopback_ring_tcp_bytes_per_second: Vec<(usize, f64)>,
    results: Vec<dfc_rpc::bench::AllReduceResult>,
}

/// Raw loopback TCP per link with `links` links streaming at once (1 GiB each; 256 MiB each
/// for rings, whose links share the cores).
fn tcp(links: usize, when: &str) -> Result<f64, String> {
    let total = if links == 1 { 1 << 30 } else { 256 << 20 };
    let rate = dfc_rpc::bench::loopback_tcp_bytes_per_second(links, total)?;
    eprintln!("loopback TCP, {links} link(s) at once ({when}): {:.2} GB/s per link", rate / 1e9);
    Ok(rate)
}

pub fn bench_allreduce(args: &BenchAllReduceArgs) -> Result<std::process::ExitCode, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the dfc executable: {e}"))?;
    if args.workers.iter().any(|&n| n < 2) {
        return Err("an all-reduce needs at least 2 workers".into());
    }
    // Measured before and after the all-reduces, the better kept: the machine is shared.
    let mut single = tcp(1, "before")?;
    let mut rings: Vec<(usize, f64)> = Vec::new();
    for &n in &args.workers {
        rings.push((n, tcp(n, "before")?));
    }
    let mut results = Vec::new();
    for &n in &args.workers {
        let token = dfc_rpc::auth::random_token();
        let workers = dfc_rpc::LocalWorkers::spawn(&exe, n, &token, None)?;
        for &mib in &args.sizes_mib {
            let result = dfc_rpc::bench::all_reduce(&workers.addresses, &token, mib << 20, args.iterations)?;
            eprintln!(
                "{n} workers, {mib:>4} MiB: {:8.1} ms, bus bandwidth {:.2} GB/s",
                result.median_seconds * 1e3,
                result.bus_bytes_per_second / 1e9
            );
            results.push(result);
        }
        drop(workers);
        std::thread::sleep(Duration::from_millis(100));
    }
    single = single.max(tcp(1, "after")?);
    for (n, rate) in &mut rings {
        *rate = rate.max(tcp(*n, "after")?);
    }
    let report = Report { loopback_tcp_bytes_per_second: single, loopback_ring_tcp_bytes_per_second: rings, results };
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("reports serialise"));
    } else {
        println!("loopback TCP, one link alone: {:.2} GB/s", single / 1e9);
        for (n, rate) in &report.loopback_ring_tcp_bytes_per_second {
            println!("loopback TCP, {n} links at once (a {n}-worker ring): {:.2} GB/s per link", rate / 1e9);
        }
        println!(
            "{:>7} {:>8} {:>10} {:>12} {:>12} {:>13} {:>12}",
            "workers", "MiB", "median ms", "algbw GB/s", "busbw GB/s", "of ring TCP", "of one link"
        );
        for r in &report.results {
            let ring = report
                .loopback_ring_tcp_bytes_per_second
                .iter()
                .find(|(n, _)| *n == r.workers)
                .map_or(f64::NAN, |p| p.1);
            println!(
                "{:>7} {:>8} {:>10.1} {:>12.2} {:>12.2} {:>12.0}% {:>11.0}%",
                r.workers,
                r.bytes >> 20,
                r.median_seconds * 1e3,
                r.algorithm_bytes_per_second / 1e9,
                r.bus_bytes_per_second / 1e9,
                100.0 * r.bus_bytes_per_second / ring,
                100.0 * r.bus_bytes_per_second / single
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
