//! The machines a plan runs on, in TensorFlow's terms: jobs of tasks, each task with devices.
//!
//! Two ways to describe one: `--devices N` (N CPU devices in one task of job `localhost`) and
//! a TF_CONFIG-shaped JSON file:
//!
//! ```json
//! {"cluster": {"chief": ["host0:2222"],
//!              "worker": ["host1:2222", {"address": "host2:2222", "devices": ["cpu:0", "gpu:0"]}],
//!              "ps": ["host3:2222"]}}
//! ```
//!
//! A task is an address, or an object with its address, its devices (default `["cpu:0"]`)
//! and the machine profile of its host (`"profile": "gpu-box.json"`, made there by
//! `dfc calibrate -o FILE`; [`task_profiles`] lists them, for the cost model). Every device of
//! a cluster is fully specified: `/job:worker/task:1/gpu:0`.

use crate::device::{DeviceKind, DeviceSpec};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Cluster {
    pub jobs: Vec<Job>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub name: String,
    pub tasks: Vec<Task>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Task {
    /// Where the task's worker listens (`host:port`); `None` for the embedded local job.
    pub address: Option<String>,
    pub devices: Vec<DeviceSpec>,
}

/// Jobs in this order first (TensorFlow's roles), then any other in name order.
const JOB_ORDER: [&str; 4] = ["chief", "master", "worker", "ps"];

/// The host part of a task's address (`host:port`), without an IPv6 address's brackets.
pub fn address_host(address: &str) -> &str {
    address.rsplit_once(':').map_or(address, |(host, _)| host).trim_matches(['[', ']'])
}

impl Cluster {
    /// `n` devices of one kind in task 0 of job `localhost`: what `--devices N` means.
    pub fn local(n: usize, kind: DeviceKind) -> Cluster {
        let devices = (0..n as u32).map(|i| device("localhost", 0, kind, i)).collect();
        Cluster { jobs: vec![Job { name: "localhost".into(), tasks: vec![Task { address: None, devices }] }] }
    }

    /// Parses TF_CONFIG's JSON shape (only its `cluster` member is read). The error says what
    /// is wrong and where.
    pub fn from_json(text: &str) -> Result<Cluster, String> {
        let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
        let Some(jobs) = value.get("cluster").and_then(|c| c.as_object()) else {
            return Err("expected an object with a \"cluster\" member, as in TF_CONFIG: \
                        {\"cluster\": {\"worker\": [\"host:port\", ...], \"ps\": [...]}}"
                .into());
        };
        let mut names: Vec<&String> = jobs.keys().collect();
        names.sort_by_key(|n| (JOB_ORDER.iter().position(|j| j == n).unwrap_or(JOB_ORDER.len()), n.to_string()));
        let mut cluster = Cluster::default();
        for name in names {
            if !valid_job_name(name) {
                return Err(format!("`{name}` is not a job name (letters, digits, `_` and `-`)"));
            }
            let Some(entries) = jobs[name].as_array() else {
                return Err(format!("job `{name}`: expected a list of tasks"));
            };
            if entries.is_empty() {
                return Err(format!("job `{name}` has no tasks"));
            }
            let mut tasks = Vec::new();
            for (t, entry) in entries.iter().enumerate() {
                tasks.push(task(name, t as u32, entry)?);
            }
            cluster.jobs.push(Job { name: name.clone(), tasks });
        }
        if cluster.jobs.is_empty() {
            return Err("the cluster has no jobs".into());
        }
        Ok(cluster)
    }

    /// Every device, job by job and task by task: the order device indices refer to.
    pub fn devices(&self) -> Vec<&DeviceSpec> {
        self.jobs.iter().flat_map(|j| &j.tasks).flat_map(|t| &t.devices).collect()
    }

    pub fn job(&self, name: &str) -> Option<&Job> {
        self.jobs.iter().find(|j| j.name == name)
    }

    /// The indices (in `devices()` order) of the devices that `spec` allows.
    pub fn matching(&self, spec: &DeviceSpec) -> Vec<usize> {
        self.devices().iter().enumerate().filter(|(_, d)| spec.allows(d)).map(|(i, _)| i).collect()
    }

    /// Why no device of the cluster fits `spec`, naming the part that does not exist.
    pub fn explain_mismatch(&self, spec: &DeviceSpec) -> String {
        let jobs: Vec<String> = self.jobs.iter().map(|j| format!("`{}`", j.name)).collect();
        let Some(job_name) = &spec.job else {
            return format!("no device of the cluster is a {}", describe_device(spec));
        };
        let Some(job) = self.job(job_name) else {
            return format!("the cluster has no job `{job_name}`; its jobs are {}", jobs.join(", "));
        };
        if let Some(task) = spec.task {
            if task as usize >= job.tasks.len() {
                return format!("job `{job_name}` has {} task(s), so there is no task {task}", job.tasks.len());
            }
        }
        format!("no task of job `{job_name}` has a {}", describe_device(spec))
    }
}

/// The machine profiles that a cluster file (as [`Cluster::from_json`] reads it, which checks
/// them) gives its tasks: `(job, task index, path as written)`, in the file's job order.
pub fn task_profiles(text: &str) -> Result<Vec<(String, u32, String)>, String> {
    let cluster = Cluster::from_json(text)?;
    let value: serde_json::Value = serde_json::from_str(text).map_err(|e| format!("not valid JSON: {e}"))?;
    let mut profiles = Vec::new();
    for job in &cluster.jobs {
        let entries = value["cluster"][&job.name].as_array().map(Vec::as_slice).unwrap_or_default();
        for (t, entry) in entries.iter().enumerate() {
            if let Some(path) = entry.get("profile").and_then(|p| p.as_str()) {
                profiles.push((job.name.clone(), t as u32, path.to_string()));
            }
        }
    }
    Ok(profiles)
}

fn describe_device(spec: &DeviceSpec) -> String {
    let kind = match spec.kind {
        Some(DeviceKind::Gpu) => "gpu",
        Some(DeviceKind::Cpu) => "cpu",
        None => "device",
    };
    match spec.index {
        Some(i) => format!("{kind}:{i}"),
        None => kind.to_string(),
    }
}

fn device(job: &str, task: u32, kind: DeviceKind, index: u32) -> DeviceSpec {
    DeviceSpec { job: Some(job.into()), replica: None, task: Some(task), kind: Some(kind), index: Some(index) }
}

fn valid_job_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn task(job: &str, index: u32, entry: &serde_json::Value) -> Result<Task, String> {
    let at = || format!("job `{job}`, task {index}");
    let (address, devices) = match entry {
        serde_json::Value::String(address) => (address.clone(), vec![DeviceSpec::parse("cpu:0").expect("valid")]),
        serde_json::Value::Object(fields) => {
            if let Some(unknown) = fields.keys().find(|k| !["address", "devices", "profile"].contains(&k.as_str())) {
                return Err(format!(
                    "{}: unknown field `{unknown}`; a task has `address`, `devices` and `profile`",
                    at()
                ));
            }
            match fields.get("profile") {
                None => {}
                Some(serde_json::Value::String(path)) if !path.is_empty() => {}
                Some(_) => return Err(format!("{}: \"profile\" is the path of a machine profile (a string)", at())),
            }
            let address = fields
                .get("address")
                .and_then(|a| a.as_str())
                .ok_or_else(|| format!("{}: expected \"address\": \"host:port\"", at()))?
                .to_string();
            let devices = match fields.get("devices") {
                None => vec![DeviceSpec::parse("cpu:0").expect("valid")],
                Some(serde_json::Value::Array(list)) if !list.is_empty() => {
                    let mut devices = Vec::new();
                    for d in list {
                        let text =
                            d.as_str().ok_or_else(|| format!("{}: a device is a string such as \"gpu:0\"", at()))?;
                        let spec = DeviceSpec::parse(text).map_err(|e| format!("{}: device `{text}`: {e}", at()))?;
                        if spec.job.is_some() || spec.task.is_some() || spec.kind.is_none() {
                            return Err(format!(
                                "{}: a task's device is written `cpu:N` or `gpu:N`, not `{text}`",
                                at()
                            ));
                        }
                        devices.push(spec);
                    }
                    devices
                }
                Some(_) => {
                    return Err(format!("{}: \"devices\" is a non-empty list such as [\"cpu:0\", \"gpu:0\"]", at()))
                }
            };
            (address, devices)
        }
        _ => return Err(format!("{}: expected \"host:port\" or {{\"address\": ..., \"devices\": [...]}}", at())),
    };
    let mut full = Vec::new();
    for d in devices {
        let spec = device(job, index, d.kind.expect("checked"), d.index.unwrap_or(0));
        if full.contains(&spec) {
            return Err(format!("{}: device {spec} is listed twice", at()));
        }
        full.push(spec);
    }
    Ok(Task { address: Some(address), devices: full })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_devices_are_fully_specified() {
        let c = Cluster::local(2, DeviceKind::Cpu);
        let names: Vec<String> = c.devices().iter().map(|d| d.to_string()).collect();
        assert_eq!(names, ["/job:localhost/task:0/cpu:0", "/job:localhost/task:0/cpu:1"]);
    }

    #[test]
    fn tf_config_jobs_come_in_role_order_with_their_devices() {
        let c = Cluster::from_json(
            r#"{"cluster": {"ps": ["a:1", "b:1"], "worker": [{"address": "c:1", "devices": ["cpu:0", "gpu:0"]}]},
                "task": {"type": "worker", "index": 0}}"#,
        )
        .unwrap();
        let names: Vec<String> = c.devices().iter().map(|d| d.to_string()).collect();
        assert_eq!(
            names,
            ["/job:worker/task:0/cpu:0", "/job:worker/task:0/gpu:0", "/job:ps/task:0/cpu:0", "/job:ps/task:1/cpu:0"]
        );
        assert_eq!(c.matching(&DeviceSpec::parse("/job:ps").unwrap()), [2, 3]);
        assert_eq!(c.matching(&DeviceSpec::parse("gpu:0").unwrap()), [1]);
    }

    #[test]
    fn tasks_may_name_their_hosts_profiles() {
        let text = r#"{"cluster": {"ps": [{"address": "a:1", "profile": "ps.json"}],
                                  "worker": ["b:1", {"address": "c:1", "profile": "gpu box.json"}]}}"#;
        let profiles = task_profiles(text).unwrap();
        assert_eq!(profiles, [("worker".into(), 1, "gpu box.json".into()), ("ps".into(), 0, "ps.json".into())]);
        let refused = |text: &str| Cluster::from_json(text).unwrap_err();
        assert!(refused(r#"{"cluster": {"worker": [{"address": "b:1", "profile": 3}]}}"#)
            .contains("job `worker`, task 0: \"profile\" is the path of a machine profile"));
        assert!(refused(r#"{"cluster": {"worker": [{"address": "b:1", "profile": ""}]}}"#).contains("\"profile\""));
        assert!(refused(r#"{"cluster": {"worker": [{"address": "b:1", "profiles": "x"}]}}"#)
            .contains("unknown field `profiles`"));
    }

    #[test]
    fn mismatches_name_the_missing_part() {
        let c = Cluster::from_json(r#"{"cluster": {"worker": ["a:1", "b:1"]}}"#).unwrap();
        assert!(c.explain_mismatch(&DeviceSpec::parse("/job:ps").unwrap()).contains("no job `ps`"));
        assert!(c.explain_mismatch(&DeviceSpec::parse("/job:worker/task:2").unwrap()).contains("no task 2"));
        assert!(c.explain_mismatch(&DeviceSpec::parse("/job:worker/gpu:0").unwrap()).contains("gpu:0"));
    }

    #[test]
    fn malformed_files_say_what_is_wrong() {
        assert!(Cluster::from_json("{").unwrap_err().contains("JSON"));
        assert!(Cluster::from_json(r#"{"worker": []}"#).unwrap_err().contains("\"cluster\""));
        assert!(Cluster::from_json(r#"{"cluster": {"worker": []}}"#).unwrap_err().contains("no tasks"));
        assert!(Cluster::from_json(r#"{"cluster": {"worker": [{"address": "a", "devices": ["tpu:0"]}]}}"#)
            .unwrap_err()
            .contains("tpu"));
    }
}
