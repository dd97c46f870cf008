//! The data plane: the ring all-reduce over it between workers of this process (segments of
//! unequal sizes, empty ones, several chunks each; 2 to 4 workers; plain on loopback and in
//! TLS), and what its handshake refuses: a wrong token, a proof replayed from another
//! connection, a receiver that does not prove the token, a peer without the CA's certificate.

use dfc_rpc::auth::AddToken;
use dfc_rpc::bench::Transport;
use dfc_rpc::data::Links;
use dfc_rpc::proto::worker_client::WorkerClient;
use dfc_rpc::proto::HealthRequest;
use dfc_rpc::rendezvous::Algorithm;
use dfc_rpc::Tls;
use std::io::{Read, Write};
use std::path::PathBuf;
use std::time::Duration;

const TOKEN: &str = "data-plane-test-token-0123456789";

/// `n` workers serving on loopback ports from a runtime of their own (in TLS with `tls`).
fn start_workers(n: usize, tls: Option<&Tls>) -> (tokio::runtime::Runtime, Vec<String>) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let addresses = (0..n)
        .map(|_| {
            let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0")).unwrap();
            let address = listener.local_addr().unwrap().to_string();
            runtime.spawn(dfc_rpc::serve(listener, TOKEN.to_string(), tls.cloned(), dfc_rpc::DataPlane::default()));
            address
        })
        .collect();
    (runtime, addresses)
}

fn data_port(runtime: &tokio::runtime::Runtime, address: &str, tls: Option<&Tls>) -> u32 {
    runtime.block_on(async {
        let channel = dfc_rpc::tls::endpoint(address, tls).unwrap().connect_lazy();
        let mut client = WorkerClient::with_interceptor(channel, AddToken::new(TOKEN));
        client.health(HealthRequest {}).await.unwrap().into_inner().data_port
    })
}

/// TLS files for localhost (127.0.0.1 too) from a CA of their own, made by `dfc certs`'s code.
fn certificates(name: &str) -> PathBuf {
    let out = std::env::temp_dir().join(format!("dfc-data-plane-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    dfc_rpc::certs::make(&out, &["localhost".to_string()]).unwrap();
    out.join("localhost")
}

#[test]
fn the_ring_on_the_data_plane_sums_every_element() {
    let pki = certificates("ring");
    let tls = Tls::load(&pki).unwrap();
    for (n, tls) in [(2usize, None), (3, None), (4, None), (2, Some(&tls)), (3, Some(&tls))] {
        let (runtime, addresses) = start_workers(n, tls);
        assert!(addresses.iter().all(|a| data_port(&runtime, a, tls) != 0), "every worker has a data port");
        // One element (empty segments), 1021 elements (unequal ones), 3 MiB and 3 elements
        // (several chunks per segment, the last one short). Each worker checks every element of
        // its sum, and element i differs from element j, so a misplaced chunk is seen.
        for bytes in [4u64, 4 * 1021, (3 << 20) + 12] {
            for transport in [Transport::SharedMemory, Transport::Tcp] {
                let result = dfc_rpc::bench::all_reduce(&addresses, TOKEN, tls, bytes, 2, transport, Algorithm::Ring)
                    .unwrap_or_else(|e| {
                        panic!("{n} workers, {bytes} bytes, {transport:?}, TLS {}: {e}", tls.is_some())
                    });
                assert_eq!(result.shared_memory, transport == Transport::SharedMemory, "{n} workers, {transport:?}");
            }
        }
    }
    std::fs::remove_dir_all(pki.parent().unwrap()).unwrap();
}

/// Workers serving on `hosts` loopback addresses (127.0.0.1, 127.0.0.2, ...), `per_host` on
/// each, host by host: as many hosts to the hierarchical all-reduce, which tells hosts apart
/// by the addresses' host part.
fn start_workers_on_hosts(hosts: usize, per_host: usize) -> (tokio::runtime::Runtime, Vec<String>) {
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let addresses = (0..hosts * per_host)
        .map(|i| {
            let host = format!("127.0.0.{}:0", i / per_host + 1);
            let listener = runtime.block_on(tokio::net::TcpListener::bind(host)).unwrap();
            let address = listener.local_addr().unwrap().to_string();
            runtime.spawn(dfc_rpc::serve(listener, TOKEN.to_string(), None, dfc_rpc::DataPlane::default()));
            address
        })
        .collect();
    (runtime, addresses)
}

/// The hierarchical all-reduce sums every element (each worker checks its result) on 2 hosts
/// of 2 and 3 workers and 3 hosts of 2, and sends fewer bytes between hosts than the flat ring:
/// on 2 hosts of 2, each host sends the tensor once to the other (S each way) where the flat
/// ring's two links between the hosts carry 2(n − 1)/n·S = 1.5·S each.
#[test]
fn the_hierarchical_all_reduce_sums_every_element_and_sends_fewer_bytes_between_hosts() {
    for (hosts, per_host) in [(2usize, 2usize), (2, 3), (3, 2)] {
        let (_runtime, addresses) = start_workers_on_hosts(hosts, per_host);
        for bytes in [4u64, 4 * 1021, (3 << 20) + 12] {
            for transport in [Transport::SharedMemory, Transport::Tcp] {
                let run = |algorithm| {
                    dfc_rpc::bench::all_reduce(&addresses, TOKEN, None, bytes, 2, transport, algorithm).unwrap_or_else(
                        |e| panic!("{hosts}×{per_host}, {bytes} bytes, {transport:?}, {algorithm:?}: {e}"),
                    )
                };
                let (flat, hierarchical) = (run(Algorithm::Ring), run(Algorithm::Hierarchical));
                assert_eq!((flat.hosts, hierarchical.hosts), (hosts, hosts));
                if bytes < 1 << 20 {
                    continue;
                }
                // Each host sends 2(H − 1)/H·S; the flat ring's H links between hosts carry
                // 2(n − 1)/n·S each.
                let (h, n, s) = (hosts as f64, (hosts * per_host) as f64, bytes as f64);
                let expected = [(&flat, h * 2.0 * (n - 1.0) / n * s), (&hierarchical, h * 2.0 * (h - 1.0) / h * s)];
                for (result, expected) in expected {
                    let sent = result.bytes_between_hosts as f64;
                    assert!(
                        (sent - expected).abs() <= 64.0,
                        "{hosts}×{per_host}, {}: {sent} bytes between hosts, not {expected}",
                        result.algorithm
                    );
                }
            }
        }
    }
}

#[test]
fn a_data_connection_needs_the_token_and_a_run_here() {
    let (runtime, addresses) = start_workers(1, None);
    let port = data_port(&runtime, &addresses[0], None);
    let to_worker = [addresses[0].clone(), "127.0.0.1:1".to_string()];
    let send = |links: &Links| links.send(0, 0, "key#0", &[0u8; 8], 0, 8, Duration::from_secs(5));

    let wrong_token = Links::new("not-the-token-but-long-enough", b"some run", 1, &to_worker, &[port, 0], true, None);
    let error = send(&wrong_token).unwrap_err();
    assert!(error.contains("refused the token"), "{error}");

    let unknown_run = Links::new(TOKEN, b"no run of this worker", 1, &to_worker, &[port, 0], true, None);
    let error = send(&unknown_run).unwrap_err();
    assert!(error.contains("does not know this run"), "{error}");

    // Bytes that are not a handshake: the worker hangs up, and goes on serving.
    let host = addresses[0].rsplit_once(':').unwrap().0;
    let mut stream = std::net::TcpStream::connect(format!("{host}:{port}")).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 40];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..8], b"dfcdata2");
    stream.write_all(&[0x5a; 300]).unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    assert!(rest.is_empty(), "no answer to garbage: {rest:?}");
    assert_ne!(data_port(&runtime, &addresses[0], None), 0);
}

/// A listener that takes one connection, greets it as a data port would, and returns what the
/// sender answered (its hello: magic, nonce, proof, id length, id) after answering `reply`.
fn impostor(reply: Vec<u8>) -> (u16, std::thread::JoinHandle<Vec<u8>>) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let taken = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        stream.write_all(&[b"dfcdata2".as_slice(), &[9u8; 32]].concat()).unwrap();
        let mut hello = vec![0u8; 8 + 32 + 32 + 2];
        stream.read_exact(&mut hello).unwrap();
        let id_len = u16::from_le_bytes([hello[72], hello[73]]) as usize;
        let mut id = vec![0u8; id_len];
        stream.read_exact(&mut id).unwrap();
        stream.write_all(&reply).unwrap();
        hello.extend_from_slice(&id);
        hello
    });
    (port, taken)
}

#[test]
fn a_proof_is_worth_nothing_on_another_connection_and_the_receiver_proves_the_token_too() {
    let (runtime, addresses) = start_workers(1, None);
    let port = data_port(&runtime, &addresses[0], None);

    // A receiver that does not hold the token accepts, but cannot prove it: nothing is sent.
    let (fake, hello) = impostor([[0u8].as_slice(), &[1u8; 32]].concat());
    let to_fake = [format!("127.0.0.1:{fake}"), "127.0.0.1:1".to_string()];
    let links = Links::new(TOKEN, b"some run", 1, &to_fake, &[u32::from(fake), 0], false, None);
    let error = links.send(0, 0, "key#0", &[0u8; 8], 0, 8, Duration::from_secs(5)).unwrap_err();
    assert!(error.contains("did not prove the token"), "{error}");
    let captured = hello.join().unwrap();

    // The sender's proof, captured there, replayed to the real worker (which sent another nonce).
    let mut stream = std::net::TcpStream::connect(format!("127.0.0.1:{port}")).unwrap();
    stream.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut greeting = [0u8; 40];
    stream.read_exact(&mut greeting).unwrap();
    stream.write_all(&captured).unwrap();
    let mut status = [0u8; 1];
    stream.read_exact(&mut status).unwrap();
    assert_eq!(status[0], 1, "a replayed proof is a wrong token");
}

#[test]
fn in_tls_a_data_connection_needs_the_cas_certificate() {
    let (ours, theirs) = (certificates("ours"), certificates("theirs"));
    let (tls, other_ca) = (Tls::load(&ours).unwrap(), Tls::load(&theirs).unwrap());
    let (runtime, addresses) = start_workers(1, Some(&tls));
    let port = data_port(&runtime, &addresses[0], Some(&tls));
    assert_ne!(port, 0, "a TLS worker has a data port");
    let to_worker = [addresses[0].clone(), "127.0.0.1:1".to_string()];
    let send = |links: &Links| links.send(0, 0, "key#0", &[0u8; 8], 0, 8, Duration::from_secs(5));
    // The right CA: the handshake goes through (to the registration check, as none is here).
    let error = send(&Links::new(TOKEN, b"no run", 1, &to_worker, &[port, 0], false, Some(&tls))).unwrap_err();
    assert!(error.contains("does not know this run"), "{error}");
    // Another CA's certificate; no TLS at all: refused before any proof of the token.
    let error = send(&Links::new(TOKEN, b"no run", 1, &to_worker, &[port, 0], false, Some(&other_ca))).unwrap_err();
    assert!(error.contains("invalid peer certificate: UnknownIssuer"), "{error}");
    let error = send(&Links::new(TOKEN, b"no run", 1, &to_worker, &[port, 0], false, None)).unwrap_err();
    assert!(error.contains("closed the connection before greeting it") && error.contains("--tls-dir"), "{error}");
    for dir in [ours, theirs] {
        std::fs::remove_dir_all(dir.parent().unwrap()).unwrap();
    }
}

/// More idle connections than a data port keeps waiting: the oldest are closed at once, the
/// newest by the deadline, and a sender holding the token gets through all the while.
#[test]
fn idle_connections_make_room_and_do_not_keep_a_sender_out() {
    let (runtime, addresses) = start_workers(1, None);
    let port = data_port(&runtime, &addresses[0], None);
    let flood: Vec<std::net::TcpStream> = (0..dfc_rpc::limits::MAX_UNPROVEN + 50)
        .map(|_| std::net::TcpStream::connect(format!("127.0.0.1:{port}")).unwrap())
        .collect();
    let to_worker = [addresses[0].clone(), "127.0.0.1:1".to_string()];
    let links = Links::new(TOKEN, b"no run", 1, &to_worker, &[port, 0], false, None);
    let error = links.send(0, 0, "key#0", &[0u8; 8], 0, 8, Duration::from_secs(5)).unwrap_err();
    assert!(error.contains("does not know this run"), "the sender got through to the registration check: {error}");
    // The first connections of the flood were evicted: closed after their greeting.
    let closed = |mut stream: &std::net::TcpStream, within: Duration| {
        stream.set_read_timeout(Some(within)).unwrap();
        let mut rest = Vec::new();
        stream.read_to_end(&mut rest).is_ok() && rest.len() <= 40
    };
    assert!(flood[..40].iter().all(|s| closed(s, Duration::from_secs(2))), "the oldest idle connections are closed");
    let deadline = dfc_rpc::limits::UNPROVEN_DEADLINE + Duration::from_secs(3);
    assert!(closed(flood.last().unwrap(), deadline), "the newest by the deadline");
}
