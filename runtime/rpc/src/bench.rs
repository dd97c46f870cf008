//! `dfc bench-allreduce`: the ring all-reduce's bandwidth across local workers, next to what
//! raw TCP carries on loopback in the same run.
//!
//! Bus bandwidth is NCCL's measure: the algorithm bandwidth (bytes reduced per second) times
//! 2(n − 1)/n, the share of the buffer each link carries in a ring, so that it compares with a
//! link's own throughput whatever the number of workers.

use crate::auth::AddToken;
use crate::proto::worker_client::WorkerClient;
use crate::proto::{BenchAllReduceRequest, HealthRequest};
use crate::rendezvous::Algorithm;
use crate::MAX_MESSAGE_BYTES;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Bytes per second that each of `links` TCP connections on 127.0.0.1 carries when they all
/// stream `total` bytes at once (a writer thread and a reader thread each, 1 MiB writes and
/// reads, which go through `span` bytes of memory at each end, round and round): with one
/// link, what one connection carries; with n links arranged as a ring's (each endpoint sends on
/// one and receives on another), what the links of an n-worker ring can carry on this machine
/// at best, since they share its cores. A `span` of 1 MiB stays in the caches; a span the size
/// of a tensor streams it from and to memory, as an all-reduce of it must.
pub fn loopback_tcp_bytes_per_second(links: usize, total: usize, span: usize) -> Result<f64, String> {
    const IO: usize = 1 << 20;
    let links = links.max(1);
    // At least one write's worth: the writers and readers go round the span.
    let span = span.max(1).next_multiple_of(IO);
    let start = std::sync::Arc::new(std::sync::Barrier::new(2 * links));
    let mut readers = Vec::new();
    let mut addresses = Vec::new();
    for _ in 0..links {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        addresses.push(listener.local_addr().map_err(|e| e.to_string())?);
        let start = start.clone();
        readers.push(std::thread::spawn(move || -> std::io::Result<usize> {
            let (mut stream, _) = listener.accept()?;
            let mut buffer = vec![0u8; span];
            buffer.fill(1); // mapped before the clock starts
            start.wait();
            let mut received = 0;
            loop {
                let at = received % span;
                match stream.read(&mut buffer[at..(at + IO).min(span)])? {
                    0 => return Ok(received),
                    n => received += n,
                }
            }
        }));
    }
    let mut writers = Vec::new();
    for address in addresses {
        let start = start.clone();
        writers.push(std::thread::spawn(move || -> std::io::Result<(Instant, usize)> {
            let mut stream = std::net::TcpStream::connect(address)?;
            stream.set_nodelay(true)?;
            let buffer = vec![1u8; span];
            start.wait();
            let started = Instant::now();
            let mut sent = 0;
            while sent < total {
                let at = sent % span;
                stream.write_all(&buffer[at..at + IO])?;
                sent += IO;
            }
            Ok((started, sent))
        }));
    }
    let mut first_start: Option<Instant> = None;
    let mut sent = Vec::new();
    for writer in writers {
        let (started, bytes) = writer.join().map_err(|_| "a writer panicked")?.map_err(|e| e.to_string())?;
        first_start = Some(first_start.map_or(started, |f| f.min(started)));
        sent.push(bytes);
    }
    for (reader, sent) in readers.into_iter().zip(sent) {
        let received = reader.join().map_err(|_| "a reader panicked")?.map_err(|e| e.to_string())?;
        if received != sent {
            return Err(format!("sent {sent} bytes, received {received}"));
        }
    }
    let seconds = first_start.expect("at least one link").elapsed().as_secs_f64();
    Ok(total.next_multiple_of(IO) as f64 / seconds)
}

/// How the workers of an all-reduce benchmark send to each other.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Transport {
    /// As training does: shared-memory queues between workers that share a machine (all of a
    /// benchmark's do), TCP between the others.
    SharedMemory,
    /// The data plane's TCP connections, also between workers on one machine.
    Tcp,
}

/// One size on one number of workers.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AllReduceResult {
    pub workers: usize,
    /// How many hosts the workers' addresses name.
    pub hosts: usize,
    pub algorithm: &'static str,
    pub transport: Transport,
    /// Whether every worker's frames went through shared memory.
    pub shared_memory: bool,
    pub bytes: u64,
    pub iterations: usize,
    /// Median over the iterations of the slowest worker's time.
    pub median_seconds: f64,
    pub algorithm_bytes_per_second: f64,
    pub bus_bytes_per_second: f64,
    /// Bytes the workers' data planes sent to workers on other hosts per all-reduce, summed
    /// over the workers.
    pub bytes_between_hosts: u64,
}

/// Times `iterations` all-reduces of `bytes` (f32) across the workers at `addresses` (over TLS
/// with `tls`, which the workers must serve too) by `algorithm`.
#[allow(clippy::too_many_arguments)]
pub fn all_reduce(
    addresses: &[String],
    token: &str,
    tls: Option<&crate::Tls>,
    bytes: u64,
    iterations: u32,
    transport: Transport,
    algorithm: Algorithm,
) -> Result<AllReduceResult, String> {
    if iterations == 0 {
        return Err("an all-reduce benchmark needs at least one timed iteration".into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let n = addresses.len();
    let names: Vec<String> = (0..n).map(|r| format!("worker {r}")).collect();
    let id: Vec<u8> = crate::auth::random_token().into_bytes();
    let replies: Vec<(Vec<f64>, bool, u64)> = runtime.block_on(async {
        let mut clients = Vec::new();
        let mut data_ports = Vec::new();
        for address in addresses {
            let channel =
                crate::tls::endpoint(address, tls)?.connect().await.map_err(|e| format!("worker at {address}: {e}"))?;
            let mut client = WorkerClient::with_interceptor(channel, AddToken::new(token))
                .max_decoding_message_size(MAX_MESSAGE_BYTES);
            let health =
                client.health(HealthRequest {}).await.map_err(|s| format!("worker at {address}: {}", s.message()))?;
            data_ports.push(health.into_inner().data_port);
            clients.push(client);
        }
        let mut calls = Vec::new();
        for (rank, mut client) in clients.into_iter().enumerate() {
            let mut request = tonic::Request::new(BenchAllReduceRequest {
                id: id.clone().into(),
                rank: rank as u32,
                workers: addresses.to_vec(),
                names: names.clone(),
                bytes,
                iterations,
                wait_ms: 120_000,
                data_ports: data_ports.clone(),
                tcp_only: transport == Transport::Tcp,
                all_reduce: algorithm.wire_name().to_string(),
            });
            request.set_timeout(Duration::from_secs(600));
            calls.push(tokio::spawn(async move { client.bench_all_reduce(request).await }));
        }
        let mut replies = Vec::new();
        for (rank, call) in calls.into_iter().enumerate() {
            let reply =
                call.await.map_err(|e| e.to_string())?.map_err(|s| format!("worker {rank}: {}", s.message()))?;
            let reply = reply.into_inner();
            if reply.seconds.len() != iterations as usize {
                return Err(format!("worker {rank} timed {} all-reduces, not {iterations}", reply.seconds.len()));
            }
            replies.push((reply.seconds, reply.shared_memory, reply.bytes_to_other_hosts));
        }
        Ok::<_, String>(replies)
    })?;
    let mut slowest: Vec<f64> =
        (0..iterations as usize).map(|i| replies.iter().map(|(r, _, _)| r[i]).fold(0.0, f64::max)).collect();
    slowest.sort_by(f64::total_cmp);
    let median = slowest[slowest.len() / 2];
    let algorithm_rate = bytes as f64 / median;
    let hosts = crate::rendezvous::hosts_of(addresses).into_iter().max().map_or(0, |h| h + 1);
    Ok(AllReduceResult {
        workers: n,
        hosts,
        algorithm: algorithm.wire_name(),
        transport,
        shared_memory: replies.iter().all(|(_, shared, _)| *shared),
        bytes,
        iterations: iterations as usize,
        median_seconds: median,
        algorithm_bytes_per_second: algorithm_rate,
        bus_bytes_per_second: algorithm_rate * 2.0 * (n as f64 - 1.0) / n as f64,
        bytes_between_hosts: replies.iter().map(|(_, _, b)| b).sum::<u64>() / iterations as u64,
    })
}

/// Asks the workers at `addresses` to stop (best effort: one that is gone already is not an
/// error).
pub fn shutdown(addresses: &[String], token: &str, tls: Option<&crate::Tls>) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().map_err(|e| e.to_string())?;
    runtime.block_on(async {
        for address in addresses {
            let Ok(endpoint) = crate::tls::endpoint(address, tls) else { continue };
            let Ok(channel) = endpoint.connect().await else { continue };
            let mut client = WorkerClient::with_interceptor(channel, AddToken::new(token));
            let mut request = tonic::Request::new(crate::proto::ShutdownRequest {});
            request.set_timeout(Duration::from_secs(5));
            let _ = client.shutdown(request).await;
        }
    });
    Ok(())
}
