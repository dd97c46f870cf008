//! A cluster of parameter-server tasks for tests that compile for one.

use dfc_ir::Cluster;

/// `workers` worker tasks and two parameter-server tasks, on loopback addresses.
pub fn ps_cluster(workers: usize) -> Cluster {
    let workers: Vec<String> = (0..workers).map(|i| format!("\"localhost:{}\"", 3000 + i)).collect();
    Cluster::from_json(&format!(
        "{{\"cluster\": {{\"worker\": [{}], \"ps\": [\"localhost:2000\", \"localhost:2001\"]}}}}",
        workers.join(", ")
    ))
    .expect("a valid cluster")
}
