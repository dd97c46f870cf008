//! The metrics log: one JSON object per epoch, one per line (JSON Lines), flushed as written
//! so that `tail -f` and a crash both see every finished epoch.
//!
//! A line looks like
//!
//! ```text
//! {"epoch":1,"step":468,"train_loss":0.52,"eval_loss":0.41,"eval_accuracy":0.85,"eval_top5":0.99,"examples_per_sec":10432.1,"seconds":5.75}
//! ```
//!
//! Keys: `epoch`, `step`, `train_loss`, `eval_loss` and `eval_accuracy` (only when evaluated),
//! each extra metric as `eval_<name>`, then `examples_per_sec` and `seconds`; where the plan's
//! training all-reduces, `all_reduces`: the all-reduces the epoch's training ran (groups of
//! the replicas' all-reduces of one key, a fused bucket counting once, local SGD's averages
//! included; not its evaluation's); for staleness-aware asynchronous replicas on workers,
//! `staleness_mean` and `staleness_max` of the epoch's updates; on workers, then
//! `workers`: per worker, its training steps, the seconds it spent running them and the part of
//! those it spent exchanging tensors with other workers
//! (`[{"exchange_seconds":0.9,"name":"/job:worker/task:0","run_seconds":2.1,"steps":468}, …]`). A non-finite
//! number (a diverged loss) is written as `null`, since JSON has no NaN.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{self, BufWriter, Write};
use std::path::Path;

use serde_json::Value;

/// What one epoch did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EpochRecord {
    pub epoch: u64,
    /// The global step (batches trained so far) at the end of the epoch.
    pub step: u64,
    /// The mean training loss over the epoch's batches.
    pub train_loss: f64,
    /// The learning rate of the epoch's last step (a schedule's, or the constant one).
    pub learning_rate: Option<f64>,
    pub eval_loss: Option<f64>,
    pub eval_accuracy: Option<f64>,
    pub examples_per_sec: f64,
    /// Wall-clock seconds the epoch took.
    pub seconds: f64,
    /// Other evaluation metrics, written as `eval_<name>`.
    pub metrics: BTreeMap<String, f64>,
    /// All-reduces run by the epoch's training steps and averages (0: none, not written).
    pub all_reduces: u64,
    /// Staleness-aware asynchronous replicas: the mean and the largest staleness τ of the
    /// epoch's updates.
    pub staleness: Option<(f64, f64)>,
    /// Backup workers: the updates the epoch applied and the replicas' gradients it dropped.
    pub backup: Option<BackupCounts>,
    /// Per worker of a distributed run (empty otherwise): what its training steps took.
    pub workers: Vec<WorkerMetrics>,
}

/// What one worker's training steps of an epoch took.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize)]
pub struct WorkerMetrics {
    /// The worker's task name.
    pub name: String,
    pub steps: u64,
    /// Seconds in its runs of the steps.
    pub run_seconds: f64,
    /// Of those, seconds its partitions spent in exchanges with other workers: sending, waiting
    /// for a Recv, all-reduces (summed over its partitions when it runs several).
    pub exchange_seconds: f64,
}

/// What the backup workers' updates did in an epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct BackupCounts {
    /// Updates applied (each of the first N fresh gradients).
    pub updates: u64,
    /// Gradients dropped: computed from variables that an update had changed since.
    pub dropped: u64,
}

fn number(x: f64) -> Value {
    serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number)
}

impl EpochRecord {
    /// The record's keys and values, in the order they are written. An extra metric whose key
    /// (`eval_<name>`) would repeat another key is an `InvalidInput` error.
    pub fn fields(&self) -> io::Result<Vec<(String, Value)>> {
        let mut fields: Vec<(String, Value)> = vec![
            ("epoch".into(), self.epoch.into()),
            ("step".into(), self.step.into()),
            ("train_loss".into(), number(self.train_loss)),
            ("learning_rate".into(), self.learning_rate.map_or(Value::Null, number)),
        ];
        // Always present, null without evaluation data or an `accuracy` metric, so that every
        // line has the same keys.
        fields.push(("eval_loss".into(), self.eval_loss.map_or(Value::Null, number)));
        fields.push(("eval_accuracy".into(), self.eval_accuracy.map_or(Value::Null, number)));
        for (name, &value) in &self.metrics {
            let key = format!("eval_{name}");
            if matches!(key.as_str(), "eval_loss" | "eval_accuracy") {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("metric `{name}` would be written as `{key}`, which the record already has"),
                ));
            }
            fields.push((key, number(value)));
        }
        fields.push(("examples_per_sec".into(), number(self.examples_per_sec)));
        fields.push(("seconds".into(), number(self.seconds)));
        if self.all_reduces > 0 {
            fields.push(("all_reduces".into(), self.all_reduces.into()));
        }
        if let Some((mean, max)) = self.staleness {
            fields.push(("staleness_mean".into(), number(mean)));
            fields.push(("staleness_max".into(), number(max)));
        }
        if let Some(backup) = self.backup {
            fields.push(("updates".into(), backup.updates.into()));
            fields.push(("updates_per_sec".into(), number(backup.updates as f64 / self.seconds.max(1e-9))));
            fields.push(("gradients_dropped".into(), backup.dropped.into()));
        }
        if !self.workers.is_empty() {
            let workers = serde_json::to_value(&self.workers).map_err(io::Error::other)?;
            fields.push(("workers".into(), workers));
        }
        Ok(fields)
    }

    /// Its numbers (not the epoch and step, not the workers'), by key, for TensorBoard; keys
    /// without a value (no evaluation) left out.
    pub fn scalars(&self) -> Vec<(String, f64)> {
        let fields = self.fields().unwrap_or_default();
        fields
            .into_iter()
            .filter(|(key, _)| !matches!(key.as_str(), "epoch" | "step" | "workers"))
            .filter_map(|(key, value)| Some((key, value.as_f64()?)))
            .collect()
    }

    /// The record as one line of JSON (without the newline), keys in the documented order.
    pub fn to_json_line(&self) -> io::Result<String> {
        let mut line = String::from("{");
        for (i, (key, value)) in self.fields()?.iter().enumerate() {
            if i > 0 {
                line.push(',');
            }
            line.push_str(&Value::String(key.clone()).to_string());
            line.push(':');
            line.push_str(&value.to_string());
        }
        line.push('}');
        Ok(line)
    }
}

/// A JSON-lines file of [`EpochRecord`]s.
#[derive(Debug)]
pub struct MetricsLog {
    out: BufWriter<File>,
}

impl MetricsLog {
    /// Creates (or truncates) the log at `path`, creating its directory if needed.
    pub fn create(path: impl AsRef<Path>) -> io::Result<MetricsLog> {
        Self::open(path.as_ref(), OpenOptions::new().write(true).create(true).truncate(true))
    }

    /// Opens the log at `path` to add lines after those it has (for a resumed run).
    pub fn append(path: impl AsRef<Path>) -> io::Result<MetricsLog> {
        Self::open(path.as_ref(), OpenOptions::new().append(true).create(true))
    }

    fn open(path: &Path, options: &OpenOptions) -> io::Result<MetricsLog> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        Ok(MetricsLog { out: BufWriter::new(options.open(path)?) })
    }

    /// Writes `record` as one line and flushes it.
    pub fn write(&mut self, record: &EpochRecord) -> io::Result<()> {
        let mut line = record.to_json_line()?;
        line.push('\n');
        self.out.write_all(line.as_bytes())?;
        self.out.flush()
    }
}
