//! Replica instances: under data parallelism every replica but the first runs the same
//! partition, up to its index, its device and the names that carry them. A plan stores one of
//! them (the template) and, for the others, an `Instance`; `instantiate` rebuilds each from the
//! template, so that neither a compile for 64 devices nor its plan holds 64 copies.
//!
//! Instantiating the template of replica t on device Dt as replica r on device Dr:
//! - every node name `replica_<t>/rest` becomes `replica_<r>/rest` (a name without that prefix
//!   is an error: the partition is not a replica's); a Recv's `…/recv_on_<Dt>` ends in Dr;
//! - a node placed or requested on Dt is on Dr;
//! - a Send's key `Dt;name;to` becomes `Dr;name';to`, a Recv's `from;name;Dt` becomes
//!   `from;name';Dr`, with name' renamed as above;
//! - an all-reduce of replica t is replica r's, and so is the slot of a `pad` named
//!   `…/replica_slot` (an all-gather's: the replica's rows at its index along axis 0), and
//!   the shard of a `slice` or a variable named `…@replica_shard` (a sharded optimizer's:
//!   the replica's rows of a tensor split over the replicas along axis 0).
//!
//! Everything else (ops, types, edges, spans, colocations, the module's lists) is the
//! template's. `partition` names transfers the same way, so an instance equals the partition
//! that compiling every replica in full would give (tests/replica_instances.rs checks it).

use crate::{DeviceSpec, Module, Op};

/// The name ending of a `pad` that puts a replica's tensor at its index along a new axis 0 of
/// one slot per replica (an all-gather made of an all-reduce): instances move it to their own.
pub const REPLICA_SLOT: &str = "/replica_slot";

/// The name ending of a `slice` that takes a replica's shard of a tensor split evenly over
/// the replicas along axis 0 (`begin` = replica × `size`), or of a variable that holds such a
/// shard (its `origin`'s `offset`): a sharded optimizer's, moved by instances to their own.
/// No name the language gives ends so (`@` is in no identifier), so a model's own slice is
/// never taken for one.
pub const REPLICA_SHARD: &str = "@replica_shard";
use serde::{Deserialize, Serialize};

/// Replica `replica` on `device`, a copy of the partition that is replica `template_replica`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// The index of the template among the plan's partitions.
    pub template: u32,
    pub template_replica: u32,
    pub replica: u32,
    pub device: DeviceSpec,
}

/// The prefix of replica `r`'s node names.
pub fn replica_prefix(r: u32) -> String {
    format!("replica_{r}/")
}

/// The short form of a device in node names: `worker_1_cpu_0`.
pub fn device_slug(device: &DeviceSpec) -> String {
    device.to_string().trim_start_matches('/').replace("job:", "").replace("task:", "").replace(['/', ':'], "_")
}

/// Renames what names a template's replica and device.
pub struct Renamer {
    from_prefix: String,
    to_prefix: String,
    from_device: DeviceSpec,
    to_device: DeviceSpec,
    from_device_text: String,
    to_device_text: String,
    from_recv_suffix: String,
    to_recv_suffix: String,
    from_replica: u32,
    to_replica: u32,
}

impl Renamer {
    pub fn new(from_replica: u32, from_device: &DeviceSpec, to_replica: u32, to_device: &DeviceSpec) -> Renamer {
        Renamer {
            from_prefix: replica_prefix(from_replica),
            to_prefix: replica_prefix(to_replica),
            from_device: from_device.clone(),
            to_device: to_device.clone(),
            from_device_text: from_device.to_string(),
            to_device_text: to_device.to_string(),
            from_recv_suffix: format!("/recv_on_{}", device_slug(from_device)),
            to_recv_suffix: format!("/recv_on_{}", device_slug(to_device)),
            from_replica,
            to_replica,
        }
    }

    /// `replica_<t>/rest` as `replica_<r>/rest`.
    pub fn name(&self, name: &str) -> Result<String, String> {
        let rest = name
            .strip_prefix(&self.from_prefix)
            .ok_or_else(|| format!("`{name}` is not a node of replica {}", self.from_replica))?;
        Ok(format!("{}{rest}", self.to_prefix))
    }

    /// A Send's key: `Dt;name;to` as `Dr;name';to`.
    pub fn send_key(&self, key: &str, to: &DeviceSpec) -> Result<String, String> {
        let bad = || format!("the Send key `{key}` is not `{};NAME;{to}`", self.from_device_text);
        let rest = key.strip_prefix(&self.from_device_text).and_then(|k| k.strip_prefix(';')).ok_or_else(bad)?;
        let name = rest.strip_suffix(&to.to_string()).and_then(|k| k.strip_suffix(';')).ok_or_else(bad)?;
        Ok(format!("{};{};{to}", self.to_device_text, self.name(name)?))
    }

    /// A Recv's key: `from;name;Dt` as `from;name';Dr`.
    pub fn recv_key(&self, key: &str, from: &DeviceSpec) -> Result<String, String> {
        let bad = || format!("the Recv key `{key}` is not `{from};NAME;{}`", self.from_device_text);
        let rest = key.strip_prefix(&from.to_string()).and_then(|k| k.strip_prefix(';')).ok_or_else(bad)?;
        let name = rest.strip_suffix(&self.from_device_text).and_then(|k| k.strip_suffix(';')).ok_or_else(bad)?;
        Ok(format!("{from};{};{}", self.name(name)?, self.to_device_text))
    }

    fn device(&self, device: &mut Option<DeviceSpec>) {
        if device.as_ref() == Some(&self.from_device) {
            *device = Some(self.to_device.clone());
        }
    }

    /// The replica slot pad of the instance: its padding along axis 0 moved from the
    /// template's index to the instance's.
    fn replica_slot(&self, before: &[usize], after: &[usize]) -> Result<Op, String> {
        let (Some(&slot), Some(&rest)) = (before.first(), after.first()) else {
            return Err("a replica slot pads no axis".into());
        };
        let last = slot.checked_add(rest).filter(|_| slot == self.from_replica as usize);
        let Some(last) = last.filter(|&last| self.to_replica as usize <= last) else {
            return Err(format!(
                "a replica slot at {slot} of {} does not fit replica {}",
                slot + rest + 1,
                self.to_replica
            ));
        };
        let (mut before, mut after) = (before.to_vec(), after.to_vec());
        before[0] = self.to_replica as usize;
        after[0] = last - before[0];
        Ok(Op::Pad { before, after })
    }

    /// The op of the node `name` for the instance's replica where it depends on the replica
    /// (an all-reduce, a replica slot's pad, a replica shard's slice or variable); `None` for
    /// any other. Replication builds each replica's copy of such a node with it too.
    pub fn replica_op(&self, name: &str, op: &Op) -> Result<Option<Op>, String> {
        Ok(match op {
            Op::Pad { before, after } if name.ends_with(REPLICA_SLOT) => Some(self.replica_slot(before, after)?),
            op if name.ends_with(REPLICA_SHARD) => Some(replica_shard(op, self.from_replica, self.to_replica)?),
            Op::AllReduce { .. } => self.op(op)?,
            _ => None,
        })
    }

    /// The op of the instance: transfers and all-reduces renamed, any other op as it is.
    pub fn op(&self, op: &Op) -> Result<Option<Op>, String> {
        Ok(match op {
            Op::Send { key, to } => Some(Op::Send { key: self.send_key(key, to)?, to: to.clone() }),
            Op::Recv { key, from, ty } => {
                Some(Op::Recv { key: self.recv_key(key, from)?, from: from.clone(), ty: ty.clone() })
            }
            Op::AllReduce { key, group_size, replica } => {
                if *replica != self.from_replica {
                    return Err(format!("the all-reduce `{key}` is replica {replica}'s, not {}'s", self.from_replica));
                }
                Some(Op::AllReduce { key: key.clone(), group_size: *group_size, replica: self.to_replica })
            }
            _ => None,
        })
    }
}

/// `op`, the `slice` or variable of replica `from`'s shard (named `…@replica_shard`), as
/// replica `to`'s: the same size, `to` shards along axis 0. An error where `op` is not
/// replica `from`'s shard, or replica `to`'s would not fit in the whole.
pub fn replica_shard(op: &Op, from: u32, to: u32) -> Result<Op, String> {
    let (from, to) = (from as usize, to as usize);
    let moved = |begin: usize, size: usize, whole: Option<usize>| -> Result<usize, String> {
        if size.checked_mul(from) != Some(begin) {
            return Err(format!("a replica shard of {size} rows at row {begin} is not replica {from}'s"));
        }
        let start = size.checked_mul(to).filter(|s| whole.is_none_or(|w| s.checked_add(size).is_some_and(|e| e <= w)));
        start.ok_or_else(|| format!("replica {to}'s shard of {size} rows does not fit in {} rows", whole.unwrap_or(0)))
    };
    match op {
        Op::Slice { begin, size } if !begin.is_empty() && begin.len() == size.len() => {
            let mut begin = begin.clone();
            begin[0] = moved(begin[0], size[0], None)?;
            Ok(Op::Slice { begin, size: size.clone() })
        }
        Op::Variable { ty, init, trainable, partitions, origin: Some(origin) } if ty.shape.rank() > 0 => {
            let size = ty.shape.dims()[0];
            let whole = origin.shape.dims().first().copied();
            let offset = moved(origin.offset, size, Some(whole.unwrap_or(0)))?;
            let origin = Some(Box::new(crate::VariableOrigin { offset, ..(**origin).clone() }));
            Ok(Op::Variable {
                ty: ty.clone(),
                init: init.clone(),
                trainable: *trainable,
                partitions: *partitions,
                origin,
            })
        }
        op => Err(format!("a `{}` named as a replica shard; only slices and variables with an origin are", op.name())),
    }
}

/// The partition of `instance`, from its template `template` (on `template_device`).
pub fn instantiate(template: &Module, template_device: &DeviceSpec, instance: &Instance) -> Result<Module, String> {
    let renamer = Renamer::new(instance.template_replica, template_device, instance.replica, &instance.device);
    let mut module = template.clone();
    let ids: Vec<_> = module.graph.node_ids().collect();
    for id in ids {
        let node = module.graph.node(id);
        let mut name = renamer.name(&node.name)?;
        if matches!(node.op, Op::Recv { .. }) {
            if let Some(stem) = name.strip_suffix(&renamer.from_recv_suffix) {
                name = format!("{stem}{}", renamer.to_recv_suffix);
            }
        }
        let op = match renamer.replica_op(&node.name, &node.op)? {
            Some(op) => Some(op),
            None => renamer.op(&node.op)?,
        };
        let node = module.graph.node_mut(id);
        node.name = name;
        if let Some(op) = op {
            node.op = op;
        }
        renamer.device(&mut node.device);
        renamer.device(&mut node.requested_device);
    }
    module.graph.forget_names();
    Ok(module)
}

/// The transfers and all-reduces of `instance` alone, each Send fed by an `Input` of its
/// tensor's type: enough to check and simulate how the instance meets the other partitions
/// without building it.
pub fn instance_transfers(
    template: &Module,
    template_device: &DeviceSpec,
    instance: &Instance,
) -> Result<Module, String> {
    let renamer = Renamer::new(instance.template_replica, template_device, instance.replica, &instance.device);
    let graph = &template.graph;
    let mut module = Module { name: template.name.clone(), dims: template.dims.clone(), ..Module::default() };
    for id in graph.node_ids() {
        let node = graph.node(id);
        let Some(op) = renamer.op(&node.op)? else { continue };
        let name = renamer.name(&node.name)?;
        let inputs: Vec<crate::TensorRef> = graph
            .inputs(id)
            .into_iter()
            .map(|operand| {
                let ty = graph.ty(operand).clone();
                module
                    .graph
                    .add_with_types(Op::Input { ty: ty.clone() }, &[], vec![ty], &format!("{name}/operand"), None)
                    .into()
            })
            .collect();
        let copy = module.graph.add_with_types(op, &inputs, node.outputs.clone(), &name, graph.span(id));
        for id in inputs.iter().map(|t| t.node).chain([copy]) {
            module.graph.node_mut(id).device = Some(instance.device.clone());
        }
    }
    Ok(module)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device(text: &str) -> DeviceSpec {
        DeviceSpec::parse(text).unwrap()
    }

    #[test]
    fn keys_and_names_move_to_the_instance() {
        let (d0, d1, d5) =
            (device("/job:w/task:0/cpu:0"), device("/job:w/task:0/cpu:1"), device("/job:w/task:0/cpu:5"));
        let renamer = Renamer::new(1, &d1, 5, &d5);
        assert_eq!(renamer.name("replica_1/w/read").unwrap(), "replica_5/w/read");
        assert!(renamer.name("replica_10/w").is_err(), "replica_10 is not replica 1");
        assert!(renamer.name("w").is_err());
        assert_eq!(
            renamer.send_key(&format!("{d1};replica_1/loss;{d0}"), &d0).unwrap(),
            format!("{d5};replica_5/loss;{d0}")
        );
        assert_eq!(
            renamer.recv_key(&format!("{d0};replica_1/x:1;{d1}"), &d0).unwrap(),
            format!("{d0};replica_5/x:1;{d5}")
        );
        assert!(renamer.recv_key(&format!("{d0};replica_1/x;{d5}"), &d0).is_err(), "not the template's device");
        assert!(renamer.send_key(&format!("{d1};x;{d0}"), &d0).is_err(), "not a replica's tensor");
    }
}
