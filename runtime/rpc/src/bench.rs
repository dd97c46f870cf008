//! `dfc bench-allreduce`: the ring all-reduce's bandwidth across local workers, next to what
//! raw TCP carries on loopback in the same run.
//!
//! Bus bandwidth is NCCL's measure: the algorithm bandwidth (bytes reduced per second) times
//! 2(n − 1)/n, the share of the buffer each link carries in a ring, so that it compares with a
//! link's own throughput whatever the number of workers.

use crate::auth::AddToken;
use crate::proto::worker_client::WorkerClient;
use crate::proto::BenchAllReduceRequest;
use crate::MAX_MESSAGE_BYTES;
use std::io::{Read, Write};
use std::time::{Duration, Instant};

/// Bytes per second one TCP connection carries on 127.0.0.1 (a writer thread, a reader thread,
/// 1 MiB writes), over `total` bytes.
pub fn loopback_tcp_bytes_per_second(total: usize) -> Result<f64, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    let address = listener.local_addr().map_err(|e| e.to_string())?;
    let reader = std::thread::spawn(move || -> std::io::Result<usize> {
        let (mut stream, _) = listener.accept()?;
        let mut buffer = vec![0u8; 1 << 20];
        let mut received = 0;
        loop {
            match stream.read(&mut buffer)? {
                0 => return Ok(received),
                n => received += n,
            }
        }
    });
    let mut stream = std::net::TcpStream::connect(address).map_err(|e| e.to_string())?;
    stream.set_nodelay(true).map_err(|e| e.to_string())?;
    let chunk = vec![1u8; 1 << 20];
    let started = Instant::now();
    let mut sent = 0;
    while sent < total {
        stream.write_all(&chunk).map_err(|e| e.to_string())?;
        sent += chunk.len();
    }
    drop(stream);
    let received = reader.join().map_err(|_| "the reader panicked")?.map_err(|e| e.to_string())?;
    let seconds = started.elapsed().as_secs_f64();
    if received != sent {
        return Err(format!("sent {sent} bytes, received {received}"));
    }
    Ok(sent as f64 / seconds)
}

/// One size on one number of workers.
#[derive(Clone, Debug, serde::Serialize)]
pub struct AllReduceResult {
    pub workers: usize,
    pub bytes: u64,
    pub iterations: usize,
    /// Median over the iterations of the slowest worker's time.
    pub median_seconds: f64,
    pub algorithm_bytes_per_second: f64,
    pub bus_bytes_per_second: f64,
}

/// Times `iterations` all-reduces of `bytes` (f32) across the workers at `addresses`.
pub fn all_reduce(addresses: &[String], token: &str, bytes: u64, iterations: u32) -> Result<AllReduceResult, String> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    let n = addresses.len();
    let names: Vec<String> = (0..n).map(|r| format!("worker {r}")).collect();
    let id: Vec<u8> = crate::auth::random_token().into_bytes();
    let replies: Vec<Vec<f64>> = runtime.block_on(async {
        let mut calls = Vec::new();
        for rank in 0..n {
            let channel = crate::tls::endpoint(&addresses[rank], None)?
                .connect()
                .await
                .map_err(|e| format!("worker at {}: {e}", addresses[rank]))?;
            let mut client = WorkerClient::with_interceptor(channel, AddToken::new(token))
                .max_decoding_message_size(MAX_MESSAGE_BYTES);
            let mut request = tonic::Request::new(BenchAllReduceRequest {
                id: id.clone().into(),
                rank: rank as u32,
                workers: addresses.to_vec(),
                names: names.clone(),
                bytes,
                iterations,
                wait_ms: 120_000,
            });
            request.set_timeout(Duration::from_secs(600));
            calls.push(tokio::spawn(async move { client.bench_all_reduce(request).await }));
        }
        let mut replies = Vec::new();
        for (rank, call) in calls.into_iter().enumerate() {
            let reply =
                call.await.map_err(|e| e.to_string())?.map_err(|s| format!("worker {rank}: {}", s.message()))?;
            replies.push(reply.into_inner().seconds);
        }
        Ok::<_, String>(replies)
    })?;
    let mut slowest: Vec<f64> =
        (0..iterations as usize).map(|i| replies.iter().map(|r| r[i]).fold(0.0, f64::max)).collect();
    slowest.sort_by(f64::total_cmp);
    let median = slowest[slowest.len() / 2];
    let algorithm = bytes as f64 / median;
    Ok(AllReduceResult {
        workers: n,
        bytes,
        iterations: iterations as usize,
        median_seconds: median,
        algorithm_bytes_per_second: algorithm,
        bus_bytes_per_second: algorithm * 2.0 * (n as f64 - 1.0) / n as f64,
    })
}
