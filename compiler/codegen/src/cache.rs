//! The code cache: generated code kept on disk under the user's cache directory, so that a
//! plan's kernels are generated once per machine, not at every load.
//!
//! An entry is found by the SHA-256 of its key and used only if the key it stores equals the
//! one asked for, byte for byte. An entry holds the code of the partitions one process runs,
//! compiled together. The key is everything code generation reads: each partition's
//! IR (its postcard encoding, without what names the partition's place in the plan: node
//! names, devices, transfer keys and replica indices, which no kernel reads; so data
//! parallelism's replicas, alike but for those, share one entry and, in a process, one linked
//! copy of their code), the kernel roots kept, the target (CPU triple, name and
//! features, or the GPU architecture), LLVM's version and this dfc build (its version and its
//! executable's identity, so that a rebuilt dfc never runs code an older build generated).
//!
//! Entry file (`<dir>/<hex digest>.code`):
//!
//! | field | size |
//! | --- | --- |
//! | magic `dfccode1` | 8 |
//! | key length k, u64 LE | 8 |
//! | key | k |
//! | code length c, u64 LE | 8 |
//! | code: postcard of `NativeCode` or `GpuCode` | c |
//! | SHA-256 of everything before | 32 |
//!
//! A damaged entry (a bad disk, a write cut short) fails its checksum and is generated again.
//! The cache keeps to [`MAX_CACHE_BYTES`]: a write past it removes the entries used longest ago
//! (a hit marks its entry used by its modification time).
//! The directory is the user's own (mode 0700): whoever can write it can already run code as
//! that user, so its entries are trusted once their checksum holds.

use crate::code::{GpuCode, NativeCode, NativeTarget};
use crate::CodegenError;
use dfc_ir::{DeviceSpec, Module, NodeId, Op};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sha2::{Digest, Sha256};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// Where the cache lives: `DFC_CACHE_DIR` (`off` turns the disk cache off), else
/// `$XDG_CACHE_HOME/dfc`, else `~/.cache/dfc`.
pub const CACHE_DIR_VARIABLE: &str = "DFC_CACHE_DIR";
const MAGIC: &[u8; 8] = b"dfccode1";
/// An entry larger than this is not read (no partition's code comes near it).
const MAX_ENTRY_BYTES: u64 = 1 << 30;
/// The cache's size at most: past it, the entries used longest ago are removed (a rebuilt dfc
/// makes new keys, so old entries are never used again).
pub const MAX_CACHE_BYTES: u64 = 512 << 20;

/// What code generation reads, and its SHA-256.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheKey {
    material: Vec<u8>,
    digest: [u8; 32],
}

impl CacheKey {
    /// The key of a CPU partition's code for `target`.
    pub fn native(module: &Module, keep: &[NodeId], target: &NativeTarget) -> CacheKey {
        CacheKey::native_group(&[(module, keep)], target)
    }

    /// The key of the code of CPU partitions compiled together (`dfc_codegen::compile_group`).
    pub fn native_group(parts: &[(&Module, &[NodeId])], target: &NativeTarget) -> CacheKey {
        let materials: Vec<Vec<u8>> =
            parts.iter().map(|(module, keep)| CacheKey::partition_material(module, keep)).collect();
        CacheKey::native_of(&materials, target)
    }

    /// [`CacheKey::native_group`] from the parts' [`CacheKey::partition_material`]s, for a
    /// caller that has them already.
    pub fn native_of(materials: &[Vec<u8>], target: &NativeTarget) -> CacheKey {
        CacheKey::new("cpu", &[&target.triple, &target.cpu, &target.features, crate::llvm_pipeline()], materials)
    }

    /// The key of a GPU partition's PTX.
    pub fn gpu(module: &Module, keep: &[NodeId]) -> CacheKey {
        CacheKey::new("gpu", &[crate::GPU_ARCH], &[CacheKey::partition_material(module, keep)])
    }

    /// What a partition contributes to a key: its kernel roots kept and its IR without names
    /// (`anonymous`). Equal material, equal code.
    pub fn partition_material(module: &Module, keep: &[NodeId]) -> Vec<u8> {
        let mut material = Vec::new();
        push_field(&mut material, &keep.iter().flat_map(|id| (id.index() as u64).to_le_bytes()).collect::<Vec<u8>>());
        // Serializing our own IR into memory cannot fail for want of data.
        push_field(&mut material, &postcard::to_allocvec(&anonymous(module)).expect("a Module always serializes"));
        material
    }

    fn new(kind: &str, target: &[&str], parts: &[Vec<u8>]) -> CacheKey {
        let mut material = Vec::new();
        push_field(&mut material, build_identity().as_bytes());
        push_field(&mut material, kind.as_bytes());
        for part in target {
            push_field(&mut material, part.as_bytes());
        }
        push_field(&mut material, &(parts.len() as u64).to_le_bytes());
        for part in parts {
            push_field(&mut material, part);
        }
        let digest = Sha256::digest(&material).into();
        CacheKey { material, digest }
    }

    pub fn digest(&self) -> &[u8; 32] {
        &self.digest
    }

    /// Lower-case hex of the digest.
    pub fn hex(&self) -> String {
        self.digest.iter().map(|b| format!("{b:02x}")).collect()
    }
}

/// dfc's version, LLVM's major version, and this executable's identity (device, inode, size, modification
/// time): a rebuilt or upgraded dfc makes new keys.
fn build_identity() -> &'static str {
    static IDENTITY: OnceLock<String> = OnceLock::new();
    IDENTITY.get_or_init(|| {
        let executable = std::env::current_exe()
            .and_then(|path| std::fs::metadata(&path).map(|m| (path, m)))
            .map(|(path, m)| {
                use std::os::unix::fs::MetadataExt;
                format!("{} {}:{} {} {}.{}", path.display(), m.dev(), m.ino(), m.size(), m.mtime(), m.mtime_nsec())
            })
            .unwrap_or_else(|_| "unknown executable".into());
        // inkwell links LLVM 14 (`llvm14-0`), whose bitcode any 14.x reads.
        format!("dfc {} llvm 14 {executable}", env!("CARGO_PKG_VERSION"))
    })
}

/// Whether an entry came from the cache or was generated now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Origin {
    Cached,
    Generated,
}

/// The disk cache, or none.
#[derive(Clone, Debug)]
pub struct CodeCache {
    dir: Option<PathBuf>,
    max_bytes: u64,
}

impl CodeCache {
    /// The cache in `dir` (created when first written).
    pub fn in_dir(dir: impl Into<PathBuf>) -> CodeCache {
        CodeCache { dir: Some(dir.into()), max_bytes: MAX_CACHE_BYTES }
    }

    /// No disk cache: every load generates its code.
    pub fn disabled() -> CodeCache {
        CodeCache { dir: None, max_bytes: MAX_CACHE_BYTES }
    }

    /// The user's cache: see [`CACHE_DIR_VARIABLE`].
    pub fn from_env() -> CodeCache {
        let var = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty()).map(PathBuf::from);
        let dir = match var(CACHE_DIR_VARIABLE) {
            Some(dir) if dir.as_os_str() == "off" => None,
            Some(dir) => Some(dir),
            None => var("XDG_CACHE_HOME")
                .filter(|d| d.is_absolute())
                .or_else(|| var("HOME").map(|home| home.join(".cache")))
                .map(|d| d.join("dfc").join("code")),
        };
        CodeCache { dir, max_bytes: MAX_CACHE_BYTES }
    }

    /// The same cache, holding at most `max_bytes` (see [`MAX_CACHE_BYTES`]).
    pub fn with_max_bytes(self, max_bytes: u64) -> CodeCache {
        CodeCache { max_bytes, ..self }
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    /// The code of a CPU partition for `target` (whose key is `key`, from
    /// [`CacheKey::native`]), from the cache or generated (and then stored).
    pub fn native(
        &self,
        key: &CacheKey,
        module: &Module,
        keep: &[NodeId],
        target: &NativeTarget,
    ) -> Result<(NativeCode, Origin), CodegenError> {
        self.native_group(key, &[(module, keep)], target)
    }

    /// The code of CPU partitions compiled together (key from [`CacheKey::native_group`]).
    pub fn native_group(
        &self,
        key: &CacheKey,
        parts: &[(&Module, &[NodeId])],
        target: &NativeTarget,
    ) -> Result<(NativeCode, Origin), CodegenError> {
        self.get_or_make(key, || crate::compile_group(parts, target))
    }

    /// A GPU partition's PTX, from the cache or generated.
    pub fn gpu(&self, module: &Module, keep: &[NodeId]) -> Result<(GpuCode, Origin), CodegenError> {
        let key = CacheKey::gpu(module, keep);
        self.get_or_make(&key, || crate::compile_gpu(module, keep))
    }

    fn get_or_make<T: Serialize + DeserializeOwned>(
        &self,
        key: &CacheKey,
        make: impl FnOnce() -> Result<T, CodegenError>,
    ) -> Result<(T, Origin), CodegenError> {
        let Some(dir) = &self.dir else {
            return Ok((make()?, Origin::Generated));
        };
        let path = dir.join(format!("{}.code", key.hex()));
        if let Some(code) = read_entry(&path, key) {
            // Its modification time says when it was last used, for eviction.
            let _ = std::fs::File::open(&path).and_then(|f| f.set_modified(std::time::SystemTime::now()));
            return Ok((code, Origin::Cached));
        }
        let code = make()?;
        // A cache that cannot be written (read-only home, full disk) only costs time.
        if write_entry(dir, &path, key, &code).is_ok() {
            evict(dir, self.max_bytes);
        }
        Ok((code, Origin::Generated))
    }
}

/// Removes the entries of `dir` used longest ago while it holds more than `max_bytes`, down to
/// three quarters of it. Entries another process removes meanwhile are simply gone.
fn evict(dir: &Path, max_bytes: u64) {
    let Ok(listing) = std::fs::read_dir(dir) else { return };
    let mut entries: Vec<(std::time::SystemTime, u64, PathBuf)> = listing
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "code"))
        .filter_map(|e| {
            let meta = e.metadata().ok()?;
            Some((meta.modified().ok()?, meta.len(), e.path()))
        })
        .collect();
    let mut total: u64 = entries.iter().map(|e| e.1).sum();
    if total <= max_bytes {
        return;
    }
    entries.sort();
    for (_, len, path) in entries {
        if total <= max_bytes / 4 * 3 {
            break;
        }
        if std::fs::remove_file(&path).is_ok() {
            total -= len;
        }
    }
}

/// The entry at `path` if it is whole and is for `key`.
fn read_entry<T: DeserializeOwned>(path: &Path, key: &CacheKey) -> Option<T> {
    let bytes = read_bounded(path)?;
    let (body, checksum) = bytes.split_at_checked(bytes.len().checked_sub(32)?)?;
    if Sha256::digest(body).as_slice() != checksum {
        return None;
    }
    let body = body.strip_prefix(MAGIC.as_slice())?;
    let (stored_key, rest) = length_prefixed(body)?;
    if stored_key != key.material.as_slice() {
        return None;
    }
    let (code, rest) = length_prefixed(rest)?;
    if !rest.is_empty() {
        return None;
    }
    postcard::from_bytes(code).ok()
}

fn read_bounded(path: &Path) -> Option<Vec<u8>> {
    use std::io::Read as _;
    let file = std::fs::File::open(path).ok()?;
    if file.metadata().ok()?.len() > MAX_ENTRY_BYTES {
        return None;
    }
    let mut bytes = Vec::new();
    file.take(MAX_ENTRY_BYTES).read_to_end(&mut bytes).ok()?;
    Some(bytes)
}

/// A u64-length-prefixed field and what follows it.
fn length_prefixed(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let (len, rest) = bytes.split_at_checked(8)?;
    let len = usize::try_from(u64::from_le_bytes(len.try_into().ok()?)).ok()?;
    rest.split_at_checked(len)
}

/// Writes the entry atomically (a temporary file renamed into place), in a directory only the
/// user can open.
fn write_entry<T: Serialize>(dir: &Path, path: &Path, key: &CacheKey, code: &T) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
    let code = postcard::to_allocvec(code).map_err(std::io::Error::other)?;
    let mut entry = Vec::with_capacity(8 + 16 + key.material.len() + code.len() + 32);
    entry.extend_from_slice(MAGIC);
    for field in [&key.material, &code] {
        entry.extend_from_slice(&(field.len() as u64).to_le_bytes());
        entry.extend_from_slice(field);
    }
    let checksum = Sha256::digest(&entry);
    entry.extend_from_slice(&checksum);
    let tmp = dir.join(format!(".{}.{}.tmp", key.hex(), std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(&entry)?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// `bytes`' length, then `bytes`: fields that delimit themselves.
fn push_field(material: &mut Vec<u8>, bytes: &[u8]) {
    material.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    material.extend_from_slice(bytes);
}

/// `module` without what places it in a plan: node names (kernels' function names come from
/// them, but nothing finds a kernel by them outside its own code), devices, the keys and peers
/// of transfers and all-reduces, and replica indices. Kernels read none of these.
fn anonymous(module: &Module) -> Module {
    let mut module = module.clone();
    let ids: Vec<NodeId> = module.graph.node_ids().collect();
    for id in ids {
        let node = module.graph.node_mut(id);
        node.name.clear();
        node.device = None;
        node.requested_device = None;
        match &mut node.op {
            Op::Send { key, to } => {
                key.clear();
                *to = DeviceSpec::default();
            }
            Op::Recv { key, from, .. } => {
                key.clear();
                *from = DeviceSpec::default();
            }
            Op::AllReduce { key, replica, .. } => {
                key.clear();
                *replica = 0;
            }
            _ => {}
        }
    }
    module
}

#[cfg(test)]
mod tests {
    use super::*;

    fn module() -> Module {
        let source = "model m { input x: f32[4, 3]\n let y = exp(x) * 2.0 + 1.0\n output y }";
        let (module, diagnostics) = dfc_sema::compile_source(source, None, &Default::default());
        module.unwrap_or_else(|| panic!("{diagnostics:?}"))
    }

    #[test]
    fn a_cached_entry_is_used_only_for_its_key_and_only_when_whole() {
        let dir = tempfile::tempdir().unwrap();
        let cache = CodeCache::in_dir(dir.path());
        let module = module();
        let target = crate::host_target();
        let key = CacheKey::native(&module, &[], &target);
        let (code, origin) = cache.native(&key, &module, &[], &target).unwrap();
        assert_eq!(origin, Origin::Generated);
        let (again, origin) = cache.native(&key, &module, &[], &target).unwrap();
        assert_eq!((origin, &again), (Origin::Cached, &code));

        // Names are not part of it; what a kernel computes is.
        let mut renamed = module.clone();
        let first = renamed.graph.node_ids().next().unwrap();
        renamed.graph.node_mut(first).name = "replica_7/x".into();
        assert_eq!(CacheKey::native(&renamed, &[], &target), key);
        let mut changed = module.clone();
        let exp = changed.graph.node_ids().find(|&id| matches!(changed.graph.node(id).op, Op::Unary(_))).unwrap();
        changed.graph.node_mut(exp).op = Op::Unary(dfc_ir::UnaryOp::Log);
        assert_ne!(CacheKey::native(&changed, &[], &target), key);

        // Another target is another key.
        let other = NativeTarget { features: format!("{},-avx512f", target.features), ..target.clone() };
        assert_ne!(CacheKey::native(&module, &[], &other), key);

        // A flipped byte anywhere in the entry: generated again, and the entry repaired.
        let path = dir.path().join(format!("{}.code", key.hex()));
        let whole = std::fs::read(&path).unwrap();
        for at in [3, 20, whole.len() / 2, whole.len() - 1] {
            let mut damaged = whole.clone();
            damaged[at] ^= 0x10;
            std::fs::write(&path, &damaged).unwrap();
            let (code_again, origin) = cache.native(&key, &module, &[], &target).unwrap();
            assert_eq!((origin, &code_again), (Origin::Generated, &code), "flip at {at}");
            assert_eq!(std::fs::read(&path).unwrap(), whole);
        }

        // An entry whose name matches but whose stored key differs (a collision, or a file
        // put there by hand) is not used.
        let other_key = CacheKey::native(&module, &[], &other);
        let other_path = dir.path().join(format!("{}.code", other_key.hex()));
        std::fs::copy(&path, &other_path).unwrap();
        assert!(read_entry::<NativeCode>(&other_path, &other_key).is_none());
        assert!(read_entry::<NativeCode>(&path, &key).is_some());
    }

    #[test]
    fn the_cache_keeps_to_its_size_by_removing_what_was_used_longest_ago() {
        let dir = tempfile::tempdir().unwrap();
        let module = module();
        let target = crate::host_target();
        // Distinct keys for the same code: other kept roots.
        let keys: Vec<Vec<NodeId>> = module.graph.node_ids().map(|id| vec![id]).take(4).collect();
        let cache = CodeCache::in_dir(dir.path());
        let (code, _) =
            cache.native(&CacheKey::native(&module, &keys[0], &target), &module, &keys[0], &target).unwrap();
        let entry_bytes = std::fs::read_dir(dir.path()).unwrap().next().unwrap().unwrap().metadata().unwrap().len();
        assert!(entry_bytes > code.objects.iter().map(Vec::len).sum::<usize>() as u64);
        // Room for three entries: the fourth write evicts down to two, the oldest-used first.
        let cache = cache.with_max_bytes(3 * entry_bytes + entry_bytes / 2);
        let used = |i: usize| {
            let key = CacheKey::native(&module, &keys[i], &target);
            std::thread::sleep(std::time::Duration::from_millis(20));
            cache.native(&key, &module, &keys[i], &target).unwrap().1
        };
        assert_eq!(used(1), Origin::Generated);
        assert_eq!(used(2), Origin::Generated);
        assert_eq!(used(0), Origin::Cached, "entry 0 is used again, so 1 is the oldest used");
        assert_eq!(used(3), Origin::Generated);
        let left = std::fs::read_dir(dir.path()).unwrap().count();
        assert_eq!(left, 2, "down to three quarters of the limit");
        assert_eq!(used(0), Origin::Cached);
        assert_eq!(used(3), Origin::Cached);
        assert_eq!(used(1), Origin::Generated, "evicted");
    }
}
