//! What `dfc inspect` shows: a plan reduced to plain strings and numbers, for `--json` (serde)
//! and for people (`Display`).

use crate::{Plan, StrategySpec, FORMAT_VERSION};
use dfc_ir::{Op, TensorType};
use dfc_passes::cost::{human_bytes as bytes, tensor_bytes};
use dfc_passes::CostReport;
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
    /// How the model is spread over the cluster.
    pub strategy: StrategySpec,
    /// The replicas each keep a shard of the optimizer's state (`--shard-optimizer`): some
    /// variable is a replica's shard (named `…@replica_shard`).
    pub optimizer_sharded: bool,
    pub devices: Vec<DeviceSummary>,
    pub inputs: Vec<TensorSummary>,
    pub outputs: Vec<TensorSummary>,
    pub metrics: Vec<TensorSummary>,
    pub params: Vec<ParamSummary>,
    pub training: Option<TrainingSummary>,
    pub total_param_bytes: u64,
    /// The cost model's prediction for one step, if the plan holds one.
    pub report: Option<CostReport>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct DeviceSummary {
    pub device: String,
    pub n_nodes: usize,
    pub n_variables: usize,
    pub variable_bytes: u64,
    /// Of `variable_bytes`, the optimizer's state: its slots, the variables it keeps beside a
    /// trainable one (with `--shard-optimizer`, this replica's shard of them).
    pub optimizer_state_bytes: u64,
    /// Node count per op name (`matmul`, `read`, ...).
    pub ops: BTreeMap<String, usize>,
    /// The partition's fused loop kernels (`dfc_passes::fuse`), which the runtime compiles
    /// for the device's CPU or GPU where the plan runs.
    pub kernels: KernelSummary,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct KernelSummary {
    pub kernels: usize,
    /// Nodes computed inside the kernels, roots included.
    pub fused_nodes: usize,
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
    /// Where its shards (or, mirrored, its copies) live, in order.
    pub devices: Vec<String>,
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
        .enumerate()
        .map(|(i, p)| {
            let graph = &p.module.graph;
            let mut ops = BTreeMap::new();
            let (mut n_variables, mut variable_bytes, mut optimizer_state_bytes) = (0, 0u64, 0u64);
            let trainable = |id: dfc_ir::NodeId| matches!(graph.node(id).op, Op::Variable { trainable: true, .. });
            for id in graph.node_ids() {
                let node = graph.node(id);
                *ops.entry(node.op.name().to_string()).or_insert(0) += 1;
                if let Op::Variable { ty, trainable: false, .. } = &node.op {
                    if node.colocate_with.is_some_and(|with| graph.contains(with) && trainable(with)) {
                        optimizer_state_bytes = optimizer_state_bytes.saturating_add(tensor_bytes(ty));
                    }
                }
                if let Op::Variable { ty, .. } = &node.op {
                    n_variables += 1;
                    variable_bytes = variable_bytes.saturating_add(tensor_bytes(ty));
                }
            }
            let fusion = dfc_passes::fuse(&p.module, &plan.kept_nodes(i));
            let kernels = KernelSummary {
                kernels: fusion.kernels.len(),
                fused_nodes: fusion.kernels.iter().map(|k| k.members.len()).sum(),
            };
            DeviceSummary {
                device: p.device.to_string(),
                n_nodes: graph.len(),
                n_variables,
                variable_bytes,
                optimizer_state_bytes,
                ops,
                kernels,
            }
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
            devices: p.devices.clone(),
        })
        .collect();
    Summary {
        format_version: FORMAT_VERSION,
        dfc_version: plan.dfc_version.clone(),
        source_name: plan.source_name.clone(),
        source_hash: format!("{:016x}", plan.source_hash),
        model: plan.model.clone(),
        dims: plan.dims.clone(),
        strategy: plan.strategy.clone(),
        optimizer_sharded: plan.partitions.iter().any(|p| {
            let graph = &p.module.graph;
            graph.node_ids().any(|id| {
                let node = graph.node(id);
                matches!(node.op, Op::Variable { .. }) && node.name.ends_with(dfc_ir::REPLICA_SHARD)
            })
        }),
        devices,
        inputs: plan.inputs.iter().map(|io| tensor(&io.name, &io.ty)).collect(),
        outputs: plan.outputs.iter().map(|io| tensor(&io.name, &io.ty)).collect(),
        metrics: plan.metrics.iter().map(|io| tensor(&io.name, &io.ty)).collect(),
        total_param_bytes: params.iter().fold(0u64, |sum, p| sum.saturating_add(p.bytes)),
        params,
        training: plan
            .training
            .as_ref()
            .map(|t| TrainingSummary { loss: t.loss.clone(), optimizer: t.optimizer.to_string() }),
        report: plan.report.clone(),
    }
}

/// `[4,3]`, as `dfc_ir::Shape` prints it.
fn shape(dims: &[usize]) -> String {
    dfc_ir::Shape(dims.to_vec()).to_string()
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
        let mut described = strategy(&self.strategy, self.devices.len());
        if self.optimizer_sharded {
            described.push_str(", optimizer state sharded over the replicas (ZeRO-1)");
        }
        writeln!(f, "strategy: {described}")?;

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
                    init.push_str(&format!(", requested {device}"));
                }
                let mut row = vec![p.name.clone(), format!("{}{}", p.dtype, shape(&p.shape)), bytes(p.bytes), init];
                // With one device, where every param lives goes without saying.
                if self.devices.len() > 1 && !p.devices.is_empty() {
                    row.push(format!("on {}", list(&p.devices, 3)));
                }
                row
            })
            .collect();
        table(f, &params, &[false, false, true])?;

        writeln!(f, "outputs")?;
        table(f, &tensors(&self.outputs), &[])?;
        if !self.metrics.is_empty() {
            writeln!(f, "metrics")?;
            table(f, &tensors(&self.metrics), &[])?;
        }

        match &self.training {
            Some(t) => writeln!(f, "training: minimize {} with {}", t.loss, t.optimizer)?,
            None => writeln!(f, "training: none (inference only)")?,
        }

        writeln!(f, "devices")?;
        // The optimizer's share of the variables, where it keeps any.
        let with_state = self.devices.iter().any(|d| d.optimizer_state_bytes > 0);
        let devices: Vec<Vec<String>> = self
            .devices
            .iter()
            .map(|d| {
                let ops: Vec<String> = d.ops.iter().map(|(op, n)| format!("{op} {n}")).collect();
                let mut row = vec![
                    d.device.clone(),
                    plural(d.n_nodes, "node", "nodes"),
                    plural(d.n_variables, "variable", "variables"),
                    bytes(d.variable_bytes),
                ];
                row.extend(with_state.then(|| format!("optimizer state {}", bytes(d.optimizer_state_bytes))));
                row.push(format!("({})", ops.join(", ")));
                row
            })
            .collect();
        let right = if with_state { &[false, true, true, true, false][..] } else { &[false, true, true, true][..] };
        table(f, &devices, right)?;
        let kernels: Vec<Vec<String>> = self
            .devices
            .iter()
            .filter(|d| d.kernels.kernels > 0)
            .map(|d| {
                vec![
                    d.device.clone(),
                    plural(d.kernels.kernels, "fused kernel", "fused kernels"),
                    format!("({} nodes)", d.kernels.fused_nodes),
                ]
            })
            .collect();
        if !kernels.is_empty() {
            writeln!(f, "fused kernels (compiled for each device where the plan runs)")?;
            table(f, &kernels, &[false, true, true])?;
        }

        if let Some(report) = &self.report {
            write!(f, "{report}")?;
        }
        Ok(())
    }
}

/// `mirrored, 4 replicas, variables round-robin`; `single`.
fn strategy(s: &StrategySpec, n_devices: usize) -> String {
    let mut text = s.name.clone();
    match s.name.as_str() {
        "model" if s.replicas > 1 => text.push_str(&format!(", a pipeline of {} micro-batches", s.replicas)),
        _ if s.replicas > 1 => text.push_str(&format!(", {} replicas", s.replicas)),
        _ => {}
    }
    if s.name == "ps" {
        text.push_str(if s.sync { ", synchronous updates" } else { ", asynchronous updates" });
    }
    if s.staleness_aware {
        text.push_str(", staleness-aware");
    }
    if s.overlap {
        text.push_str(", all-reduces overlapped with the backward pass");
    }
    if s.backup_workers > 0 {
        let n = s.replicas.saturating_sub(s.backup_workers);
        let b = s.backup_workers;
        let first = if n == 1 { "gradient".to_string() } else { format!("{n} gradients") };
        text.push_str(&format!(
            ", {b} backup worker{} (each update takes the first {first})",
            if b == 1 { "" } else { "s" }
        ));
    }
    if let Some(k) = s.sync_every {
        text.push_str(&format!(", variables averaged every {k} steps"));
    }
    if n_devices > 1 {
        text.push_str(&format!(", variables {}", s.placement));
    }
    text
}

/// `a, b, c`, or past `shown` items `a, b, c and 5 more`.
fn list(items: &[String], shown: usize) -> String {
    if items.len() <= shown {
        return items.join(", ");
    }
    format!("{} and {} more", items[..shown].join(", "), items.len() - shown)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IoSpec, Partition};
    use dfc_ir::{DType, DeviceSpec, Graph, Initializer, Module, Output};
    use dfc_passes::CostModel;

    /// `y = x @ w` on one CPU.
    fn plan() -> Plan {
        let mut g = Graph::new();
        let x = g.add(Op::Input { ty: TensorType::new(DType::F32, vec![4, 3]) }, &[], "x", None).unwrap();
        let variable = Op::Variable {
            ty: TensorType::new(DType::F32, vec![3, 2]),
            init: Initializer::GlorotUniform,
            trainable: true,
            partitions: 1,
            origin: None,
        };
        let w = g.add(variable, &[], "w", None).unwrap();
        let w_read = g.add(Op::Read, &[w.into()], "w/read", None).unwrap();
        let y = g.add(Op::MatMul { transpose_a: false, transpose_b: false }, &[x.into(), w_read.into()], "y", None);
        let module = Module {
            name: "mlp".into(),
            graph: g,
            inputs: vec![x],
            params: vec![w],
            outputs: vec![Output { name: "y".into(), tensor: y.unwrap().into() }],
            ..Module::default()
        };
        Plan::single_device(module, "mlp.df", "model mlp { }")
    }

    /// The same model mirrored on two CPUs of one task, with a metric and a cost report.
    fn mirrored() -> Plan {
        let mut plan = plan();
        let second = DeviceSpec::parse("/job:localhost/task:0/cpu:1").unwrap();
        let mut module = plan.partitions[0].module.clone();
        let ids: Vec<_> = module.graph.node_ids().collect();
        for id in ids {
            module.graph.node_mut(id).device = Some(second.clone());
        }
        plan.partitions.push(Partition { device: second.clone(), module });
        plan.strategy = StrategySpec {
            name: "mirrored".into(),
            replicas: 2,
            placement: "round-robin".into(),
            ..StrategySpec::default()
        };
        plan.params[0].devices.push(second.to_string());
        plan.metrics.push(IoSpec { name: "accuracy".into(), ty: TensorType::scalar(DType::F32) });
        let modules: Vec<&Module> = plan.partitions.iter().map(|p| &p.module).collect();
        plan.report = Some(dfc_passes::cost::estimate(&modules, &CostModel::default()));
        plan
    }

    fn has_line(text: &str, line: &str) {
        assert!(text.lines().any(|l| l == line), "no line `{line}` in:\n{text}");
    }

    #[test]
    fn one_device_shows_no_placement() {
        let summary = summary(&plan());
        assert_eq!(summary.strategy, StrategySpec::default());
        assert_eq!(summary.params[0].devices, ["/job:localhost/task:0/cpu:0"]);
        assert!(summary.report.is_none() && summary.metrics.is_empty());
        let text = summary.to_string();
        has_line(&text, "strategy: single");
        has_line(&text, "  w  f32[3,2]  24 B  glorot_uniform");
        assert!(!text.contains("metrics") && !text.contains("cost of one step"), "{text}");
    }

    #[test]
    fn several_devices_show_the_strategy_placement_metrics_and_report() {
        let plan = mirrored();
        let summary = summary(&plan);
        assert_eq!(summary.strategy.replicas, 2);
        assert_eq!(summary.metrics[0].name, "accuracy");
        assert_eq!(summary.params[0].devices.len(), 2);
        assert_eq!(summary.report.as_ref(), plan.report.as_ref());
        let text = summary.to_string();
        has_line(&text, "strategy: mirrored, 2 replicas, variables round-robin");
        has_line(&text, "metrics");
        has_line(&text, "  accuracy  f32[]");
        has_line(
            &text,
            "  w  f32[3,2]  24 B  glorot_uniform  on /job:localhost/task:0/cpu:0, /job:localhost/task:0/cpu:1",
        );
        has_line(
            &text,
            "  /job:localhost/task:0/cpu:1  4 nodes  1 variable  24 B  (input 1, matmul 1, read 1, variable 1)",
        );
        assert!(text.contains(&plan.report.as_ref().unwrap().to_string()), "{text}");
    }

    #[test]
    fn long_device_lists_are_cut_short() {
        let items: Vec<String> = (0..5).map(|i| format!("d{i}")).collect();
        assert_eq!(list(&items, 3), "d0, d1, d2 and 2 more");
        assert_eq!(list(&items[..3], 3), "d0, d1, d2");
    }
}
