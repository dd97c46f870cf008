//! Checkpoints: the model's variables at a step, as safetensors files in a directory.
//!
//! A checkpoint is `DIR/ckpt-{step:08}.safetensors` (more digits past step 99,999,999), with
//! the metadata `{"format": "dfc-checkpoint-1", "step": "…", "epoch": "…"}` and one tensor per
//! variable, by name: a partitioned variable's, and each of its optimizer slots', whole, so
//! that a plan that splits it otherwise, or not at all, restores it ([`whole_variables`],
//! [`for_plan`]). Files are written atomically: to a temporary file in the same directory,
//! synced, then renamed over the final name (and the directory synced), so a crash leaves
//! either the whole checkpoint or none; a stray temporary file is never taken for a
//! checkpoint. After each successful save only the [`KEEP`] newest checkpoints (by step)
//! remain.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use dfc_interp::{Data, Tensor};
use dfc_ir::{DType, Op, TensorType};
use dfc_plan::Plan;
use safetensors::{Dtype, SafeTensors, View};

/// The value of the `format` metadata key.
pub const FORMAT: &str = "dfc-checkpoint-1";

/// How many checkpoints [`save`] keeps.
pub const KEEP: usize = 3;

/// A loaded checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct Checkpoint {
    pub path: PathBuf,
    pub step: u64,
    pub epoch: u64,
    /// The variables by name.
    pub tensors: BTreeMap<String, Tensor>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("cannot read checkpoint {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("checkpoint {}: {message}", path.display())]
    Invalid { path: PathBuf, message: String },
}

impl CheckpointError {
    fn invalid(path: &Path, message: impl Into<String>) -> CheckpointError {
        CheckpointError::Invalid { path: path.to_path_buf(), message: message.into() }
    }
}

/// The file name of the checkpoint of `step`.
pub fn file_name(step: u64) -> String {
    format!("ckpt-{step:08}.safetensors")
}

/// The step of a checkpoint file name, `None` for any other name (temporary files included).
pub fn step_of(file_name: &str) -> Option<u64> {
    let digits = file_name.strip_prefix("ckpt-")?.strip_suffix(".safetensors")?;
    if digits.len() < 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The checkpoints in `dir` as (step, path), oldest step first; empty if `dir` does not exist.
pub fn list(dir: &Path) -> io::Result<Vec<(u64, PathBuf)>> {
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut found = Vec::new();
    for entry in entries {
        let entry = entry?;
        if let Some(step) = entry.file_name().to_str().and_then(step_of) {
            if entry.file_type()?.is_file() {
                found.push((step, entry.path()));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// A tensor as safetensors sees it.
struct SafeView<'a> {
    tensor: &'a Tensor,
    shape: Vec<usize>,
}

fn safe_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::F32 => Dtype::F32,
        DType::F64 => Dtype::F64,
        DType::I32 => Dtype::I32,
        DType::I64 => Dtype::I64,
        DType::U8 => Dtype::U8,
        DType::Bool => Dtype::BOOL,
    }
}

impl View for SafeView<'_> {
    fn dtype(&self) -> Dtype {
        safe_dtype(self.tensor.dtype())
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        match &self.tensor.data {
            Data::U8(v) => Cow::Borrowed(v),
            _ => Cow::Owned(self.tensor.to_le_bytes()),
        }
    }

    fn data_len(&self) -> usize {
        self.tensor.len() * self.tensor.dtype().size_in_bytes()
    }
}

/// Writes the checkpoint of `step` (in `epoch`) holding `variables` to `dir` (created if
/// missing) atomically, then deletes all but the [`KEEP`] newest checkpoints there (by step;
/// the one just written is always kept; deletion is best effort). Returns the path written.
///
/// Two variables of the same name are an `InvalidInput` error, and nothing is written.
pub fn save<'a, N: AsRef<str>>(
    dir: &Path,
    step: u64,
    epoch: u64,
    variables: impl IntoIterator<Item = (N, &'a Tensor)>,
) -> io::Result<PathBuf> {
    let mut seen = HashSet::new();
    let mut views = Vec::new();
    for (name, tensor) in variables {
        let name = name.as_ref().to_string();
        if !seen.insert(name.clone()) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("two variables are named `{name}`")));
        }
        views.push((name, SafeView { tensor, shape: tensor.shape.dims().to_vec() }));
    }
    let metadata = HashMap::from([
        ("format".to_string(), FORMAT.to_string()),
        ("step".to_string(), step.to_string()),
        ("epoch".to_string(), epoch.to_string()),
    ]);
    let bytes = safetensors::serialize(views, Some(metadata)).map_err(io::Error::other)?;

    std::fs::create_dir_all(dir)?;
    let path = dir.join(file_name(step));
    write_atomically(dir, &path, &bytes)?;
    prune(dir, KEEP, step);
    Ok(path)
}

/// Writes `bytes` to `path` through a synced temporary file in `dir` and a rename. On any
/// failure the temporary file is removed and `path` is untouched.
fn write_atomically(dir: &Path, path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut temp = tempfile::Builder::new().prefix(".ckpt-").suffix(".tmp").tempfile_in(dir)?;
    temp.write_all(bytes)?;
    temp.as_file().sync_all()?;
    temp.persist(path).map_err(|e| e.error)?; // on error the temporary file is dropped: deleted
    #[cfg(unix)]
    std::fs::File::open(dir)?.sync_all()?;
    Ok(())
}

/// Deletes all but the `keep` newest checkpoints in `dir`, never the one of step `just_saved`.
fn prune(dir: &Path, keep: usize, just_saved: u64) {
    let Ok(found) = list(dir) else { return };
    let excess = found.len().saturating_sub(keep);
    for (step, path) in found.into_iter().take(excess) {
        if step != just_saved {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// The newest checkpoint in `dir` by step, loaded; `None` if there is none (or no `dir`).
pub fn latest(dir: &Path) -> Result<Option<Checkpoint>, CheckpointError> {
    let found = list(dir).map_err(|source| CheckpointError::Io { path: dir.to_path_buf(), source })?;
    match found.last() {
        Some((_, path)) => load(path).map(Some),
        None => Ok(None),
    }
}

/// Loads the checkpoint at `path`: its step, epoch and variables. Only a regular file is read
/// (a FIFO of a checkpoint's name would never answer), and not one larger than the memory
/// available.
pub fn load(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let limit = crate::memory::available_bytes().unwrap_or(u64::MAX);
    let bytes = dfc_diag::read::read_regular_at_most(path, limit)
        .map_err(|source| CheckpointError::Io { path: path.to_path_buf(), source })?;
    parse(path, &bytes)
}

/// Parses the bytes of a checkpoint file; `path` is for messages. The entry point for fuzzing
/// the checkpoint reader.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let bad =
        |e: safetensors::SafeTensorError| CheckpointError::invalid(path, format!("not a valid safetensors file: {e}"));
    if let Some(first) = bytes.first_chunk::<8>() {
        let header = u64::from_le_bytes(*first);
        if header > bytes.len() as u64 - 8 {
            return Err(CheckpointError::invalid(
                path,
                format!(
                    "not a valid safetensors file: its header length {header} is more than the {} bytes after it",
                    bytes.len() - 8
                ),
            ));
        }
    }
    let (_, metadata) = SafeTensors::read_metadata(bytes).map_err(bad)?;
    let info = metadata.metadata().clone().unwrap_or_default();
    match info.get("format") {
        Some(f) if f == FORMAT => {}
        Some(f) => return Err(CheckpointError::invalid(path, format!("format is `{f}`, expected `{FORMAT}`"))),
        None => {
            return Err(CheckpointError::invalid(
                path,
                format!("no `format` metadata: not a dfc checkpoint ({FORMAT})"),
            ))
        }
    }
    let number = |key: &str| -> Result<u64, CheckpointError> {
        let value = info.get(key).ok_or_else(|| CheckpointError::invalid(path, format!("no `{key}` metadata")))?;
        value.parse().map_err(|_| CheckpointError::invalid(path, format!("`{key}` metadata `{value}` is not a number")))
    };
    let (step, epoch) = (number("step")?, number("epoch")?);
    let file = SafeTensors::deserialize(bytes).map_err(bad)?;
    let mut tensors = BTreeMap::new();
    for (name, view) in file.iter() {
        let dtype = match view.dtype() {
            Dtype::F32 => DType::F32,
            Dtype::F64 => DType::F64,
            Dtype::I32 => DType::I32,
            Dtype::I64 => DType::I64,
            Dtype::U8 => DType::U8,
            Dtype::BOOL => DType::Bool,
            other => {
                return Err(CheckpointError::invalid(
                    path,
                    format!("tensor `{name}` has dtype {other}; supported: F32 F64 I32 I64 U8 BOOL"),
                ))
            }
        };
        let ty = TensorType::new(dtype, view.shape().to_vec());
        let tensor = Tensor::from_le_bytes(&ty, view.data())
            .ok_or_else(|| CheckpointError::invalid(path, format!("tensor `{name}` has the wrong size for {ty}")))?;
        tensors.insert(name.to_string(), tensor);
    }
    Ok(Checkpoint { path: path.to_path_buf(), step, epoch, tensors })
}

/// Where a variable of a plan lies in the one a checkpoint holds: rows `offset..` of `whole`
/// (of `rows` rows), for a shard of a partitioned variable and each optimizer slot of a shard.
#[derive(Clone, Debug, PartialEq)]
struct Rows {
    whole: String,
    rows: usize,
    offset: usize,
}

/// The variables of `plan` that checkpoints hold (every one but replicas' copies, which are
/// restored from the variables they mirror), by name: their types, and for shards and their
/// slots where they lie in the whole variable.
fn held(plan: &Plan) -> BTreeMap<&str, (TensorType, Option<Rows>)> {
    let mut held = BTreeMap::new();
    for partition in &plan.partitions {
        let graph = &partition.module.graph;
        for id in graph.node_ids() {
            let node = graph.node(id);
            let Op::Variable { ty, origin, .. } = &node.op else { continue };
            if origin.as_ref().is_some_and(|o| o.mirror_of.is_some()) {
                continue;
            }
            let rows = origin.as_ref().and_then(|o| {
                let whole = o.shape.dims();
                let shard = ty.shape.dims();
                let part = !whole.is_empty() && whole.len() == shard.len() && whole[1..] == shard[1..];
                (part && whole[0] > shard[0]).then(|| Rows { whole: o.name.clone(), rows: whole[0], offset: o.offset })
            });
            held.insert(node.name.as_str(), (ty.clone(), rows));
        }
    }
    // A slot of a shard (`w/part_0/m`) is that shard's rows of the whole variable's slot (`w/m`).
    let shards: Vec<(&str, TensorType, Rows)> =
        held.iter().filter_map(|(name, (ty, rows))| Some((*name, ty.clone(), rows.clone()?))).collect();
    for (name, (ty, rows)) in held.iter_mut() {
        if rows.is_some() {
            continue;
        }
        let slot_of = |(shard, shard_ty, _): &&(&str, TensorType, Rows)| {
            name.strip_prefix(shard).is_some_and(|rest| rest.starts_with('/')) && shard_ty.shape == ty.shape
        };
        if let Some((shard, _, of)) = shards.iter().find(slot_of) {
            let whole = format!("{}{}", of.whole, &name[shard.len()..]);
            *rows = Some(Rows { whole, ..of.clone() });
        }
    }
    held
}

/// The variables a checkpoint of `plan` holds, from the plan's `variables`: each partitioned
/// variable and each of its slots whole, under the model's name, so that a checkpoint does not
/// depend on how the variables were split; the others as they are.
pub fn whole_variables(plan: &Plan, variables: &dfc_interp::Variables) -> Vec<(String, Tensor)> {
    let held = held(plan);
    let mut groups: BTreeMap<&str, (usize, Vec<(usize, &str, &Tensor)>)> = BTreeMap::new();
    let mut saved = Vec::new();
    for (name, tensor) in variables.iter() {
        match held.get(name.as_str()) {
            Some((_, Some(rows))) => {
                let group = groups.entry(rows.whole.as_str()).or_insert((rows.rows, Vec::new()));
                group.1.push((rows.offset, name.as_str(), tensor));
            }
            _ => saved.push((name.clone(), tensor.clone())),
        }
    }
    for (whole, (rows, mut shards)) in groups {
        shards.sort_by_key(|(offset, ..)| *offset);
        let covered =
            shards.iter().try_fold(0, |next, (offset, _, t)| (*offset == next).then(|| next + t.shape.dims()[0]));
        let operands: Vec<&Tensor> = shards.iter().map(|(.., t)| *t).collect();
        match dfc_interp::eval(&Op::Concat { axis: 0 }, &operands) {
            Ok(joined) if covered == Some(rows) => saved.push((whole.to_string(), joined)),
            // Not every shard is here: they stay as they are.
            _ => saved.extend(shards.iter().map(|(_, name, t)| (name.to_string(), (*t).clone()))),
        }
    }
    saved.sort_by(|a, b| a.0.cmp(&b.0));
    saved
}

/// The values of `plan`'s variables in `checkpoint`: every variable a checkpoint holds (each
/// but a replica's copy, which is restored from the variable it mirrors), with the plan's
/// type, found under its own name or, for a shard or a shard's slot, as its rows of the whole
/// variable. Says which file and which variable where one is missing or of another type. The
/// driver checks this before it restores anything, on whatever runs the plan: a remote
/// worker's own check could not name the file.
pub fn for_plan(plan: &Plan, checkpoint: &Checkpoint) -> Result<BTreeMap<String, Tensor>, CheckpointError> {
    let path = &checkpoint.path;
    let missing = |name: &str| {
        CheckpointError::invalid(path, format!("has no variable `{name}`; was it written for another model?"))
    };
    let wrong_type = |name: &str, tensor: &Tensor, ty: &TensorType| {
        let message = format!(
            "holds `{name}` as {}, but the plan's variable is {ty}; was it written for another model?",
            tensor.ty()
        );
        CheckpointError::invalid(path, message)
    };
    let mut values = BTreeMap::new();
    for (name, (ty, rows)) in held(plan) {
        let value = match (checkpoint.tensors.get(name), rows) {
            (Some(tensor), _) if tensor.ty() == ty => tensor.clone(),
            (Some(tensor), _) => return Err(wrong_type(name, tensor, &ty)),
            (None, None) => return Err(missing(name)),
            (None, Some(rows)) => {
                let whole = checkpoint.tensors.get(&rows.whole).ok_or_else(|| missing(&rows.whole))?;
                let mut dims = ty.shape.dims().to_vec();
                let shard_rows = dims[0];
                dims[0] = rows.rows;
                let whole_ty = TensorType::new(ty.dtype, dims);
                if whole.ty() != whole_ty {
                    return Err(wrong_type(&rows.whole, whole, &whole_ty));
                }
                let mut begin = vec![0; ty.shape.dims().len()];
                begin[0] = rows.offset;
                let size = ty.shape.dims().to_vec();
                dfc_interp::eval(&Op::Slice { begin, size }, &[whole]).map_err(|e| {
                    let at = rows.offset;
                    let what =
                        format!("cannot take rows {at}..{} of `{}` for `{name}`: {e}", at + shard_rows, rows.whole);
                    CheckpointError::invalid(path, what)
                })?
            }
        };
        values.insert(name.to_string(), value);
    }
    Ok(values)
}
