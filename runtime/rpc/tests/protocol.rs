//! The worker's answers to calls that are malformed, out of order or unauthenticated: always an
//! error status, never a crash (the server keeps answering after each).

use dfc_rpc::auth::AddToken;
use dfc_rpc::proto::worker_client::WorkerClient;
use dfc_rpc::proto::*;
use tonic::Code;

const TOKEN: &str = "protocol-test-token-0123456789";

/// A worker on a loopback port of this process, and a client holding `token`.
async fn worker(
    token: &str,
) -> WorkerClient<tonic::service::interceptor::InterceptedService<tonic::transport::Channel, AddToken>> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    tokio::spawn(dfc_rpc::serve(listener, TOKEN.to_string(), None, dfc_rpc::DataPlane::default()));
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{address}")).unwrap().connect_lazy();
    WorkerClient::with_interceptor(channel, AddToken::new(token))
}

fn code<T>(result: Result<tonic::Response<T>, tonic::Status>) -> Code {
    match result {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

#[tokio::test]
async fn malformed_and_out_of_order_calls_are_errors() {
    let mut client = worker(TOKEN).await;
    let hash = dfc_rpc::plan_sha256(b"no plan");
    // Before any registration.
    let prepare = PrepareRequest {
        plan_sha256: hash.clone(),
        program: 0,
        fetches: vec!["loss".into()],
        targets: vec![],
        stage: 0,
    };
    assert_eq!(code(client.prepare(prepare.clone()).await), Code::FailedPrecondition);
    let run = RunRequest { plan_sha256: hash.clone(), program: 0, step: 0, feeds: vec![], trace: false };
    assert_eq!(code(client.run(run).await), Code::FailedPrecondition);
    // A plan that is not one, with its right hash; a hash that does not match.
    let mut rng = 7u64;
    for len in [0usize, 1, 17, 1000] {
        let bytes: Vec<u8> = (0..len)
            .map(|_| {
                rng = rng.wrapping_mul(6364136223846793005).wrapping_add(1);
                (rng >> 56) as u8
            })
            .collect();
        let register = RegisterRequest {
            plan_sha256: dfc_rpc::plan_sha256(&bytes),
            plan: bytes.into(),
            rank: 0,
            workers: vec!["127.0.0.1:1".into()],
            names: vec!["w".into()],
            partition_worker: vec![],
            seed: 0,
            backend: "llvm".into(),
            wait_ms: 1000,
            data_ports: vec![],
            all_reduce: String::new(),
        };
        assert_eq!(code(client.register(register.clone()).await), Code::InvalidArgument);
        let mismatched = RegisterRequest { plan_sha256: hash.clone(), ..register };
        assert_eq!(code(client.register(mismatched).await), Code::InvalidArgument);
    }
    // A push whose chunks contradict each other, or name no registered plan.
    let chunk = TensorChunk {
        plan_sha256: hash.clone(),
        step: 0,
        key: "k".into(),
        dtype: 0,
        dims: vec![4],
        offset: 0,
        data: vec![0u8; 16].into(),
    };
    assert_eq!(code(client.push(tokio_stream::iter(vec![chunk.clone()])).await), Code::FailedPrecondition);
    assert_eq!(code(client.push(tokio_stream::iter(Vec::<TensorChunk>::new())).await), Code::InvalidArgument);
    // The server still answers.
    assert_eq!(code(client.health(HealthRequest {}).await), Code::Ok);
}

#[tokio::test]
async fn calls_without_the_token_are_refused() {
    let mut wrong = worker("not-the-token-but-long-enough").await;
    assert_eq!(code(wrong.health(HealthRequest {}).await), Code::Unauthenticated);
    assert_eq!(code(wrong.shutdown(ShutdownRequest {}).await), Code::Unauthenticated);
}

#[tokio::test]
async fn a_registered_plan_runs_and_malformed_feeds_are_errors() {
    let mut client = worker(TOKEN).await;
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/linear_regression.df")).unwrap();
    let plan =
        dfc_compile::compile(&source, "linear_regression.df", &dfc_compile::CompileOptions::default()).unwrap().plan;
    let bytes = dfc_plan::encode(&plan);
    let hash = dfc_rpc::plan_sha256(&bytes);
    let register = RegisterRequest {
        plan: bytes.into(),
        plan_sha256: hash.clone(),
        rank: 0,
        workers: vec!["127.0.0.1:1".into()],
        names: vec!["/job:localhost/task:0".into()],
        partition_worker: vec![0; plan.partitions.len()],
        seed: 0,
        backend: "interp".into(),
        wait_ms: 1000,
        data_ports: vec![],
        all_reduce: String::new(),
    };
    let unknown_algorithm = RegisterRequest { all_reduce: "tree".into(), ..register.clone() };
    assert_eq!(code(client.register(unknown_algorithm).await), Code::InvalidArgument);
    assert_eq!(code(client.register(register).await), Code::Ok);
    let loss = plan.training.as_ref().unwrap().loss_node.clone();
    let prepare =
        PrepareRequest { plan_sha256: hash.clone(), program: 1, fetches: vec![loss], targets: vec![], stage: 0 };
    let prepared = client.prepare(prepare).await.unwrap().into_inner();
    assert!(prepared.takes_part);
    assert_eq!(prepared.provides, vec![0]);
    // A program that was never prepared; a feed whose bytes do not fit its type; a missing feed.
    let run = |program: u64, feeds: Vec<NamedTensor>| RunRequest {
        plan_sha256: hash.clone(),
        program,
        step: 0,
        feeds,
        trace: false,
    };
    assert_eq!(code(client.run(run(9, vec![])).await), Code::FailedPrecondition);
    let bad = NamedTensor {
        name: "x".into(),
        tensor: Some(Tensor { dtype: 0, dims: vec![32, 13], data: vec![0u8; 5].into() }),
    };
    assert_eq!(code(client.run(run(1, vec![bad])).await), Code::InvalidArgument);
    let unknown_dtype =
        NamedTensor { name: "x".into(), tensor: Some(Tensor { dtype: 99, dims: vec![1], data: vec![0u8; 4].into() }) };
    assert_eq!(code(client.run(run(1, vec![unknown_dtype])).await), Code::InvalidArgument);
    assert_ne!(code(client.run(run(1, vec![])).await), Code::Ok, "a missing feed is an error");
    // Calls that name another plan.
    let other = PrepareRequest {
        plan_sha256: dfc_rpc::plan_sha256(b"other"),
        program: 2,
        fetches: vec![],
        targets: vec![],
        stage: 0,
    };
    assert_eq!(code(client.prepare(other).await), Code::FailedPrecondition);
    assert_eq!(code(client.health(HealthRequest {}).await), Code::Ok);
}
