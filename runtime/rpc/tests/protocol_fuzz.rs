//! Thousands of random calls from a client that holds the token: plans that are not plans,
//! registrations that contradict themselves, programs and steps out of order, feeds and pushed
//! chunks of every wrong shape, all-reduce benchmarks of every size. The worker answers each (an error or not), never panics, and
//! still answers `Health` at the end. Its own binary, so that its panic hook sees only it.

use dfc_rpc::auth::AddToken;
use dfc_rpc::proto::worker_client::WorkerClient;
use dfc_rpc::proto::*;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

const TOKEN: &str = "protocol-fuzz-token-0123456789";
const CALLS: usize = 1000;

/// Steps that ran to the end.
static RUNS: AtomicUsize = AtomicUsize::new(0);
static PANICS: AtomicUsize = AtomicUsize::new(0);

/// A small deterministic generator (the run is the same every time).
struct Random(u64);

impl Random {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        self.0 >> 11
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len() as u64) as usize]
    }

    fn bytes(&mut self, max: u64) -> Vec<u8> {
        (0..self.below(max + 1)).map(|_| self.next() as u8).collect()
    }

    /// A number that is usually small, sometimes at the edges of its type.
    fn number(&mut self) -> u64 {
        match self.below(10) {
            0 => u64::MAX,
            1 => u64::MAX / 2 + self.below(3),
            2 => 1 << (32 + self.below(32)),
            _ => self.below(40),
        }
    }

    fn dims(&mut self) -> Vec<u64> {
        (0..self.below(4)).map(|_| if self.chance(10) { self.number() } else { self.below(40) }).collect()
    }

    fn tensor(&mut self) -> Tensor {
        let dims = self.dims();
        let elements: u64 = dims.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).unwrap_or(u64::MAX);
        // Often exactly the bytes the type needs, else anything.
        let data = if self.chance(50) && elements <= 4096 { vec![0u8; elements as usize * 4] } else { self.bytes(300) };
        Tensor { dtype: self.below(8) as u32, dims, data: data.into() }
    }
}

fn plan_bytes() -> Vec<u8> {
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/linear_regression.df")).unwrap();
    let options = dfc_compile::CompileOptions::default();
    let plan = dfc_compile::compile(&source, "linear_regression.df", &options).unwrap().plan;
    dfc_plan::encode(&plan)
}

fn valid_registration(plan: &[u8], backend: &str) -> RegisterRequest {
    RegisterRequest {
        plan: plan.to_vec().into(),
        plan_sha256: dfc_rpc::plan_sha256(plan),
        rank: 0,
        workers: vec!["127.0.0.1:1".into()],
        names: vec!["/job:localhost/task:0".into()],
        partition_worker: vec![0],
        seed: 1,
        backend: backend.into(),
        wait_ms: 100,
        data_ports: vec![],
        all_reduce: String::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousands_of_random_calls_never_crash_the_worker() {
    std::panic::set_hook(Box::new(|info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        eprintln!("panic: {info}");
    }));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(dfc_rpc::serve(listener, TOKEN.to_string(), None, dfc_rpc::DataPlane::default()));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}")).unwrap().connect_lazy();
    let mut client = WorkerClient::with_interceptor(channel, AddToken::new(TOKEN));

    let plan = plan_bytes();
    let hash = dfc_rpc::plan_sha256(&plan);
    let hashes = [hash.clone(), dfc_rpc::plan_sha256(b"another plan"), Default::default()];
    let names = ["x", "y", "w", "b", "loss", "prediction", "", "x/slice", "w/update/assign_sub", "\u{0}é"];
    let keys = ["k", "", "/job:localhost/task:0/cpu:0;x;/job:localhost/task:0/cpu:0", "k#0", "tensor 0 4 k"];
    let mut random = Random(0x5eed);
    let mut answered = 0;
    for _ in 0..CALLS {
        let sha = if random.chance(80) { hash.clone() } else { random.pick(&hashes).clone() };
        let timeout = Duration::from_secs(10);
        let call = async {
            match random.below(11) {
                9 => {
                    // A step that fits the plan, on random values (NaN and infinities among
                    // them): the program may be missing, or the plan not registered.
                    let training = ["loss".to_string()];
                    let prepare = PrepareRequest {
                        plan_sha256: sha.clone(),
                        program: 7,
                        fetches: training.to_vec(),
                        targets: vec![],
                        stage: 0,
                    };
                    drop(client.prepare(prepare).await);
                    let feeds = [("x", vec![32, 13]), ("y", vec![32])]
                        .into_iter()
                        .map(|(name, dims): (&str, Vec<u64>)| {
                            let data: Vec<u8> =
                                (0..dims.iter().product::<u64>() * 4).map(|_| random.next() as u8).collect();
                            NamedTensor {
                                name: name.into(),
                                tensor: Some(Tensor { dtype: 0, dims, data: data.into() }),
                            }
                        })
                        .collect();
                    let request = RunRequest {
                        plan_sha256: sha,
                        program: 7,
                        step: random.number(),
                        feeds,
                        trace: random.below(2) == 1,
                        // Turns of free-running replicas' Runs, some that never come.
                        turn: random.below(4),
                        after_turn: random.below(4),
                    };
                    if client.run(request).await.is_ok() {
                        RUNS.fetch_add(1, Ordering::SeqCst);
                    }
                }
                0 => {
                    let (bytes, sha) = match random.below(3) {
                        0 => {
                            let bytes = random.bytes(200);
                            (bytes.clone(), dfc_rpc::plan_sha256(&bytes))
                        }
                        1 => {
                            // The real plan with one byte of its payload changed, its checksum
                            // made right again (a crafted or badly written plan), under its new
                            // hash: refused by the plan's validation, or run.
                            let mut bytes = plan.clone();
                            let header = dfc_plan::HEADER_LEN;
                            let at = header + random.below((bytes.len() - header) as u64) as usize;
                            bytes[at] ^= 1 << random.below(8);
                            let checksum = crc32fast::hash(&bytes[header..]);
                            bytes[20..24].copy_from_slice(&checksum.to_le_bytes());
                            (bytes.clone(), dfc_rpc::plan_sha256(&bytes))
                        }
                        _ => (plan.clone(), sha),
                    };
                    if random.chance(50) {
                        // A registration that holds, so that the calls after it go deeper.
                        drop(
                            client
                                .register(valid_registration(&plan, if random.chance(50) { "llvm" } else { "interp" }))
                                .await,
                        );
                        return;
                    }
                    let workers: Vec<String> = (0..random.below(3)).map(|i| format!("127.0.0.1:{}", i + 1)).collect();
                    let request = RegisterRequest {
                        plan: bytes.into(),
                        plan_sha256: sha,
                        rank: random.below(4) as u32,
                        names: workers.iter().map(|_| "/job:localhost/task:0".to_string()).collect(),
                        workers,
                        partition_worker: (0..random.below(3)).map(|_| random.below(3) as u32).collect(),
                        seed: random.number(),
                        backend: random.pick(&["llvm", "interp", "gpu", ""]).to_string(),
                        wait_ms: random.below(200),
                        data_ports: (0..random.below(3)).map(|_| random.number() as u32).collect(),
                        all_reduce: random.pick(&["", "ring", "hierarchical", "mpi", "tree"]).to_string(),
                    };
                    drop(client.register(request).await)
                }
                1 => {
                    let pick = |random: &mut Random| -> Vec<String> {
                        (0..random.below(3)).map(|_| random.pick(&names).to_string()).collect()
                    };
                    let request = PrepareRequest {
                        plan_sha256: sha,
                        program: random.below(4),
                        fetches: pick(&mut random),
                        targets: pick(&mut random),
                        stage: random.below(4) as u32,
                    };
                    drop(client.prepare(request).await)
                }
                2 | 3 => {
                    let feeds = (0..random.below(3))
                        .map(|_| NamedTensor {
                            name: random.pick(&names).to_string(),
                            tensor: (!random.chance(10)).then(|| random.tensor()),
                        })
                        .collect();
                    let request = RunRequest {
                        plan_sha256: sha,
                        program: random.below(4),
                        step: random.number(),
                        feeds,
                        trace: random.below(2) == 1,
                        // Turns of free-running replicas' Runs, some that never come.
                        turn: random.below(4),
                        after_turn: random.below(4),
                    };
                    drop(client.run(request).await)
                }
                4 | 5 => {
                    // Mostly for the plan registered now: a push for an id that names none
                    // waits a while, in case it is a benchmark's not set up here yet.
                    let registered = client.health(HealthRequest {}).await.map(|h| h.into_inner().plan_sha256);
                    let sha = match registered {
                        Ok(registered) if !registered.is_empty() && !random.chance(5) => registered,
                        Ok(_) if !random.chance(5) => {
                            drop(client.register(valid_registration(&plan, "interp")).await);
                            hash.clone()
                        }
                        _ => sha,
                    };
                    let chunks: Vec<TensorChunk> = (0..random.below(4))
                        .map(|_| {
                            let tensor = random.tensor();
                            TensorChunk {
                                plan_sha256: sha.clone(),
                                step: random.number(),
                                key: random.pick(&keys).to_string(),
                                dtype: tensor.dtype,
                                dims: if random.chance(50) { tensor.dims } else { Vec::new() },
                                offset: random.number(),
                                data: tensor.data,
                            }
                        })
                        .collect();
                    drop(client.push(tokio_stream::iter(chunks)).await)
                }
                6 => {
                    let request = AbortRequest { plan_sha256: sha, step: random.number(), reason: "fuzz".into() };
                    drop(client.abort(request).await)
                }
                7 => drop(client.get_variables(VariablesRequest { plan_sha256: sha }).await),
                10 => {
                    // An all-reduce benchmark of any size among one to three workers, the
                    // others unreachable: timed alone, or refused, or given up after its wait.
                    let workers: Vec<String> = (0..random.below(4)).map(|i| format!("127.0.0.{}:1", i + 1)).collect();
                    let any = random.number();
                    let request = BenchAllReduceRequest {
                        id: random.bytes(16).into(),
                        rank: random.below(4) as u32,
                        names: workers.iter().enumerate().map(|(i, _)| format!("/job:worker/task:{i}")).collect(),
                        workers,
                        bytes: *random.pick(&[0, 2, 4, 4096, any]),
                        iterations: random.below(4) as u32,
                        wait_ms: random.below(100),
                        data_ports: (0..random.below(3)).map(|_| random.number() as u32).collect(),
                        tcp_only: random.chance(50),
                        all_reduce: random.pick(&["", "ring", "hierarchical", "mpi"]).to_string(),
                    };
                    drop(client.bench_all_reduce(request).await)
                }
                _ => {
                    let variables = (0..random.below(3))
                        .map(|_| NamedTensor {
                            name: random.pick(&names).to_string(),
                            tensor: (!random.chance(10)).then(|| random.tensor()),
                        })
                        .collect();
                    drop(client.restore(RestoreRequest { plan_sha256: sha, variables }).await)
                }
            }
        };
        let finished = tokio::time::timeout(timeout, call).await;
        assert!(finished.is_ok(), "a call took more than {timeout:?}");
        answered += 1;
    }
    assert_eq!(answered, CALLS);
    assert!(RUNS.load(Ordering::SeqCst) >= 10, "only {} steps ran to the end", RUNS.load(Ordering::SeqCst));
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "the worker panicked (see above)");
    let health = client.health(HealthRequest {}).await;
    assert!(health.is_ok(), "the worker still answers: {health:?}");
}
