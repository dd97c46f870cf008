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
    let run = RunRequest {
        plan_sha256: hash.clone(),
        program: 0,
        step: 0,
        feeds: vec![],
        trace: false,
        ..Default::default()
    };
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

/// The registration of examples/linear_regression.df's plan for one worker (interpreted,
/// waiting `wait_ms` for tensors), and the plan.
fn linear_regression(wait_ms: u64) -> (dfc_plan::Plan, RegisterRequest) {
    let source =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/linear_regression.df")).unwrap();
    let plan =
        dfc_compile::compile(&source, "linear_regression.df", &dfc_compile::CompileOptions::default()).unwrap().plan;
    let bytes = dfc_plan::encode(&plan);
    let register = RegisterRequest {
        plan_sha256: dfc_rpc::plan_sha256(&bytes),
        plan: bytes.into(),
        rank: 0,
        workers: vec!["127.0.0.1:1".into()],
        names: vec!["/job:localhost/task:0".into()],
        partition_worker: vec![0; plan.partitions.len()],
        seed: 0,
        backend: "interp".into(),
        wait_ms,
        data_ports: vec![],
        all_reduce: String::new(),
    };
    (plan, register)
}

#[tokio::test]
async fn a_registered_plan_runs_and_malformed_feeds_are_errors() {
    let mut client = worker(TOKEN).await;
    let (plan, register) = linear_regression(1000);
    let hash = register.plan_sha256.clone();
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
        ..Default::default()
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

/// Runs that take turns (a free-running replica's Runs on a server of several) start in their
/// turns' order, whatever order they arrive in; one whose turn never comes fails once no Run
/// has ended for the registration's wait, naming the turn; a turn that does not come after
/// the one it names is refused.
#[tokio::test]
async fn runs_take_their_turns() {
    let mut client = worker(TOKEN).await;
    let (_, register) = linear_regression(300);
    let hash = register.plan_sha256.clone();
    assert_eq!(code(client.register(register).await), Code::Ok);
    // A program that needs no feeds: it reads `b`.
    let prepare =
        PrepareRequest { plan_sha256: hash.clone(), program: 1, fetches: vec!["b".into()], targets: vec![], stage: 0 };
    assert!(client.prepare(prepare).await.unwrap().into_inner().takes_part);
    let run = |step: u64, turn: u64, after_turn: u64| RunRequest {
        plan_sha256: hash.clone(),
        program: 1,
        step,
        turn,
        after_turn,
        ..Default::default()
    };
    // Turn 2 arrives first and waits for turn 1.
    let mut second = client.clone();
    let mut waiting = tokio::spawn({
        let request = run(2, 2, 1);
        async move { second.run(request).await }
    });
    let early = tokio::time::timeout(std::time::Duration::from_millis(150), &mut waiting).await;
    assert!(early.is_err(), "turn 2 ran before turn 1: {early:?}");
    assert_eq!(code(client.run(run(1, 1, 0)).await), Code::Ok);
    let later = tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await;
    assert_eq!(code(later.expect("turn 2 runs once turn 1 has").unwrap()), Code::Ok);
    // Turn 4 never comes: turn 5 gives up after the wait (300 ms) without a Run ending.
    let started = std::time::Instant::now();
    let status = client.run(run(5, 5, 4)).await.unwrap_err();
    assert_eq!(status.code(), Code::Aborted);
    assert!(
        status.message().contains(
            "waited 0.3s for its turn, after turn 4, but no Run ended here meanwhile (the last to end was turn 2)"
        ),
        "{}",
        status.message()
    );
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    // A turn that does not come after the one it names.
    assert_eq!(code(client.run(run(6, 3, 3)).await), Code::InvalidArgument);
    assert_eq!(code(client.run(run(6, 3, 0)).await), Code::Ok, "an old turn that waits for none runs");
    assert_eq!(code(client.health(HealthRequest {}).await), Code::Ok);
}
