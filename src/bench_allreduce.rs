//! `dfc bench-allreduce`: the all-reduce across local worker processes (or running workers
//! given with `--at`), as bus bandwidth, next to the raw loopback TCP throughput measured in
//! the same run; through the shared-memory queues that workers on one machine use, and through
//! the data plane's TCP connections; by the flat ring and the hierarchical all-reduce, with
//! the bytes each sends between hosts.

use dfc_rpc::bench::Transport;
use dfc_rpc::rendezvous::Algorithm;
use std::time::Duration;

impl From<TransportArg> for Transport {
    fn from(transport: TransportArg) -> Transport {
        match transport {
            TransportArg::SharedMemory => Transport::SharedMemory,
            TransportArg::Tcp => Transport::Tcp,
        }
    }
}

/// How the all-reduce goes between workers.
#[derive(Clone, Copy, clap::ValueEnum)]
enum AlgorithmArg {
    /// One ring over all the workers.
    Ring,
    /// Within each host, then a ring between hosts (workers on several hosts, as many on each).
    Hierarchical,
}

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
    /// Reduce across the running workers at these addresses (`dfc worker --listen`, holding
    /// the token of DFC_TOKEN or --token-file) instead of starting local ones; workers whose
    /// addresses name one host share it. The loopback references are not measured then.
    #[arg(long, value_delimiter = ',', value_name = "ADDRESS", conflicts_with = "workers")]
    at: Vec<String>,
    /// With --at: a file whose first line is the workers' token [default: DFC_TOKEN].
    #[arg(long, value_name = "FILE", requires = "at")]
    token_file: Option<std::path::PathBuf>,
    /// How the all-reduce goes between workers: each one given is measured.
    #[arg(long, value_delimiter = ',', default_value = "ring")]
    algorithm: Vec<AlgorithmArg>,
    /// Under mpirun (every rank runs this command): MPI's all-reduce (MPI_Allreduce) across the
    /// ranks next to dfc's ring across a worker in each rank, through shared memory, in the
    /// same run (a dfc built with the `mpi` feature).
    #[arg(long, conflicts_with_all = ["at", "workers", "tls_dir"])]
    mpi: bool,
    /// Buffer sizes, MiB of f32 (1 to 1024: the workers hold two buffers of each).
    #[arg(long = "sizes-mib", value_delimiter = ',', default_value = "4,16,64,256",
          value_parser = clap::value_parser!(u64).range(1..=1024))]
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
    /// What one TCP connection on loopback carries alone (not measured for workers given
    /// with --at).
    loopback_tcp_bytes_per_second: Option<f64>,
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
    if args.mpi {
        return under_mpi(args);
    }
    let tls = args.tls_dir.as_deref().map(dfc_rpc::Tls::load).transpose()?;
    let mut results = Vec::new();
    let references = if args.at.is_empty() {
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
        references.measure("before")?;
        for &n in &args.workers {
            let token = dfc_rpc::auth::random_token();
            let workers = dfc_rpc::LocalWorkers::spawn(&exe, n, &token, args.tls_dir.as_deref())?;
            measure(args, &workers.addresses, &token, tls.as_ref(), &mut results)?;
            drop(workers);
            std::thread::sleep(Duration::from_millis(100));
        }
        references.measure("after")?;
        Some(references)
    } else {
        if args.at.len() < 2 {
            return Err("an all-reduce needs at least 2 workers: give --at two addresses or more".into());
        }
        let token = dfc_rpc::auth::load_token(args.token_file.as_deref())?;
        measure(args, &args.at, &token, tls.as_ref(), &mut results)?;
        None
    };
    let report = Report {
        tls: tls.is_some(),
        loopback_tcp_bytes_per_second: references.as_ref().map(|r| r.single),
        loopback_ring_tcp_bytes_per_second: references.as_ref().map(|r| r.rings.clone()).unwrap_or_default(),
        loopback_ring_tcp_through_memory_bytes_per_second: references
            .as_ref()
            .map(|r| r.through_memory.clone())
            .unwrap_or_default(),
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("reports serialise"));
        return Ok(std::process::ExitCode::SUCCESS);
    }
    print_report(&report);
    Ok(std::process::ExitCode::SUCCESS)
}

/// Every size, transport and algorithm of `args` on the workers at `addresses`.
fn measure(
    args: &BenchAllReduceArgs,
    addresses: &[String],
    token: &str,
    tls: Option<&dfc_rpc::Tls>,
    results: &mut Vec<dfc_rpc::bench::AllReduceResult>,
) -> Result<(), String> {
    let n = addresses.len();
    for &mib in &args.sizes_mib {
        for &transport in &args.transport {
            let transport = transport.into();
            for &algorithm in &args.algorithm {
                let algorithm = match algorithm {
                    AlgorithmArg::Ring => Algorithm::Ring,
                    AlgorithmArg::Hierarchical => Algorithm::Hierarchical,
                };
                let result = dfc_rpc::bench::all_reduce(
                    addresses,
                    token,
                    tls,
                    mib << 20,
                    args.iterations,
                    transport,
                    algorithm,
                )?;
                eprintln!(
                    "{n} workers on {} host(s), {mib:>4} MiB, {}, {}: {:8.1} ms, bus bandwidth {:.2} GB/s, {:.1} MiB between hosts",
                    result.hosts,
                    transport_name(&result),
                    result.algorithm,
                    result.median_seconds * 1e3,
                    result.bus_bytes_per_second / 1e9,
                    result.bytes_between_hosts as f64 / (1 << 20) as f64
                );
                results.push(result);
            }
        }
    }
    Ok(())
}

fn print_report(report: &Report) {
    if report.tls {
        println!("workers with TLS: every data-plane frame over TCP is encrypted (shared memory is not)");
    }
    if let Some(single) = report.loopback_tcp_bytes_per_second {
        println!("loopback TCP, one link alone: {:.2} GB/s", single / 1e9);
    }
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
        "{:>7} {:>5} {:>6} {:>9} {:>12} {:>10} {:>11} {:>11} {:>13} {:>12} {:>17} {:>12}",
        "workers",
        "hosts",
        "MiB",
        "transport",
        "algorithm",
        "median ms",
        "algbw GB/s",
        "busbw GB/s",
        "MiB btw hosts",
        "of ring TCP",
        "of ring TCP, mem",
        "of one link"
    );
    for r in &report.results {
        let ring = report.loopback_ring_tcp_bytes_per_second.iter().find(|(n, _)| *n == r.workers).map(|p| p.1);
        let memory = report
            .loopback_ring_tcp_through_memory_bytes_per_second
            .iter()
            .find(|(n, bytes, _)| *n == r.workers && *bytes == r.bytes)
            .map(|p| p.2);
        let share =
            |of: Option<f64>| of.map_or("-".to_string(), |of| format!("{:.0}%", 100.0 * r.bus_bytes_per_second / of));
        println!(
            "{:>7} {:>5} {:>6} {:>9} {:>12} {:>10.1} {:>11.2} {:>11.2} {:>13.1} {:>12} {:>17} {:>12}",
            r.workers,
            r.hosts,
            r.bytes >> 20,
            transport_name(r),
            r.algorithm,
            r.median_seconds * 1e3,
            r.algorithm_bytes_per_second / 1e9,
            r.bus_bytes_per_second / 1e9,
            r.bytes_between_hosts as f64 / (1 << 20) as f64,
            share(ring),
            share(memory),
            share(report.loopback_tcp_bytes_per_second)
        );
    }
    if report.loopback_tcp_bytes_per_second.is_some() {
        println!("(of ring TCP, mem: each end of each link streams through a buffer of the tensor's size)");
    }
}

/// How a result's frames went: `shm` only where every worker's went through shared memory.
fn transport_name(result: &dfc_rpc::bench::AllReduceResult) -> &'static str {
    match (result.transport, result.shared_memory) {
        (Transport::SharedMemory, true) => "shm",
        (Transport::SharedMemory, false) => "shm->tcp",
        (Transport::Tcp, _) => "tcp",
    }
}

/// One size's MPI all-reduce, as the ring's results have it.
#[derive(serde::Serialize)]
struct MpiResult {
    workers: usize,
    bytes: u64,
    iterations: usize,
    median_seconds: f64,
    algorithm_bytes_per_second: f64,
    bus_bytes_per_second: f64,
}

#[derive(serde::Serialize)]
struct MpiReport {
    /// The MPI library, as it names itself.
    library: String,
    /// dfc's ring across a worker in each rank (empty where the ranks are on several hosts).
    ring: Vec<dfc_rpc::bench::AllReduceResult>,
    mpi: Vec<MpiResult>,
}

/// `--mpi`: this process is one rank of a job mpirun started. Each rank serves a dfc worker
/// on loopback; rank 0 times dfc's ring across them, then stops them; then every rank takes
/// part in MPI's all-reduces; rank 0 reports both.
fn under_mpi(args: &BenchAllReduceArgs) -> Result<std::process::ExitCode, String> {
    let (job, rank, n) = dfc_rpc::mpi::Job::init_world()?;
    if n < 2 {
        return Err("an all-reduce needs at least 2 ranks: start this under mpirun -n 2 or more".into());
    }
    let (library, host) = dfc_rpc::mpi::library();
    let one_host = dfc_rpc::mpi::all_gather_text(&host)?.iter().all(|h| *h == host);
    let mut ring = Vec::new();
    if one_host {
        let token = dfc_rpc::mpi::broadcast_text(&dfc_rpc::auth::random_token())?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("cannot listen: {e}"))?;
        let address = listener.local_addr().map_err(|e| e.to_string())?.to_string();
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let server_token = token.clone();
        let server = std::thread::spawn(move || -> Result<(), String> {
            let runtime =
                tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
            runtime.block_on(async {
                let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
                dfc_rpc::serve(listener, server_token, None, dfc_rpc::DataPlane::default()).await
            })
        });
        let addresses = dfc_rpc::mpi::all_gather_text(&address)?;
        if rank == 0 {
            let measured = measure_ring_under_mpi(args, &addresses, &token, &mut ring);
            dfc_rpc::bench::shutdown(&addresses, &token, None)?;
            measured?;
        }
        server.join().map_err(|_| "the worker's thread panicked")??;
    } else if rank == 0 {
        eprintln!("the ranks are on several hosts: dfc's ring is compared on one host only (or with --at)");
    }
    let mut mpi = Vec::new();
    for &mib in &args.sizes_mib {
        let bytes = mib << 20;
        let mut seconds = dfc_rpc::mpi::bench_all_reduce(bytes, args.iterations.max(1))?;
        seconds.sort_by(f64::total_cmp);
        let median = seconds[seconds.len() / 2];
        let algorithm = bytes as f64 / median;
        let result = MpiResult {
            workers: n,
            bytes,
            iterations: seconds.len(),
            median_seconds: median,
            algorithm_bytes_per_second: algorithm,
            bus_bytes_per_second: algorithm * 2.0 * (n as f64 - 1.0) / n as f64,
        };
        if rank == 0 {
            eprintln!(
                "{n} ranks, {mib:>4} MiB, MPI: {:8.1} ms, bus bandwidth {:.2} GB/s",
                median * 1e3,
                result.bus_bytes_per_second / 1e9
            );
        }
        mpi.push(result);
    }
    drop(job);
    if rank > 0 {
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let report = MpiReport { library, ring, mpi };
    if args.json {
        println!("{}", serde_json::to_string(&report).expect("reports serialise"));
        return Ok(std::process::ExitCode::SUCCESS);
    }
    println!("MPI: {}", report.library);
    println!(
        "{:>5} {:>6} {:>22} {:>10} {:>11} {:>11}",
        "ranks", "MiB", "all-reduce", "median ms", "algbw GB/s", "busbw GB/s"
    );
    let rows = report
        .ring
        .iter()
        .map(|r| {
            (
                r.workers,
                r.bytes,
                format!("dfc ring ({})", transport_name(r)),
                r.median_seconds,
                r.algorithm_bytes_per_second,
                r.bus_bytes_per_second,
            )
        })
        .chain(report.mpi.iter().map(|r| {
            (
                r.workers,
                r.bytes,
                "MPI_Allreduce".to_string(),
                r.median_seconds,
                r.algorithm_bytes_per_second,
                r.bus_bytes_per_second,
            )
        }));
    let mut rows: Vec<_> = rows.collect();
    rows.sort_by_key(|r| r.1);
    for (workers, bytes, name, median, algbw, busbw) in rows {
        println!(
            "{workers:>5} {:>6} {name:>22} {:>10.1} {:>11.2} {:>11.2}",
            bytes >> 20,
            median * 1e3,
            algbw / 1e9,
            busbw / 1e9
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Rank 0's part under `--mpi`: dfc's ring across the ranks' workers, each size and transport.
fn measure_ring_under_mpi(
    args: &BenchAllReduceArgs,
    addresses: &[String],
    token: &str,
    results: &mut Vec<dfc_rpc::bench::AllReduceResult>,
) -> Result<(), String> {
    for &mib in &args.sizes_mib {
        for &transport in &args.transport {
            let transport = transport.into();
            let result = dfc_rpc::bench::all_reduce(
                addresses,
                token,
                None,
                mib << 20,
                args.iterations,
                transport,
                Algorithm::Ring,
            )?;
            eprintln!(
                "{} ranks, {mib:>4} MiB, dfc ring ({}): {:8.1} ms, bus bandwidth {:.2} GB/s",
                addresses.len(),
                transport_name(&result),
                result.median_seconds * 1e3,
                result.bus_bytes_per_second / 1e9
            );
            results.push(result);
        }
    }
    Ok(())
}
