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
    /// A value of a feed that the model cannot take (a label outside its one_hot's depth, an
    /// id outside its table), found when the feed is loaded.
    #[error("input `{input}` ({}): {message}", path.display())]
    Value { input: String, path: PathBuf, message: String },
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

/// The most a deflate stream expands: a 258-byte match in 2 bits. A gzip file of n bytes never
/// decompresses to more than `DEFLATE_MAX_RATIO · n` bytes, so a header that declares more data
/// than that is refused before anything is inflated.
const DEFLATE_MAX_RATIO: u64 = 1032;

/// A gzip-compressed CSV file may decompress to at most this many times its size. CSV has no
/// header that declares its size, so this is what bounds a CSV gzip bomb; real tables of
/// numbers compress far less (a more compressible file loads uncompressed).
pub const CSV_GZIP_MAX_RATIO: u64 = 64;

/// Reads a feed's bytes, from the file itself or from the gzip stream inside it, keeping the
/// bytes read so far (the header, while a format looks at it) and knowing how many bytes the
/// file's size allows the rest to hold, so that a format can refuse a header that declares
/// more data than there is before it reads or allocates for it.
pub(crate) struct Stream<'a> {
    path: &'a Path,
    reader: Box<dyn Read + 'a>,
    /// The bytes read so far and not yet handed out as a body.
    head: Vec<u8>,
    /// The size of the file (compressed, for gzip); `None` where it has none (a pipe).
    file_len: Option<u64>,
    gzip: bool,
}

impl<'a> Stream<'a> {
    /// The bytes of `reader` (a file of `file_len` bytes named `path`, if it has a size),
    /// gunzipped if they start with the gzip magic bytes.
    fn new(path: &'a Path, mut reader: impl Read + 'a, file_len: Option<u64>) -> Result<Stream<'a>, DataError> {
        let mut magic = Vec::with_capacity(2);
        (&mut reader).take(2).read_to_end(&mut magic).map_err(|e| io_error(path, e))?;
        let gzip = magic == GZIP_MAGIC;
        let whole = std::io::Cursor::new(magic).chain(reader);
        let reader: Box<dyn Read + 'a> =
            if gzip { Box::new(flate2::read::MultiGzDecoder::new(whole)) } else { Box::new(whole) };
        Ok(Stream { path, reader, head: Vec::new(), file_len, gzip })
    }

    /// The bytes of `bytes` (the content of a file named `path`), gunzipped if they start with
    /// the gzip magic bytes.
    pub(crate) fn of_bytes(path: &'a Path, bytes: &'a [u8]) -> Stream<'a> {
        Stream::new(path, bytes, Some(bytes.len() as u64)).expect("reading a slice cannot fail")
    }

    /// The file's name, for messages.
    pub(crate) fn path(&self) -> &'a Path {
        self.path
    }

    fn read_error(&self, e: std::io::Error) -> DataError {
        if self.gzip {
            DataError::format(self.path, format!("gzip data is corrupt or truncated: {e}"))
        } else {
            io_error(self.path, e)
        }
    }

    /// The first `n` bytes (fewer if the data ends sooner), reading no more than that.
    pub(crate) fn head(&mut self, n: usize) -> Result<&[u8], DataError> {
        if self.head.len() < n {
            let more = (n - self.head.len()) as u64;
            if let Err(e) = (&mut self.reader).take(more).read_to_end(&mut self.head) {
                return Err(self.read_error(e));
            }
        }
        Ok(&self.head[..n.min(self.head.len())])
    }

    /// The `n` bytes of data that follow a header of `header` bytes, which must end the data:
    /// a body that is shorter or longer is an error naming `what` (e.g. `IDX data: u8[2,3]`)
    /// and the sizes. Checked against the file's size before anything is read: a raw file
    /// must hold exactly that many bytes; a gzip file must be able to. Nothing is read past one
    /// byte after them (a pipe, which has no size, is checked only so).
    pub(crate) fn body(&mut self, header: usize, n: u64, kind: &str, what: &str) -> Result<Vec<u8>, DataError> {
        let path = self.path;
        let truncated = |found: u64| {
            DataError::format(path, format!("truncated {kind} data: {what} needs {n} bytes, found {found}"))
        };
        match self.file_len {
            None => {}
            Some(file_len) if self.gzip => {
                let most = DEFLATE_MAX_RATIO.saturating_mul(file_len);
                if n > most {
                    return Err(DataError::format(
                        path,
                        format!(
                            "the header declares {what}, {n} bytes of data, more than a gzip file of {file_len} bytes \
                         can hold (at most {most} bytes decompressed)"
                        ),
                    ));
                }
            }
            Some(file_len) => {
                let found = file_len.saturating_sub(header as u64);
                if found < n {
                    return Err(truncated(found));
                }
                if found > n {
                    return Err(DataError::format(
                        path,
                        format!("{kind} file has {} bytes after the data of {what} ({n} bytes expected)", found - n),
                    ));
                }
            }
        }
        let size = usize::try_from(n)
            .map_err(|_| DataError::format(path, format!("{what} ({n} bytes) does not fit in memory")))?;
        let mut data = self.head.split_off(header.min(self.head.len()));
        // A raw file holds all of it (checked above); gzip and pipes grow the buffer as they go.
        let justified = self.file_len.is_some() && !self.gzip;
        data.reserve(if justified { size } else { size.min(1 << 20) }.saturating_sub(data.len()));
        let wanted = (size as u64 + 1).saturating_sub(data.len() as u64);
        if let Err(e) = (&mut self.reader).take(wanted).read_to_end(&mut data) {
            return Err(self.read_error(e));
        }
        match data.len().cmp(&size) {
            std::cmp::Ordering::Less => Err(truncated(data.len() as u64)),
            std::cmp::Ordering::Equal => Ok(data),
            std::cmp::Ordering::Greater if self.gzip => Err(DataError::format(
                path,
                format!(
                    "gzip data decompresses to more than the {} bytes its header declares ({kind} header and {what})",
                    header as u64 + n
                ),
            )),
            // The file grew while it was read.
            std::cmp::Ordering::Greater => Err(DataError::format(
                path,
                format!("{kind} file has bytes after the data of {what} ({n} bytes expected)"),
            )),
        }
    }

    /// The rest of the data as a reader (what has been read already first), refusing to yield
    /// more than `CSV_GZIP_MAX_RATIO` times the file's size from a gzip file.
    fn rest(self) -> Rest<'a> {
        let limit = self.file_len.filter(|_| self.gzip).map(|len| CSV_GZIP_MAX_RATIO.saturating_mul(len));
        Rest { reader: std::io::Cursor::new(self.head).chain(self.reader), left: limit, limit, gzip: self.gzip }
    }
}

/// The rest of a [`Stream`] as a reader, stopping (an `io::Error` of kind `FileTooLarge`) where
/// a gzip file has inflated to more than its limit.
struct Rest<'a> {
    reader: std::io::Chain<std::io::Cursor<Vec<u8>>, Box<dyn Read + 'a>>,
    left: Option<u64>,
    limit: Option<u64>,
    gzip: bool,
}

impl Read for Rest<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let Some(left) = self.left else { return self.reader.read(buf) };
        if left == 0 {
            // One byte past the limit means the file is over it; exactly at it is fine.
            let mut probe = [0u8; 1];
            return match self.reader.read(&mut probe)? {
                0 => Ok(0),
                _ => Err(std::io::Error::new(std::io::ErrorKind::FileTooLarge, "over the decompression limit")),
            };
        }
        let n = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let read = self.reader.read(&mut buf[..n])?;
        self.left = Some(left - read as u64);
        Ok(read)
    }
}

/// Text from a file as a message shows it: on one line (control characters escaped), cut to its
/// first `max` characters (marked with `…`) where it is longer.
pub(crate) fn shown(text: &str, max: usize) -> String {
    let mut out = String::new();
    for (i, c) in text.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

fn io_error(path: &Path, source: std::io::Error) -> DataError {
    DataError::Io { path: path.to_path_buf(), source }
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

/// How many bytes content detection looks at: enough to tell UTF-8 text from binary.
const SNIFF: usize = 1024;

fn detect(stream: &mut Stream) -> Result<Format, DataError> {
    let path = stream.path;
    let head = stream.head(SNIFF)?;
    if head.starts_with(crate::npy::MAGIC) {
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
    if head.len() >= 4 && head[0] == 0 && head[1] == 0 {
        return Ok(Format::Idx);
    }
    // Text, but for a character cut at the end of what was looked at.
    let text = match std::str::from_utf8(head) {
        Ok(_) => true,
        Err(e) => e.error_len().is_none() && head.len() == SNIFF,
    };
    if !head.is_empty() && text {
        return Ok(Format::Csv(b','));
    }
    let first: Vec<String> = head.iter().take(8).map(|b| format!("{b:02x}")).collect();
    Err(DataError::format(
        path,
        format!(
            "unrecognised data format (first bytes: {}): expected IDX (magic 00 00 type ndims), \
             NumPy .npy (magic \\x93NUMPY) or CSV text, optionally gzip-compressed",
            if first.is_empty() { "none, the file is empty".to_string() } else { first.join(" ") }
        ),
    ))
}

/// Loads a data file into a tensor whose leading axis is the example axis.
///
/// The format is recognised by content (the `.npy` magic, gzip's magic), then by extension
/// (`.npy`; `.csv`, `.txt`, `.tsv`; `.idx`, `.ubyte` or a name containing `-idx`), then by
/// content again (`00 00` starts IDX, UTF-8 text is CSV). A `.gz` suffix is ignored for this.
/// CSV loads as f32; use [`load_csv`] for another element type.
///
/// Reading is bounded by the file: IDX and `.npy` headers are checked against the file's size
/// before their data is read (a gzip file is inflated no further than its header declares),
/// and a gzip CSV file may decompress to at most [`CSV_GZIP_MAX_RATIO`] times its size.
pub fn load(path: &Path) -> Result<Tensor, DataError> {
    let (file, len) = open(path)?;
    load_stream(Stream::new(path, file, len)?)
}

/// The most bytes a text feed may hold (decompressed): its windows are held in memory.
pub const TEXT_MAX_BYTES: u64 = 1 << 32;

/// A text feed: the bytes of `path` (gunzipped where it is gzip) as tokens, cut into examples
/// of `window` tokens, each starting where the one before ends but one (stride `window - 1`),
/// so that a model reading tokens `0..window - 1` and predicting `1..window` of each example
/// predicts every byte of the file but the first exactly once. A `u8[examples, window]`.
pub fn load_text_windows(path: &Path, window: usize) -> Result<Tensor, DataError> {
    let (file, len) = open(path)?;
    text_windows(Stream::new(path, file, len)?, window)
}

/// [`load_text_windows`] of the bytes of a file named `path`.
pub fn text_windows_of_bytes(path: &Path, bytes: &[u8], window: usize) -> Result<Tensor, DataError> {
    text_windows(Stream::of_bytes(path, bytes), window)
}

fn text_windows(stream: Stream, window: usize) -> Result<Tensor, DataError> {
    let path = stream.path;
    if window < 2 {
        return Err(DataError::format(
            path,
            format!("a text feed's examples need at least 2 tokens (a token and the next), not {window}"),
        ));
    }
    let mut text = Vec::new();
    let read = stream.rest().take(TEXT_MAX_BYTES + 1).read_to_end(&mut text);
    match read {
        Err(e) if e.kind() == std::io::ErrorKind::FileTooLarge => {
            return Err(DataError::format(
                path,
                format!(
                    "gzip text decompresses to more than {CSV_GZIP_MAX_RATIO} times its size; store it uncompressed"
                ),
            ))
        }
        Err(e) => return Err(DataError::format(path, format!("cannot read the text: {e}"))),
        Ok(_) => {}
    }
    if text.len() as u64 > TEXT_MAX_BYTES {
        return Err(DataError::format(path, format!("a text feed holds at most {TEXT_MAX_BYTES} bytes")));
    }
    if text.len() < window {
        return Err(DataError::format(
            path,
            format!("holds {} bytes, fewer than one example of {window} tokens", text.len()),
        ));
    }
    let stride = window - 1;
    let examples = (text.len() - 1) / stride;
    let mut windows = Vec::with_capacity(examples * window);
    for e in 0..examples {
        windows.extend_from_slice(&text[e * stride..e * stride + window]);
    }
    Ok(Tensor::from_vec(vec![examples, window], windows))
}

/// [`load`] of the bytes of a file named `path` (the name is for format detection and
/// messages): the entry point for fuzzing every feed format, gzip included.
pub fn load_bytes(path: &Path, bytes: &[u8]) -> Result<Tensor, DataError> {
    load_stream(Stream::of_bytes(path, bytes))
}

fn load_stream(mut stream: Stream) -> Result<Tensor, DataError> {
    let path = stream.path;
    let tensor = match detect(&mut stream)? {
        Format::Idx => read_idx(stream)?,
        Format::Npy => crate::npy::read(stream)?,
        Format::Csv(delimiter) => read_csv(stream, delimiter, DType::F32)?,
    };
    if tensor.shape.rank() == 0 {
        return Err(DataError::format(path, "holds a single scalar, with no example axis"));
    }
    Ok(tensor)
}

/// The file at `path`, buffered, and its size (`None` for what is not a regular file: a pipe,
/// `<(zcat …)`).
fn open(path: &Path) -> Result<(std::io::BufReader<std::fs::File>, Option<u64>), DataError> {
    let file = std::fs::File::open(path).map_err(|e| io_error(path, e))?;
    let metadata = file.metadata().map_err(|e| io_error(path, e))?;
    let len = metadata.is_file().then_some(metadata.len());
    Ok((std::io::BufReader::with_capacity(1 << 16, file), len))
}

/// Loads an IDX file (raw or gzip).
pub fn load_idx(path: &Path) -> Result<Tensor, DataError> {
    let (file, len) = open(path)?;
    read_idx(Stream::new(path, file, len)?)
}

/// Loads a NumPy `.npy` file (raw or gzip).
pub fn load_npy(path: &Path) -> Result<Tensor, DataError> {
    let (file, len) = open(path)?;
    crate::npy::read(Stream::new(path, file, len)?)
}

// ---------------------------------------------------------------------------------------------
// IDX

/// Parses the bytes of an IDX file (raw or gzip); `path` is for messages. The entry point
/// for fuzzing the IDX reader.
pub fn parse_idx(path: &Path, bytes: &[u8]) -> Result<Tensor, DataError> {
    read_idx(Stream::of_bytes(path, bytes))
}

fn read_idx(mut stream: Stream) -> Result<Tensor, DataError> {
    const TYPES: &str = "08 u8, 09 i8, 0B i16, 0C i32, 0D f32, 0E f64";
    let path = stream.path;
    let magic: [u8; 4] = match *stream.head(4)? {
        [a, b, c, d] => [a, b, c, d],
        ref short => {
            return Err(DataError::format(
                path,
                format!("truncated IDX header: expected at least 4 bytes, found {}", short.len()),
            ))
        }
    };
    if magic[0] != 0 || magic[1] != 0 {
        return Err(DataError::format(
            path,
            format!(
                "bad IDX magic {:02x} {:02x} {:02x} {:02x}: an IDX file starts with 00 00, a type byte ({TYPES}) \
                 and the number of dimensions",
                magic[0], magic[1], magic[2], magic[3]
            ),
        ));
    }
    let (type_name, size): (&str, u64) = match magic[2] {
        0x08 => ("u8", 1),
        0x09 => ("i8", 1),
        0x0B => ("i16", 2),
        0x0C => ("i32", 4),
        0x0D => ("f32", 4),
        0x0E => ("f64", 8),
        t => return Err(DataError::format(path, format!("bad IDX magic: unknown type byte {t:02x} (known: {TYPES})"))),
    };
    let ndims = usize::from(magic[3]);
    if ndims == 0 {
        return Err(DataError::format(path, "IDX file has 0 dimensions; it needs at least one, the example axis"));
    }
    let header_len = 4 + 4 * ndims;
    let header = stream.head(header_len)?;
    if header.len() < header_len {
        return Err(DataError::format(
            path,
            format!("truncated IDX header: {ndims} dimensions need {header_len} header bytes, found {}", header.len()),
        ));
    }
    let dims: Vec<usize> =
        header[4..].chunks_exact(4).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]) as usize).collect();
    let shape = Shape(dims);
    let described = format!("{type_name}{shape}");
    let n_bytes =
        shape.dims().iter().try_fold(size, |n, &d| n.checked_mul(d as u64)).ok_or_else(|| {
            DataError::format(path, format!("IDX shape {described} is too large: its size overflows"))
        })?;
    let data = stream.body(header_len, n_bytes, "IDX", &described)?;
    fn be<const N: usize, T>(data: &[u8], f: fn([u8; N]) -> T) -> Vec<T> {
        data.chunks_exact(N).map(|c| f(std::array::from_fn(|i| c[i]))).collect()
    }
    let data = match magic[2] {
        0x08 => Data::U8(data),
        0x09 => Data::I32(data.iter().map(|&b| i32::from(b as i8)).collect()),
        0x0B => Data::I32(be(&data, i16::from_be_bytes).into_iter().map(i32::from).collect()),
        0x0C => Data::I32(be(&data, i32::from_be_bytes)),
        0x0D => Data::F32(be(&data, f32::from_be_bytes)),
        _ => Data::F64(be(&data, f64::from_be_bytes)),
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
/// - A gzip file may decompress to at most [`CSV_GZIP_MAX_RATIO`] times its size.
///
/// The file is parsed as it is read: memory grows with the values, never past what the
/// file's text holds.
pub fn load_csv(path: &Path, dtype: DType) -> Result<Tensor, DataError> {
    let (file, len) = open(path)?;
    read_csv(Stream::new(path, file, len)?, csv_delimiter(path), dtype)
}

/// Parses the bytes of a CSV file (raw or gzip) named `path` as [`load_csv`] does: the entry
/// point for fuzzing the CSV reader.
pub fn parse_csv(path: &Path, bytes: &[u8], dtype: DType) -> Result<Tensor, DataError> {
    read_csv(Stream::of_bytes(path, bytes), csv_delimiter(path), dtype)
}

fn csv_delimiter(path: &Path) -> u8 {
    if extension(path) == "tsv" {
        b'\t'
    } else {
        b','
    }
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
            Ok(_) => format!("`{}` is not a valid {name} (an integer in range is needed)", shown(field, 40)),
            Err(_) => not_a_number(field),
        })
    }
    fn not_a_number(field: &str) -> String {
        if field.is_empty() {
            "empty field where a number is needed".to_string()
        } else {
            format!("`{}` is not a number", shown(field, 40))
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
            _ => return Err(format!("`{}` is not a bool (0, 1, true or false)", shown(field, 40))),
        }),
    }
    Ok(())
}

fn read_csv(stream: Stream, delimiter: u8, dtype: DType) -> Result<Tensor, DataError> {
    let path = stream.path;
    let rest = stream.rest();
    let mut reader = csv::ReaderBuilder::new()
        .has_headers(false)
        .flexible(true)
        .delimiter(delimiter)
        .trim(csv::Trim::All)
        .from_reader(rest);
    // Parsed straight into the target type.
    let mut values = Tensor::zeros(&TensorType::new(dtype, vec![0])).data;
    let mut first: Option<(u64, usize)> = None; // line and field count of the first row
    let mut rows = 0usize;
    let mut record = csv::StringRecord::new();
    loop {
        match reader.read_record(&mut record) {
            Ok(true) => {}
            Ok(false) => break,
            Err(e) => return Err(csv_error(path, reader.get_ref(), e)),
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

/// What a CSV reader's error means: text that is not CSV (at a row), or the file's bytes
/// failing to come (unreadable, corrupt gzip, or inflating past the limit).
fn csv_error(path: &Path, rest: &Rest, e: csv::Error) -> DataError {
    let row = e.position().map(|p| format!("row {}: ", p.line())).unwrap_or_default();
    let message = e.to_string();
    match e.into_kind() {
        csv::ErrorKind::Io(e) if e.kind() == std::io::ErrorKind::FileTooLarge => DataError::format(
            path,
            format!(
                "gzip data decompresses to more than {} bytes, {CSV_GZIP_MAX_RATIO} times the file's size; \
                 a CSV file that compresses this well must be stored uncompressed (gunzip it)",
                rest.limit.unwrap_or(0)
            ),
        ),
        csv::ErrorKind::Io(e) if rest.gzip => {
            DataError::format(path, format!("gzip data is corrupt or truncated: {e}"))
        }
        csv::ErrorKind::Io(e) => io_error(path, e),
        _ => DataError::format(path, format!("{row}not valid CSV: {message}")),
    }
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
