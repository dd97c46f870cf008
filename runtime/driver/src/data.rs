//! Data feeds: loading data files into tensors, fitting them to the model's inputs, and cutting
//! them into batches.
//!
//! Every loaded tensor has the **example axis** first: an MNIST image file of 60000 28×28 images
//! loads as `u8[60000,28,28]`, its label file as `u8[60000]`, a CSV file of 150 rows of 4
//! numbers as `f32[150,4]`.
//!
//! Formats, chosen by content first and by file name second (see [`load`]):
//!
//! - **IDX** (the MNIST format): magic `00 00 TT NN` (type byte, number of dimensions),
//!   big-endian `u32` sizes, then big-endian data. Types `08` u8, `09` i8 → i32, `0B` i16 → i32,
//!   `0C` i32, `0D` f32, `0E` f64.
//! - **NumPy `.npy`**, format versions 1.0, 2.0 and 3.0, C order (see [`crate::npy`]).
//! - **CSV**: numbers, one example per row, with an optional header line (see [`load_csv`]).
//!
//! Any of them may be gzip-compressed; compression is recognised by the gzip magic bytes
//! `1f 8b`, not by the file name.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::{Path, PathBuf};

use dfc_interp::{Data, Tensor};
use dfc_ir::{DType, Shape, TensorType};
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha12Rng;

/// What went wrong loading, fitting or batching data. Every message names the file or feed.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be read at all.
    #[error("cannot read {}: {source}", path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file was read but its content is not valid data.
    #[error("{}: {message}", path.display())]
    Format { path: PathBuf, message: String },
    /// A bad field of a CSV file, at a 1-based row (line) and column.
    #[error("{}:{row}:{column}: {message}", path.display())]
    At { path: PathBuf, row: u64, column: usize, message: String },
    /// A feed does not fit the model, or the feeds do not fit each other.
    #[error("feed `{name}`: {message}")]
    Feed { name: String, message: String },
}

impl DataError {
    pub(crate) fn format(path: &Path, message: impl Into<String>) -> DataError {
        DataError::Format { path: path.to_path_buf(), message: message.into() }
    }

    fn feed(name: &str, message: impl Into<String>) -> DataError {
        DataError::Feed { name: name.to_string(), message: message.into() }
    }
}

const GZIP_MAGIC: [u8; 2] = [0x1f, 0x8b];

/// The bytes of `path`, gunzipped if they start with the gzip magic bytes.
pub(crate) fn read_maybe_gzip(path: &Path) -> Result<Vec<u8>, DataError> {
    let bytes = std::fs::read(path).map_err(|source| DataError::Io { path: path.to_path_buf(), source })?;
    if !bytes.starts_with(&GZIP_MAGIC) {
        return Ok(bytes);
    }
    let mut out = Vec::new();
    flate2::read::MultiGzDecoder::new(&bytes[..])
        .read_to_end(&mut out)
        .map_err(|e| DataError::format(path, format!("gzip data is corrupt or truncated: {e}")))?;
    Ok(out)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Idx,
    Npy,
    Csv(u8),
}

/// The file name's extension, ignoring a trailing `.gz`, in lower case.
fn extension(path: &Path) -> String {
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    let name = name.strip_suffix(".gz").unwrap_or(&name);
    match name.rsplit_once('.') {
        Some((_, ext)) => ext.to_string(),
        None => String::new(),
    }
}

fn detect(path: &Path, bytes: &[u8]) -> Result<Format, DataError> {
    if bytes.starts_with(crate::npy::MAGIC) {
        return Ok(Format::Npy);
    }
    let name = path.file_name().map(|n| n.to_string_lossy().to_lowercase()).unwrap_or_default();
    match extension(path).as_str() {
        "npy" => return Ok(Format::Npy),
        "csv" | "txt" => return Ok(Format::Csv(b',')),
        "tsv" => return Ok(Format::Csv(b'\t')),
        "idx" | "ubyte" => return Ok(Format::Idx),
        _ if name.contains("-idx") => return Ok(Format::Idx),
        _ => {}
    }
    if bytes.len() >= 4 && bytes[0] == 0 && bytes[1] == 0 {
        return Ok(Format::Idx);
    }
    if !bytes.is_empty() && std::str::from_utf8(bytes).is_ok() {
        return Ok(Format::Csv(b','));
    }
    let head: Vec<String> = bytes.iter().take(8).map(|b| format!("{b:02x}")).collect();
    Err(DataError::format(
        path,
        format!(
            "unrecognised data format (first bytes: {}): expected IDX (magic 00 00 type ndims), \
             NumPy .npy (magic \\x93NUMPY) or CSV text, optionally gzip-compressed",
            if head.is_empty() { "none, the file is empty".to_string() } else { head.join(" ") }
        ),
    ))
}

/// Loads a data file into a tensor whose leading axis is the example axis.
///
/// The format is recognised by content (the `.npy` magic, gzip's magic), then by extension
/// (`.npy`; `.csv`, `.txt`, `.tsv`; `.idx`, `.ubyte` or a name containing `-idx`), then by
/// content again (`00 00` starts IDX, UTF-8 text is CSV). A `.gz` suffix is ignored for this.
/// CSV loads as f32; use [`load_csv`] for another element type.
pub fn load(path: &Path) -> Result<Tensor, DataError> {
    let bytes = read_maybe_gzip(path)?;
    let tensor = match detect(path, &bytes)? {
        Format::Idx => parse_idx(path, &bytes)?,
        Format::Npy => crate::npy::parse(path, &bytes)?,
        Format::Csv(delimiter) => parse_csv(path, &bytes, delimiter, DType::F32)?,
    };
    if tensor.shape.rank() == 0 {
        return Err(DataError::format(path, "holds a single scalar, with no example axis"));
    }
    Ok(tensor)
}

/// Loads an IDX file (raw or gzip).
pub fn load_idx(path: &Path) -> Result<Tensor, DataError> {
    parse_idx(path, &read_maybe_gzip(path)?)
}

/// Loads a NumPy `.npy` file (raw or gzip).
pub fn load_npy(path: &Path) -> Result<Tensor, DataError> {
    crate::npy::parse(path, &read_maybe_gzip(path)?)
}

// ---------------------------------------------------------------------------------------------
// IDX

fn parse_idx(path: &Path, bytes: &[u8]) -> Result<Tensor, DataError> {
    const TYPES: &str = "08 u8, 09 i8, 0B i16, 0C i32, 0D f32, 0E f64";
    if bytes.len() < 4 {
        return Err(DataError::format(
            path,
            format!("truncated IDX header: expected at least 4 bytes, found {}", bytes.len()),
        ));
    }
    if bytes[0] != 0 || bytes[1] != 0 {
        return Err(DataError::format(
            path,
            format!(
                "bad IDX magic {:02x} {:02x} {:02x} {:02x}: an IDX file starts with 00 00, a type byte ({TYPES}) \
                 and the number of dimensions",
                bytes[0], bytes[1], bytes[2], bytes[3]
            ),
        ));
    }
    let (type_name, size): (&str, usize) = match bytes[2] {
        0x08 => ("u8", 1),
        0x09 => ("i8", 1),
        0x0B => ("i16", 2),
        0x0C => ("i32", 4),
        0x0D => ("f32", 4),
        0x0E => ("f64", 8),
        t => return Err(DataError::format(path, format!("bad IDX magic: unknown type byte {t:02x} (known: {TYPES})"))),
    };
    let ndims = usize::from(bytes[3]);
    if ndims == 0 {
        return Err(DataError::format(path, "IDX file has 0 dimensions; it needs at least one, the example axis"));
    }
    let header_len = 4 + 4 * ndims;
    if bytes.len() < header_len {
        return Err(DataError::format(
            path,
            format!("truncated IDX header: {ndims} dimensions need {header_len} header bytes, found {}", bytes.len()),
        ));
    }
    let dims: Vec<usize> = bytes[4..header_len]
        .chunks_exact(4)
        .map(|c| u32::from_be_bytes(c.try_into().expect("chunks of 4")) as usize)
        .collect();
    let shape = Shape(dims);
    let described = format!("{type_name}{shape}");
    let n_bytes = shape
        .dims()
        .iter()
        .try_fold(size, |n, &d| n.checked_mul(d))
        .ok_or_else(|| DataError::format(path, format!("IDX shape {described} is too large")))?;
    let data = &bytes[header_len..];
    if data.len() < n_bytes {
        return Err(DataError::format(
            path,
            format!("truncated IDX data: {described} needs {n_bytes} bytes, found {}", data.len()),
        ));
    }
    if data.len() > n_bytes {
        return Err(DataError::format(
            path,
            format!(
                "IDX file has {} bytes after the data of {described} ({n_bytes} bytes expected)",
                data.len() - n_bytes
            ),
        ));
    }
    fn be<const N: usize, T>(data: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
        data.chunks_exact(N).map(|c| f(c.try_into().expect("exact chunks"))).collect()
    }
    let data = match bytes[2] {
        0x08 => Data::U8(data.to_vec()),
        0x09 => Data::I32(data.iter().map(|&b| i32::from(b as i8)).collect()),
        0x0B => Data::I32(be(data, i16::from_be_bytes).into_iter().map(i32::from).collect()),
        0x0C => Data::I32(be(data, i32::from_be_bytes)),
        0x0D => Data::F32(be(data, f32::from_be_bytes)),
        _ => Data::F64(be(data, f64::from_be_bytes)),
    };
    Ok(Tensor::new(shape, data))
}

// ---------------------------------------------------------------------------------------------
// CSV

/// Loads a CSV file (raw or gzip) of numbers as a tensor of `dtype`, one row per example.
///
/// - The first line is a header, and skipped, if any of its fields is neither a number nor
///   `true`/`false`.
/// - Every row must have as many fields as the first; fields are trimmed of spaces.
/// - `n` rows of `k > 1` fields load as `[n, k]`; a single column loads as `[n]`.
/// - Integers must be written as integers (`3`, not `3.0`) for integer dtypes, and fit;
///   bool accepts `0`, `1`, `true` and `false`.
/// - A file named `*.tsv` is split at tabs, any other at commas.
pub fn load_csv(path: &Path, dtype: DType) -> Result<Tensor, DataError> {
    let bytes = read_maybe_gzip(path)?;
    let delimiter = if extension(path) == "tsv" { b'\t' } else { b',' };
    parse_csv(path, &bytes, delimiter, dtype)
}

fn looks_like_a_value(field: &str) -> bool {
    field.is_empty()
        || field.parse::<f64>().is_ok()
        || field.eq_ignore_ascii_case("true")
        || field.eq_ignore_ascii_case("false")
}

/// Parses `field` and appends it to `values`; the error says why it is not a value of the type.
fn push_field(values: &mut Data, field: &str) -> Result<(), String> {
    fn int<T: std::str::FromStr>(field: &str, name: &str) -> Result<T, String> {
        field.parse::<T>().map_err(|_| match field.parse::<f64>() {
            Ok(_) => format!("`{field}` is not a valid {name} (an integer in range is needed)"),
            Err(_) => not_a_number(field),
        })
    }
    fn not_a_number(field: &str) -> String {
        if field.is_empty() {
            "empty field where a number is needed".to_string()
        } else {
            format!("`{field}` is not a number")
        }
    }
    match values {
        Data::F32(v) => v.push(field.parse().map_err(|_| not_a_number(field))?),
        Data::F64(v) => v.push(field.parse().map_err(|_| not_a_number(field))?),
        Data::I32(v) => v.push(int(field, "i32")?),
        Data::I64(v) => v.push(int(field, "i64")?),
        Data::U8(v) => v.push(int(field, "u8")?),
        Data::Bool(v) => v.push(match field {
            "0" => false,
            "1" => true,
            _ if field.eq_ignore_ascii_case("false") => false,
            _ if field.eq_ignore_ascii_case("true") => true,
            _ => return Err(format!("`{field}` is not a bool (0, 1, true or false)")),
        }),
    }
    Ok(())
}

fn parse_csv(path: &Path, bytes: &[u8], delimiter: u8, dtype: DType) -> Result<Tensor, DataError> {
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .delimiter(delimiter)
        .trim(csv::Trim::All)
        .from_reader(bytes);
    // Parsed straight into the target type.
    let mut values = Tensor::zeros(&TensorType::new(dtype, vec![0])).data;
    let mut first: Option<(u64, usize)> = None; // line and field count of the first row
    let mut rows = 0usize;
    let mut record = csv::StringRecord::new();
    loop {
        match reader.read_record(&mut record) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => {
                let line = e.position().map(|p| format!("row {}: ", p.line())).unwrap_or_default();
                return Err(DataError::format(path, format!("{line}not valid CSV: {e}")));
            }
        }
        let line = record.position().map(|p| p.line()).unwrap_or(0);
        match first {
            None => {
                first = Some((line, record.len()));
                if !record.iter().all(looks_like_a_value) {
                    continue; // a header
                }
            }
            Some((first_line, n)) if record.len() != n => {
                return Err(DataError::format(
                    path,
                    format!(
                        "row {line} has {} field{} where the first row (row {first_line}) has {n}",
                        record.len(),
                        if record.len() == 1 { "" } else { "s" }
                    ),
                ));
            }
            Some(_) => {}
        }
        for (i, field) in record.iter().enumerate() {
            push_field(&mut values, field).map_err(|message| DataError::At {
                path: path.to_path_buf(),
                row: line,
                column: i + 1,
                message,
            })?;
        }
        rows += 1;
    }
    let Some((_, columns)) = first else {
        return Err(DataError::format(path, "empty CSV file: no rows"));
    };
    if rows == 0 {
        return Err(DataError::format(path, "CSV file has a header but no data rows"));
    }
    let shape = if columns == 1 { vec![rows] } else { vec![rows, columns] };
    Ok(Tensor::new(shape, values))
}

// ---------------------------------------------------------------------------------------------
// Fitting feeds to the model's inputs

/// The type of one example of a tensor (or batch type) whose leading axis is the example axis.
fn per_example(dtype: DType, shape: &Shape) -> TensorType {
    TensorType::new(dtype, shape.dims()[1..].to_vec())
}

/// Checks that the examples of `tensor` fit the model input `name`, whose per-batch type is
/// `expected` (leading axis: the batch), and converts the element type where that loses
/// nothing.
///
/// The per-example shapes (everything but the leading axis) must be equal. Element types are
/// converted only losslessly:
///
/// - always: u8 → i32, i64, f32, f64; i32 → i64, f64; f32 → f64;
/// - when every value is exactly representable in the target (checked value by value):
///   i32 → f32; i64 → i32, f32, f64 (NumPy's default integers are i64, labels usually fit).
///
/// Anything else (f64 → f32, floats → integers, bool ↔ numbers, …) is an error naming the feed
/// and both types.
pub fn fit(name: &str, tensor: Tensor, expected: &TensorType) -> Result<Tensor, DataError> {
    if expected.shape.rank() == 0 {
        return Err(DataError::feed(
            name,
            format!("the model's input `{name}` is a scalar ({expected}) with no batch axis, so examples cannot be fed to it"),
        ));
    }
    if tensor.shape.rank() == 0 {
        return Err(DataError::feed(name, format!("the data is a scalar ({}), with no example axis", tensor.ty())));
    }
    let have = per_example(tensor.dtype(), &tensor.shape);
    let want = per_example(expected.dtype, &expected.shape);
    let batch = expected.shape.dims()[0];
    let mismatch =
        || format!("examples are {have} but the model's input `{name}` takes {want} per example (batch {batch})");
    if have.shape != want.shape {
        return Err(DataError::feed(name, mismatch()));
    }
    if have.dtype == want.dtype {
        return Ok(tensor);
    }
    convert(tensor, want.dtype).map_err(|why| DataError::feed(name, format!("{}; {why}", mismatch())))
}

/// Converts `tensor` to `to` if no value changes; the error says why not.
fn convert(tensor: Tensor, to: DType) -> Result<Tensor, String> {
    let from = tensor.dtype();
    let shape = tensor.shape;
    /// Converts every value, failing at the first that does not survive the round trip.
    fn exact<A: Copy + std::fmt::Display, B>(
        v: &[A],
        to: DType,
        there: impl Fn(A) -> B,
        exact: impl Fn(A, &B) -> bool,
    ) -> Result<Vec<B>, String> {
        v.iter()
            .enumerate()
            .map(|(i, &a)| {
                let b = there(a);
                if exact(a, &b) {
                    Ok(b)
                } else {
                    Err(format!("the value {a} at flat index {i} is not exactly representable as {to}"))
                }
            })
            .collect()
    }
    let data = match (tensor.data, to) {
        (Data::U8(v), DType::I32) => Data::I32(v.into_iter().map(i32::from).collect()),
        (Data::U8(v), DType::I64) => Data::I64(v.into_iter().map(i64::from).collect()),
        (Data::U8(v), DType::F32) => Data::F32(v.into_iter().map(f32::from).collect()),
        (Data::U8(v), DType::F64) => Data::F64(v.into_iter().map(f64::from).collect()),
        (Data::I32(v), DType::I64) => Data::I64(v.into_iter().map(i64::from).collect()),
        (Data::I32(v), DType::F64) => Data::F64(v.into_iter().map(f64::from).collect()),
        (Data::F32(v), DType::F64) => Data::F64(v.into_iter().map(f64::from).collect()),
        (Data::I32(v), DType::F32) => Data::F32(exact(&v, to, |a| a as f32, |a, &b| f64::from(b) == f64::from(a))?),
        (Data::I64(v), DType::I32) => Data::I32(exact(&v, to, |a| a as i32, |a, &b| i64::from(b) == a)?),
        (Data::I64(v), DType::F32) => {
            Data::F32(exact(&v, to, |a| a as f32, |a, &b| b.is_finite() && (b as f64) as i128 == i128::from(a))?)
        }
        (Data::I64(v), DType::F64) => Data::F64(exact(&v, to, |a| a as f64, |a, &b| b as i128 == i128::from(a))?),
        _ => {
            let hint = if from.is_float() && to.is_float() {
                format!(" (it may lose precision; convert the data to {to} before feeding it)")
            } else {
                String::new()
            };
            return Err(format!("{from} → {to} is not a lossless conversion{hint}"));
        }
    };
    Ok(Tensor::new(shape, data))
}

// ---------------------------------------------------------------------------------------------
// Datasets and batches

/// The feeds of one run: named tensors with the same number of examples (the leading axis).
#[derive(Clone, Debug)]
pub struct Dataset {
    tensors: Vec<(String, Tensor)>,
    len: usize,
}

impl Dataset {
    /// A dataset of `feeds`; each must have an example axis, names must be distinct, and all
    /// must have the same number of examples.
    pub fn new(feeds: Vec<(String, Tensor)>) -> Result<Dataset, DataError> {
        let mut seen = HashSet::new();
        let mut len: Option<(&str, usize)> = None;
        for (name, tensor) in &feeds {
            if !seen.insert(name.as_str()) {
                return Err(DataError::feed(name, "is given more than once"));
            }
            let Some(&n) = tensor.shape.dims().first() else {
                return Err(DataError::feed(name, format!("is a scalar ({}), with no example axis", tensor.ty())));
            };
            match len {
                None => len = Some((name, n)),
                Some((first, m)) if m != n => {
                    return Err(DataError::feed(
                        name,
                        format!("has {n} examples but feed `{first}` has {m}; every feed needs the same number"),
                    ))
                }
                Some(_) => {}
            }
        }
        let len = len.map_or(0, |(_, n)| n);
        Ok(Dataset { tensors: feeds, len })
    }

    /// The number of examples.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The feeds, in the order given to [`Dataset::new`].
    pub fn tensors(&self) -> &[(String, Tensor)] {
        &self.tensors
    }

    /// The feed names, in the order given to [`Dataset::new`].
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.iter().map(|(name, _)| name.as_str())
    }

    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.tensors.iter().find(|(n, _)| n == name).map(|(_, t)| t)
    }

    /// How many full batches of `batch` examples one epoch has: `len / batch` (see
    /// [`Dataset::batches`] on the remainder); 0 if `batch` is 0.
    pub fn num_batches(&self, batch: usize) -> usize {
        self.len.checked_div(batch).unwrap_or(0)
    }

    /// The examples at `indices`, in that order, as one tensor per feed.
    ///
    /// Panics if an index is out of range.
    pub fn gather(&self, indices: &[usize]) -> HashMap<String, Tensor> {
        self.tensors.iter().map(|(name, t)| (name.clone(), gather_rows(t, indices))).collect()
    }

    /// The batches of one epoch: consecutive runs of `batch` indices of `order` (a permutation
    /// such as [`shuffled_order`] gives, or `0..len` for a fixed order), each gathered into one
    /// tensor per feed of `batch` examples.
    ///
    /// **The remainder is dropped**: the last `order.len() % batch` examples form no batch,
    /// because the batch size is fixed when the model is compiled and a short batch would not
    /// fit its inputs. With a shuffled order each epoch drops different examples.
    ///
    /// Panics if `batch` is 0 or an index of `order` is out of range.
    pub fn batches<'a>(
        &'a self,
        batch: usize,
        order: &'a [usize],
    ) -> impl Iterator<Item = HashMap<String, Tensor>> + 'a {
        assert!(batch > 0, "the batch size must be positive");
        if let Some(&bad) = order.iter().find(|&&i| i >= self.len) {
            panic!("example index {bad} is out of range for a dataset of {} examples", self.len);
        }
        order.chunks_exact(batch).map(move |indices| self.gather(indices))
    }
}

fn gather_rows(tensor: &Tensor, indices: &[usize]) -> Tensor {
    let row: usize = tensor.shape.dims()[1..].iter().product();
    fn gather<T: Copy>(v: &[T], row: usize, indices: &[usize]) -> Vec<T> {
        let mut out = Vec::with_capacity(row * indices.len());
        for &i in indices {
            out.extend_from_slice(&v[i * row..(i + 1) * row]);
        }
        out
    }
    let data = match &tensor.data {
        Data::F32(v) => Data::F32(gather(v, row, indices)),
        Data::F64(v) => Data::F64(gather(v, row, indices)),
        Data::I32(v) => Data::I32(gather(v, row, indices)),
        Data::I64(v) => Data::I64(gather(v, row, indices)),
        Data::U8(v) => Data::U8(gather(v, row, indices)),
        Data::Bool(v) => Data::Bool(gather(v, row, indices)),
    };
    let mut dims = tensor.shape.dims().to_vec();
    dims[0] = indices.len();
    Tensor::new(dims, data)
}

/// The order of `n` examples in epoch `epoch`: a Fisher–Yates shuffle driven by ChaCha12
/// keyed with `seed` and `epoch`, so every (seed, epoch) gives its own permutation, the same
/// on every machine and in every run (indices are drawn with exact rejection sampling from
/// the raw 64-bit stream, independent of `rand`'s range-sampling algorithm).
pub fn shuffled_order(n: usize, seed: u64, epoch: u64) -> Vec<usize> {
    let mut key = [0u8; 32];
    key[..8].copy_from_slice(&seed.to_le_bytes());
    key[8..16].copy_from_slice(&epoch.to_le_bytes());
    key[16..24].copy_from_slice(b"dfc/shuf");
    let mut rng = ChaCha12Rng::from_seed(key);
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = below(&mut rng, i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

/// A uniform integer in `0..bound` (`bound > 0`), by rejection: values below `2^64 mod bound`
/// are redrawn so that every residue is equally likely.
fn below(rng: &mut impl RngCore, bound: u64) -> u64 {
    let threshold = bound.wrapping_neg() % bound;
    loop {
        let x = rng.next_u64();
        if x >= threshold {
            return x % bound;
        }
    }
}
