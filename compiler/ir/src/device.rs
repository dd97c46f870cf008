//! Device specifications in TensorFlow's form: `/job:ps/task:0/device:CPU:0`, with the short
//! forms `/job:worker/task:1/gpu:0`, `gpu:1`, `cpu`. Any part may be left out; placement fills
//! in what the source leaves open.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum DeviceKind {
    Cpu,
    Gpu,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DeviceSpec {
    pub job: Option<String>,
    pub replica: Option<u32>,
    pub task: Option<u32>,
    pub kind: Option<DeviceKind>,
    pub index: Option<u32>,
}

impl DeviceSpec {
    /// Parses a device string. The error says which part is wrong.
    pub fn parse(text: &str) -> Result<DeviceSpec, String> {
        let mut spec = DeviceSpec::default();
        let text = text.trim();
        if text.is_empty() {
            return Err("the device string is empty".into());
        }
        let parts: Vec<&str> = text.trim_start_matches('/').split('/').collect();
        for part in parts {
            let mut fields = part.split(':');
            let key = fields.next().unwrap_or("").to_ascii_lowercase();
            let rest: Vec<&str> = fields.collect();
            match (key.as_str(), rest.as_slice()) {
                ("job", [name]) if is_name(name) => set(&mut spec.job, name.to_string(), "job")?,
                ("replica", [n]) => set(&mut spec.replica, number(n, "replica")?, "replica")?,
                ("task", [n]) => set(&mut spec.task, number(n, "task")?, "task")?,
                ("device", [kind, n]) => {
                    set(&mut spec.kind, kind_of(kind)?, "device")?;
                    set(&mut spec.index, number(n, "device index")?, "device index")?;
                }
                ("device", [kind]) => set(&mut spec.kind, kind_of(kind)?, "device")?,
                ("cpu" | "gpu", [n]) => {
                    set(&mut spec.kind, kind_of(&key)?, "device")?;
                    set(&mut spec.index, number(n, "device index")?, "device index")?;
                }
                ("cpu" | "gpu", []) => set(&mut spec.kind, kind_of(&key)?, "device")?,
                ("job", _) => return Err(format!("`{part}` is not a job name such as `job:ps`")),
                _ => {
                    return Err(format!(
                        "`{part}` is not a device part; expected job:NAME, replica:N, task:N, \
                         device:CPU:N, cpu:N or gpu:N"
                    ))
                }
            }
        }
        Ok(spec)
    }

    pub fn is_empty(&self) -> bool {
        *self == DeviceSpec::default()
    }

    /// Whether the (fully specified) device `device` satisfies this possibly partial spec:
    /// every part given here is the same there. A replica other than 0 is never a cluster
    /// device's.
    pub fn allows(&self, device: &DeviceSpec) -> bool {
        fn fits<T: PartialEq>(want: &Option<T>, have: &Option<T>) -> bool {
            want.is_none() || want == have
        }
        fits(&self.job, &device.job)
            && self.replica.unwrap_or(0) == device.replica.unwrap_or(0)
            && fits(&self.task, &device.task)
            && fits(&self.kind, &device.kind)
            && fits(&self.index, &device.index)
    }

    /// Two partial specs that some device could satisfy together, merged; `None` if they
    /// contradict each other.
    pub fn merge(&self, other: &DeviceSpec) -> Option<DeviceSpec> {
        fn pick<T: PartialEq + Clone>(a: &Option<T>, b: &Option<T>) -> Result<Option<T>, ()> {
            match (a, b) {
                (Some(x), Some(y)) if x != y => Err(()),
                (Some(x), _) | (None, Some(x)) => Ok(Some(x.clone())),
                (None, None) => Ok(None),
            }
        }
        Some(DeviceSpec {
            job: pick(&self.job, &other.job).ok()?,
            replica: pick(&self.replica, &other.replica).ok()?,
            task: pick(&self.task, &other.task).ok()?,
            kind: pick(&self.kind, &other.kind).ok()?,
            index: pick(&self.index, &other.index).ok()?,
        })
    }
}

fn is_name(name: &str) -> bool {
    !name.is_empty() && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

fn number(text: &str, what: &str) -> Result<u32, String> {
    text.parse().map_err(|_| format!("the {what} `{text}` is not a non-negative integer"))
}

impl std::str::FromStr for DeviceKind {
    type Err = String;

    /// `cpu` or `gpu`, in any case.
    fn from_str(text: &str) -> Result<DeviceKind, String> {
        kind_of(text)
    }
}

fn kind_of(text: &str) -> Result<DeviceKind, String> {
    match text.to_ascii_lowercase().as_str() {
        "cpu" => Ok(DeviceKind::Cpu),
        "gpu" => Ok(DeviceKind::Gpu),
        _ => Err(format!("`{text}` is not a device type; expected CPU or GPU")),
    }
}

fn set<T>(slot: &mut Option<T>, value: T, what: &str) -> Result<(), String> {
    if slot.is_some() {
        return Err(format!("the {what} is given twice"));
    }
    *slot = Some(value);
    Ok(())
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(job) = &self.job {
            write!(f, "/job:{job}")?;
        }
        if let Some(replica) = self.replica {
            write!(f, "/replica:{replica}")?;
        }
        if let Some(task) = self.task {
            write!(f, "/task:{task}")?;
        }
        if let Some(kind) = self.kind {
            let kind = match kind {
                DeviceKind::Cpu => "cpu",
                DeviceKind::Gpu => "gpu",
            };
            match self.index {
                Some(index) => write!(f, "/{kind}:{index}")?,
                None => write!(f, "/{kind}")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_and_short_forms_parse_to_the_same_spec() {
        let long = DeviceSpec::parse("/job:worker/replica:0/task:1/device:GPU:0").unwrap();
        assert_eq!(long.to_string(), "/job:worker/replica:0/task:1/gpu:0");
        let short = DeviceSpec::parse("gpu:1").unwrap();
        assert_eq!(short, DeviceSpec { kind: Some(DeviceKind::Gpu), index: Some(1), ..Default::default() });
        assert_eq!(DeviceSpec::parse("/job:ps/task:0").unwrap().to_string(), "/job:ps/task:0");
    }

    #[test]
    fn malformed_specs_say_what_is_wrong() {
        assert!(DeviceSpec::parse("/job:ps/task:x").unwrap_err().contains("task `x`"));
        assert!(DeviceSpec::parse("tpu:0").unwrap_err().contains("`tpu:0`"));
        assert!(DeviceSpec::parse("/task:0/task:1").unwrap_err().contains("twice"));
        assert!(DeviceSpec::parse("").is_err());
    }
}
