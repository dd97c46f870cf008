//! Fuzzes a worker's RPC surface from a client that holds the token (the calls an attacker
//! without it makes are refused by the interceptor before any of this runs): each input is a
//! sequence of calls — registrations of the real plan, of the plan with its payload changed
//! (checksum made right) and of bytes that are no plan; programs; steps on random feeds;
//! pushes of chunks that contradict each other; aborts, variables, restores; all-reduce
//! benchmarks of any size among one to three workers (the others unreachable) — sent to one
//! worker in this process. A panic anywhere in the worker is a crash; after each sequence the
//! worker must still answer `Health`.

#![no_main]

use arbitrary::{Arbitrary, Unstructured};
use dfc_rpc::auth::AddToken;
use dfc_rpc::proto::worker_client::WorkerClient;
use dfc_rpc::proto::*;
use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;

const TOKEN: &str = "worker-fuzz-token-0123456789";

type Client = WorkerClient<tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>>;

struct Harness {
    runtime: tokio::runtime::Runtime,
    client: Client,
    plan: Vec<u8>,
}

fn harness() -> &'static Harness {
    static HARNESS: OnceLock<Harness> = OnceLock::new();
    HARNESS.get_or_init(|| {
        // Mutated plans are not worth caching.
        std::env::set_var("DFC_CACHE_DIR", "off");
        let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        let client = runtime.block_on(async {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let address = listener.local_addr().unwrap();
            tokio::spawn(dfc_rpc::serve(listener, TOKEN.to_string(), None, dfc_rpc::DataPlane::default()));
            let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}")).unwrap().connect_lazy();
            WorkerClient::with_interceptor(channel, AddToken::new(TOKEN))
        });
        let source = include_str!("../../examples/linear_regression.df");
        let plan = dfc_compile::compile(source, "linear_regression.df", &Default::default()).unwrap().plan;
        Harness { runtime, client, plan: dfc_plan::encode(&plan) }
    })
}

#[derive(Arbitrary, Debug)]
enum PlanBytes {
    /// The real plan.
    Real,
    /// The real plan with one payload byte changed, its checksum made right.
    Changed { at: u16, xor: u8 },
    /// Bytes that are no plan.
    Other(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct FuzzTensor {
    dtype: u8,
    dims: Vec<u8>,
    data: Vec<u8>,
}

#[derive(Arbitrary, Debug)]
enum Call {
    Register { plan: PlanBytes, rank: u8, workers: u8, partition_worker: Vec<u8>, interp: bool, seed: u64 },
    Prepare { program: u8, fetches: Vec<u8>, targets: Vec<u8>, stage: u8 },
    Run { program: u8, step: u8, feeds: Vec<(u8, Option<FuzzTensor>)>, trace: bool, turns: Option<(u8, u8)> },
    Push { step: u8, chunks: Vec<(u8, FuzzTensor, u64)> },
    Abort { step: u8 },
    GetVariables,
    Restore { variables: Vec<(u8, Option<FuzzTensor>)> },
    BenchAllReduce { id: Vec<u8>, rank: u8, workers: u8, bytes: u16, iterations: u8, hierarchical: bool },
}

const NAMES: [&str; 8] = ["x", "y", "w", "b", "loss", "prediction", "", "w/update"];

fn name(i: u8) -> String {
    NAMES[i as usize % NAMES.len()].to_string()
}

fn tensor(t: FuzzTensor) -> Tensor {
    Tensor { dtype: u32::from(t.dtype % 8), dims: t.dims.iter().map(|&d| u64::from(d)).collect(), data: t.data.into() }
}

fn named(items: Vec<(u8, Option<FuzzTensor>)>) -> Vec<NamedTensor> {
    items.into_iter().map(|(i, t)| NamedTensor { name: name(i), tensor: t.map(tensor) }).collect()
}

fn plan_bytes(real: &[u8], plan: PlanBytes) -> Vec<u8> {
    match plan {
        PlanBytes::Real => real.to_vec(),
        PlanBytes::Changed { at, xor } => {
            let mut bytes = real.to_vec();
            let header = dfc_plan::HEADER_LEN;
            let at = header + at as usize % (bytes.len() - header);
            bytes[at] ^= xor;
            let checksum = crc32fast::hash(&bytes[header..]);
            bytes[20..24].copy_from_slice(&checksum.to_le_bytes());
            bytes
        }
        PlanBytes::Other(bytes) => bytes,
    }
}

fuzz_target!(|data: &[u8]| {
    let harness = harness();
    let Ok(calls) = Vec::<Call>::arbitrary_take_rest(Unstructured::new(data)) else { return };
    let mut client = harness.client.clone();
    harness.runtime.block_on(async {
        let mut registered = dfc_rpc::plan_sha256(&harness.plan);
        for call in calls.into_iter().take(16) {
            match call {
                Call::Register { plan, rank, workers, partition_worker, interp, seed } => {
                    let bytes = plan_bytes(&harness.plan, plan);
                    let workers: Vec<String> =
                        (0..workers % 3 + 1).map(|i| format!("127.0.0.1:{}", i + 1)).collect();
                    registered = dfc_rpc::plan_sha256(&bytes);
                    let request = RegisterRequest {
                        plan_sha256: registered.clone(),
                        plan: bytes.into(),
                        rank: u32::from(rank % 4),
                        names: workers.iter().map(|_| "/job:localhost/task:0".to_string()).collect(),
                        workers,
                        partition_worker: partition_worker.iter().map(|&w| u32::from(w % 3)).collect(),
                        seed,
                        backend: if interp { "interp" } else { "llvm" }.into(),
                        wait_ms: 50,
                        data_ports: vec![],
                        all_reduce: if seed % 2 == 0 { "ring" } else { "hierarchical" }.into(),
                    };
                    let _ = client.register(request).await;
                }
                Call::Prepare { program, fetches, targets, stage } => {
                    let request = PrepareRequest {
                        plan_sha256: registered.clone(),
                        program: u64::from(program % 4),
                        fetches: fetches.into_iter().take(4).map(name).collect(),
                        targets: targets.into_iter().take(4).map(name).collect(),
                        stage: u32::from(stage % 4),
                    };
                    let _ = client.prepare(request).await;
                }
                Call::Run { program, step, feeds, trace, turns } => {
                    let (turn, after_turn) = turns.map_or((0, 0), |(t, a)| (u64::from(t % 8), u64::from(a % 8)));
                    let request = RunRequest {
                        plan_sha256: registered.clone(),
                        program: u64::from(program % 4),
                        step: u64::from(step),
                        feeds: named(feeds),
                        trace,
                        turn,
                        after_turn,
                    };
                    let _ = client.run(request).await;
                }
                Call::Push { step, chunks } => {
                    let chunks: Vec<TensorChunk> = chunks
                        .into_iter()
                        .take(8)
                        .map(|(key, t, offset)| {
                            let t = tensor(t);
                            TensorChunk {
                                plan_sha256: registered.clone(),
                                step: u64::from(step),
                                key: name(key),
                                dtype: t.dtype,
                                dims: t.dims,
                                offset,
                                data: t.data,
                            }
                        })
                        .collect();
                    let _ = client.push(tokio_stream::iter(chunks)).await;
                }
                Call::Abort { step } => {
                    let request =
                        AbortRequest { plan_sha256: registered.clone(), step: u64::from(step), reason: "fuzz".into() };
                    let _ = client.abort(request).await;
                }
                Call::GetVariables => {
                    let _ = client.get_variables(VariablesRequest { plan_sha256: registered.clone() }).await;
                }
                Call::Restore { variables } => {
                    let request = RestoreRequest { plan_sha256: registered.clone(), variables: named(variables) };
                    let _ = client.restore(request).await;
                }
                Call::BenchAllReduce { id, rank, workers, bytes, iterations, hierarchical } => {
                    let workers: Vec<String> = (0..workers % 3 + 1).map(|i| format!("127.0.0.{}:1", i + 1)).collect();
                    let request = BenchAllReduceRequest {
                        id: id.into_iter().take(32).collect::<Vec<u8>>().into(),
                        rank: u32::from(rank % 4),
                        names: workers.iter().enumerate().map(|(i, _)| format!("/job:worker/task:{i}")).collect(),
                        workers,
                        bytes: u64::from(bytes),
                        iterations: u32::from(iterations % 4),
                        wait_ms: 50,
                        data_ports: vec![],
                        tcp_only: false,
                        all_reduce: if hierarchical { "hierarchical" } else { "ring" }.into(),
                    };
                    let _ = client.bench_all_reduce(request).await;
                }
            }
        }
        client.health(HealthRequest {}).await.expect("the worker still answers");
    });
});
