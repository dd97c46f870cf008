//! Which worker process runs each partition of a plan: what `dfc run --cluster/--spawn` does,
//! what `dfc compile --spawn N` predicts the plan's step for, and what the placement search
//! prices its moves for.

use crate::{Cluster, DeviceSpec};

/// Which worker runs each partition, and the workers' task names.
#[derive(Clone, Debug, PartialEq)]
pub struct Assignment {
    /// The worker (rank) of each partition.
    pub partition_worker: Vec<usize>,
    /// Each worker's name for messages: its job and task (`/job:worker/task:1`). As many as
    /// there are workers: fewer than asked for where a plan of one task has fewer partitions.
    pub names: Vec<String>,
}

/// Spreads the partitions on `devices` (of `cluster`) over `workers` workers: one worker per
/// task of the cluster when it has that many tasks (a task without partitions, such as a
/// parameter server that holds no variable, gets an idle worker), or per task that has
/// partitions; when they are all of one task, its partitions in contiguous groups, one group
/// per worker (and one per partition where there are fewer partitions than workers: a worker
/// without a partition would only share the cores).
pub fn assign_workers(devices: &[&DeviceSpec], cluster: &Cluster, workers: usize) -> Result<Assignment, String> {
    let task_of = |d: &DeviceSpec| (d.job.clone().unwrap_or_default(), d.task.unwrap_or(0));
    let mut tasks: Vec<(String, u32)> = devices.iter().map(|d| task_of(d)).collect();
    tasks.sort();
    tasks.dedup();
    // Tasks in the cluster's order (chief, worker, ps, ...), then task index.
    let job_rank = |job: &str| cluster.jobs.iter().position(|j| j.name == job).unwrap_or(usize::MAX);
    tasks.sort_by_key(|(job, task)| (job_rank(job), *task));
    if workers == 0 {
        return Err("a distributed run needs at least one worker".into());
    }
    let cluster_tasks: Vec<(String, u32)> = cluster
        .jobs
        .iter()
        .flat_map(|job| (0..job.tasks.len()).map(|t| (job.name.clone(), u32::try_from(t).unwrap_or(u32::MAX))))
        .collect();
    if cluster_tasks.len() == workers && tasks.iter().all(|t| cluster_tasks.contains(t)) {
        tasks = cluster_tasks;
    }
    if tasks.len() == workers {
        let partition_worker = devices
            .iter()
            .map(|d| tasks.iter().position(|t| *t == task_of(d)).expect("every task is listed"))
            .collect();
        let names = tasks.iter().map(|(job, task)| format!("/job:{job}/task:{task}")).collect();
        return Ok(Assignment { partition_worker, names });
    }
    if tasks.len() == 1 && !devices.is_empty() {
        let n = devices.len();
        let workers = workers.min(n);
        let partition_worker = (0..n).map(|p| p * workers / n).collect();
        let names = (0..workers).map(|w| format!("worker {w} (of {n} devices of one task)")).collect();
        return Ok(Assignment { partition_worker, names });
    }
    let all_tasks = cluster.jobs.iter().map(|j| j.tasks.len()).sum::<usize>();
    Err(format!(
        "the plan was compiled for {all_tasks} task(s), {} of them with partitions ({} in all); it cannot be spread over {workers} worker(s): compile it for a cluster of {workers} tasks, or with --devices {workers} or more",
        tasks.len(),
        devices.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DeviceKind;

    fn one_task(n: usize) -> (Vec<DeviceSpec>, Cluster) {
        let cluster = Cluster::local(n, DeviceKind::Cpu);
        (cluster.devices().into_iter().cloned().collect(), cluster)
    }

    #[test]
    fn a_task_s_partitions_go_to_the_workers_in_contiguous_groups() {
        let (devices, cluster) = one_task(4);
        let devices: Vec<&DeviceSpec> = devices.iter().collect();
        let assignment = assign_workers(&devices, &cluster, 2).unwrap();
        assert_eq!(assignment.partition_worker, [0, 0, 1, 1]);
        assert_eq!(assignment.names.len(), 2);
    }

    #[test]
    fn fewer_partitions_than_workers_take_a_worker_each() {
        let (devices, cluster) = one_task(4);
        let devices: Vec<&DeviceSpec> = devices.iter().take(1).collect();
        let assignment = assign_workers(&devices, &cluster, 3).unwrap();
        assert_eq!(assignment.partition_worker, [0]);
        assert_eq!(assignment.names, ["worker 0 (of 1 devices of one task)"]);
    }

    #[test]
    fn no_workers_is_refused() {
        let (devices, cluster) = one_task(1);
        let devices: Vec<&DeviceSpec> = devices.iter().collect();
        assert!(assign_workers(&devices, &cluster, 0).unwrap_err().contains("at least one worker"));
    }
}
