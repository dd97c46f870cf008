//! What `dfc inspect` shows: a plan reduced to plain strings and numbers, for `--json` (serde)
//! and for people (`Display`).

use crate::{tensor_bytes, Plan, FORMAT_VERSION};
use dfc_ir::{Op, TensorType};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Summary {
    pub format_version: u32,
    pub dfc_version: String,
    pub source_name: String,
    /// Hex, because JSON readers lose precision on integers above 2^53.
    pub source_hash: String,
    pub model: String,
    pub dims: Vec<(String, usize)>,
    pub devices: Vec<DeviceSummary>,
    pub inputs: Vec<TensorSummary>,
    pub outputs: Vec<TensorSummary>,
    pub params: Vec<ParamSummary>,
    pub training: Option<TrainingSummary>,
    pub total_param_bytes: u64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceSummary {
    pub device: String,
    pub n_nodes: usize,
    pub n_variables: usize,
    pub variable_bytes: u64,
    /// Node count per op name (`matmul`, `read`, ...).
    pub ops: BTreeMap<String, usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TensorSummary {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ParamSummary {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    pub init: String,
    pub bytes: u64,
    pub trainable: bool,
    pub partitions: u32,
    pub requested_device: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TrainingSummary {
    pub loss: String,
    pub optimizer: String,
}

pub fn summary(plan: &Plan) -> Summary {
    let tensor = |name: &str, ty: &TensorType| TensorSummary {
        name: name.into(),
        dtype: ty.dtype.to_string(),
        shape: ty.shape.dims().to_vec(),
    };
    let devices = plan
        .partitions
        .iter()
        .map(|p| {
            let graph = &p.module.graph;
            let mut ops = BTreeMap::new();
            let (mut n_variables, mut variable_bytes) = (0, 0u64);
            for id in graph.node_ids() {
                let op = &graph.node(id).op;
                *ops.entry(op.name().to_string()).or_insert(0) += 1;
                if let Op::Variable { ty, .. } = op {
                    n_variables += 1;
                    variable_bytes = variable_bytes.saturating_add(tensor_bytes(ty));
                }
            }
            DeviceSummary { device: p.device.to_string(), n_nodes: graph.len(), n_variables, variable_bytes, ops }
        })
        .collect();
    let params: Vec<ParamSummary> = plan
        .params
        .iter()
        .map(|p| ParamSummary {
            name: p.name.clone(),
            dtype: p.ty.dtype.to_string(),
            shape: p.ty.shape.dims().to_vec(),
            init: p.init.to_string(),
            bytes: p.bytes,
            trainable: p.trainable,
            partitions: p.partitions,
            requested_device: p.requested_device.clone(),
        })
        .collect();
    Summary {
        format_version: FORMAT_VERSION,
        dfc_version: plan.dfc_version.clone(),
        source_name: plan.source_name.clone(),
        source_hash: format!("{:016x}", plan.source_hash),
        model: plan.model.clone(),
        dims: plan.dims.clone(),
        devices,
        inputs: plan.inputs.iter().map(|io| tensor(&io.name, &io.ty)).collect(),
        outputs: plan.outputs.iter().map(|io| tensor(&io.name, &io.ty)).collect(),
        total_param_bytes: params.iter().fold(0u64, |sum, p| sum.saturating_add(p.bytes)),
        params,
        training: plan
            .training
            .as_ref()
            .map(|t| TrainingSummary { loss: t.loss.clone(), optimizer: t.optimizer.to_string() }),
    }
}

/// `[4,3]`, as `dfc_ir::Shape` prints it.
fn shape(dims: &[usize]) -> String {
    dfc_ir::Shape(dims.to_vec()).to_string()
}

/// `512 B`, `1.5 KiB`, `3.0 MiB`: exact below a KiB, one decimal above.
fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Writes `rows` indented by two spaces, columns padded to their widest cell; columns marked
/// in `right` (numbers) are right-aligned. Trailing spaces are trimmed.
fn table(f: &mut fmt::Formatter<'_>, rows: &[Vec<String>], right: &[bool]) -> fmt::Result {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| rows.iter().filter_map(|r| r.get(c)).map(|s| s.chars().count()).max().unwrap_or(0))
        .collect();
    if rows.is_empty() {
        return writeln!(f, "  (none)");
    }
    for row in rows {
        let mut line = String::new();
        for (c, cell) in row.iter().enumerate() {
            line.push_str("  ");
            if right.get(c).copied().unwrap_or(false) {
                line.push_str(&format!("{cell:>w$}", w = widths[c]));
            } else {
                line.push_str(&format!("{cell:<w$}", w = widths[c]));
            }
        }
        writeln!(f, "{}", line.trim_end())?;
    }
    Ok(())
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "model {} from {} (dfc {}, plan format {})",
            self.model, self.source_name, self.dfc_version, self.format_version
        )?;
        if !self.dims.is_empty() {
            let dims: Vec<String> = self.dims.iter().map(|(n, v)| format!("{n}={v}")).collect();
            writeln!(f, "dims: {}", dims.join(", "))?;
        }

        let tensors = |list: &[TensorSummary]| -> Vec<Vec<String>> {
            list.iter().map(|t| vec![t.name.clone(), format!("{}{}", t.dtype, shape(&t.shape))]).collect()
        };
        writeln!(f, "inputs")?;
        table(f, &tensors(&self.inputs), &[])?;

        writeln!(f, "params ({}, {})", plural(self.params.len(), "tensor", "tensors"), bytes(self.total_param_bytes))?;
        let params: Vec<Vec<String>> = self
            .params
            .iter()
            .map(|p| {
                let mut init = p.init.clone();
                if !p.trainable {
                    init.push_str(", not trainable");
                }
                if p.partitions > 1 {
                    init.push_str(&format!(", {} shards", p.partitions));
                }
                if let Some(device) = &p.requested_device {
                    init.push_str(&format!(", on {device}"));
                }
                vec![p.name.clone(), format!("{}{}", p.dtype, shape(&p.shape)), bytes(p.bytes), init]
            })
            .collect();
        table(f, &params, &[false, false, true])?;

        writeln!(f, "outputs")?;
        table(f, &tensors(&self.outputs), &[])?;

        match &self.training {
            Some(t) => writeln!(f, "training: minimize {} with {}", t.loss, t.optimizer)?,
            None => writeln!(f, "training: none (inference only)")?,
        }

        writeln!(f, "devices")?;
        let devices: Vec<Vec<String>> = self
            .devices
            .iter()
            .map(|d| {
                let ops: Vec<String> = d.ops.iter().map(|(op, n)| format!("{op} {n}")).collect();
                vec![
                    d.device.clone(),
                    plural(d.n_nodes, "node", "nodes"),
                    plural(d.n_variables, "variable", "variables"),
                    bytes(d.variable_bytes),
                    format!("({})", ops.join(", ")),
                ]
            })
            .collect();
        table(f, &devices, &[false, true, true, true])
    }
}
