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
    loopback_tcp_bytes_per_second: f64,
    results: Vec<dfc_rpc::bench::AllReduceResult>,
}

pub fn bench_allreduce(args: &BenchAllReduceArgs) -> Result<std::process::ExitCode, String> {
    let exe = std::env::current_exe().map_err(|e| format!("cannot find the dfc executable: {e}"))?;
    let tcp = |when: &str| -> Result<f64, String> {
        let rate = dfc_rpc::bench::loopback_tcp_bytes_per_second(1 << 30)?;
        eprintln!("loopback TCP ({when}): {:.2} GB/s", rate / 1e9);
        Ok(rate)
    };
    let before = tcp("before")?;
    let mut results = Vec::new();
    for &n in &args.workers {
        if n < 2 {
            return Err("an all-reduce needs at least 2 workers".into());
        }
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
    let after = tcp("after")?;
    let tcp_rate = before.max(after);
    let report = Report { loopback_tcp_bytes_per_second: tcp_rate, results };
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("reports serialise"));
    } else {
        println!("loopback TCP: {:.2} GB/s (the better of before and after)", tcp_rate / 1e9);
        println!(
            "{:>7} {:>8} {:>10} {:>12} {:>12} {:>8}",
            "workers", "MiB", "median ms", "algbw GB/s", "busbw GB/s", "of TCP"
        );
        for r in &report.results {
            println!(
                "{:>7} {:>8} {:>10.1} {:>12.2} {:>12.2} {:>7.0}%",
                r.workers,
                r.bytes >> 20,
                r.median_seconds * 1e3,
                r.algorithm_bytes_per_second / 1e9,
                r.bus_bytes_per_second / 1e9,
                100.0 * r.bus_bytes_per_second / tcp_rate
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}
