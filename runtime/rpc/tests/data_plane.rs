//! The data plane: the ring all-reduce over it between workers of this process (segments of
//! unequal sizes, empty ones, several chunks each; 2 to 4 workers), and what its handshake
//! refuses.

use dfc_rpc::auth::AddToken;
use dfc_rpc::bench::Transport;
use dfc_rpc::data::Links;
use dfc_rpc::proto::worker_client::WorkerClient;
use dfc_rpc::proto::HealthRequest;
use std::io::{Read, Write};
use std::time::Duration;

const TOKEN: &str = "data-plane-test-token-0123456789";

/// `n` workers serving on loopback ports from a runtime of their own.
fn start_workers(n: usize) -> (tokio::runtime::Runtime, Vec<String>) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let addresses = (0..n)
        .map(|_| {
            let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
            let address = listener.local_addr().unwrap().to_string();
            runtime.spawn(dfc_rpc::serve(listener, TOKEN.to_string(), None, dfc_rpc::DataPlane::default()));
            address
        })
        .collect();
    (runtime, addresses)
}

fn data_port(runtime: &tokio::runtime::Runtime, address: &str) -> u32 {
    runtime.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}")).unwrap().connect_lazy();
        let mut client = WorkerClient::with_interceptor(channel, AddToken::new(TOKEN));
        client.health(HealthRequest {}).await.unwrap().into_inner().data_port
    })
}

#[test]
fn the_ring_on_the_data_plane_sums_every_element() {
    for n in [2usize, 3, 4] {
        let (runtime, addresses) = start_workers(n);
        assert!(addresses.iter().all(|a| data_port(&runtime, a) != 0), "every worker has a data port");
        // One element (empty segments), 1021 elements (unequal ones), 3 MiB and 3 elements
        // (several chunks per segment, the last one short). Each worker checks every element of
        // its sum, and element i differs from element j, so a misplaced chunk is seen.
        for bytes in [4u64, 4 * 1021, (3 << 20) + 12] {
            for transport in [Transport::SharedMemory, Transport::Tcp] {
                let result = dfc_rpc::bench::all_reduce(&addresses, TOKEN, bytes, 2, transport)
                    .unwrap_or_else(|e| panic!("{n} workers, {bytes} bytes, {transport:?}: {e}"));
                assert_eq!(result.shared_memory, transport == Transport::SharedMemory, "{n} workers, {transport:?}");
            }
        }
    }
}

#[test]
fn a_data_connection_needs_the_token_and_a_run_here() {
    let (runtime, addresses) = start_workers(1);
    let port = data_port(&runtime, &addresses[0]);
    let to_worker = [addresses[0].clone(), "127.0.0.1:1".to_string()];
    let send = |links: &Links| links.send(0, 0, "key#0", &[0u8; 8], 0, 8, Duration::from_secs(5));

    let wrong_token = Links::new("not-the-token-but-long-enough", b"some run", 1, &to_worker, &[port, 0], true);
    let error = send(&wrong_token).unwrap_err();
    assert!(error.contains("refused the token"), "{error}");

    let unknown_run = Links::new(TOKEN, b"no run of this worker", 1, &to_worker, &[port, 0], true);
    let error = send(&unknown_run).unwrap_err();
    assert!(error.contains("does not know this run"), "{error}");

    // Bytes that are not a handshake: the worker hangs up, and goes on serving.
    let host = addresses[0].rsplit_once(':').unwrap().0;
    let mut stream = std::net::TcpStream::connect(format!("{host}:{port}")).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut nonce = [0u8; 64];
    stream.read_exact(&mut nonce).unwrap();
    stream.write_all(&[0x5a; 300]).unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(rest.is_empty(), "no answer to garbage: {rest:?}");
    assert_ne!(data_port(&runtime, &addresses[0]), 0);
}
