//! NumPy `.npy` files: reading (format versions 1.0, 2.0 and 3.0) and writing (1.0).
//!
//! A file is the magic `\x93NUMPY`, a major and minor version byte, the header length
//! (`u16` little-endian in 1.0, `u32` in 2.0 and 3.0), a header that is a Python dict literal
//! (`{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }`, Latin-1 in 1.0/2.0, UTF-8 in
//! 3.0) padded with spaces and ended by a newline, then the raw data.
//!
//! Supported dtypes (`descr`): `<f4` `<f8` `<i4` `<i8` `|u1` `|b1` as themselves, and `|i1`
//! `<i2` `<u2` widened to i32, `<u4` widened to i64. Big-endian (`>`) variants of the same are
//! read too. Only C-order arrays are read: a Fortran-order array of rank 2 or more is an error.

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;

use dfc_interp::{Data, Tensor};
use dfc_ir::{DType, Shape};

use crate::data::{shown, DataError, Stream};

pub(crate) const MAGIC: &[u8] = b"\x93NUMPY";

const SUPPORTED: &str = "<f4 <f8 <i4 <i8 |u1 |b1, and |i1 <i2 <u2 (read as i32) and <u4 (read as i64)";

/// A value of the header's Python literal.
#[derive(Debug)]
enum Py {
    Str(String),
    Int(u64),
    Bool(bool),
    None,
    Tuple(Vec<Py>),
    List(Vec<Py>),
    Dict(Vec<(Py, Py)>),
}

impl std::fmt::Display for Py {
    /// Python's `repr` of the value, near enough for messages.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        fn items(f: &mut std::fmt::Formatter<'_>, items: &[Py]) -> std::fmt::Result {
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    f.write_str(", ")?;
                }
                write!(f, "{item}")?;
            }
            Ok(())
        }
        match self {
            Py::Str(s) => write!(f, "'{s}'"),
            Py::Int(n) => write!(f, "{n}"),
            Py::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            Py::None => f.write_str("None"),
            Py::Tuple(v) if v.len() == 1 => write!(f, "({},)", v[0]),
            Py::Tuple(v) => {
                f.write_str("(")?;
                items(f, v)?;
                f.write_str(")")
            }
            Py::List(v) => {
                f.write_str("[")?;
                items(f, v)?;
                f.write_str("]")
            }
            Py::Dict(v) => {
                f.write_str("{")?;
                for (i, (k, x)) in v.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{k}: {x}")?;
                }
                f.write_str("}")
            }
        }
    }
}

/// The deepest nesting of brackets a header may have. NumPy's own headers nest two deep (the
/// dict and its shape tuple); structured dtypes a few more.
const MAX_DEPTH: usize = 32;

/// The longest header read. NumPy itself refuses headers over 10,000 bytes by default.
const MAX_HEADER_LEN: usize = 1 << 20;

/// A parser for the Python literals that NumPy writes in headers.
///
/// It keeps the open brackets on a stack of its own, at most [`MAX_DEPTH`] deep, rather than
/// recursing: a header is untrusted input, and one of a hundred thousand `[` must be an error,
/// not a stack overflow. (The crates that read `.npy` files, `npyz` with nom and `ndarray-npy`
/// with `py_literal`'s pest grammar, parse headers by unbounded recursion, so dfc keeps this
/// small parser of its own.)
struct Parser<'a> {
    chars: std::iter::Peekable<std::str::Chars<'a>>,
}

/// A bracket being parsed: its items so far.
enum Open {
    Tuple(Vec<Py>),
    List(Vec<Py>),
    /// The items so far and the key whose value comes next.
    Dict(Vec<(Py, Py)>, Option<Py>),
}

impl Open {
    fn close(&self) -> char {
        match self {
            Open::Tuple(_) => ')',
            Open::List(_) => ']',
            Open::Dict(..) => '}',
        }
    }

    fn into_value(self) -> Py {
        match self {
            Open::Tuple(items) => Py::Tuple(items),
            Open::List(items) => Py::List(items),
            Open::Dict(items, _) => Py::Dict(items),
        }
    }
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while self.chars.peek().is_some_and(|c| c.is_whitespace()) {
            self.chars.next();
        }
    }

    fn eat(&mut self, c: char) -> bool {
        self.skip_ws();
        if self.chars.peek() == Some(&c) {
            self.chars.next();
            true
        } else {
            false
        }
    }

    /// One value: a whole literal, brackets and all.
    fn value(&mut self) -> Result<Py, String> {
        let mut open: Vec<Open> = Vec::new();
        loop {
            // A value starts here: an opening bracket (whose items follow) or a scalar.
            self.skip_ws();
            let bracket = match self.chars.peek() {
                Some('(') => Some(Open::Tuple(Vec::new())),
                Some('[') => Some(Open::List(Vec::new())),
                Some('{') => Some(Open::Dict(Vec::new(), None)),
                _ => None,
            };
            let mut done = match bracket {
                Some(bracket) => {
                    if open.len() == MAX_DEPTH {
                        return Err(format!("brackets nested more than {MAX_DEPTH} deep"));
                    }
                    self.chars.next();
                    let close = bracket.close();
                    open.push(bracket);
                    if !self.eat(close) {
                        continue;
                    }
                    open.pop().expect("just pushed").into_value()
                }
                None => self.scalar()?,
            };
            // A value is done: it goes into the innermost bracket, which may then close too.
            loop {
                let Some(innermost) = open.last_mut() else { return Ok(done) };
                match innermost {
                    Open::Tuple(items) | Open::List(items) => items.push(done),
                    Open::Dict(_, key @ None) => {
                        *key = Some(done);
                        if !self.eat(':') {
                            return Err("expected `:` after a dict key".into());
                        }
                        break; // the key's value follows
                    }
                    Open::Dict(items, key @ Some(_)) => items.push((key.take().expect("matched"), done)),
                }
                let close = innermost.close();
                // Items are separated by commas; a trailing comma is allowed.
                let comma = self.eat(',');
                if !self.eat(close) {
                    if comma {
                        break; // another item follows
                    }
                    return Err(format!("expected `,` or `{close}`"));
                }
                done = open.pop().expect("innermost exists").into_value();
            }
        }
    }

    /// A string, number, `True`, `False` or `None`.
    fn scalar(&mut self) -> Result<Py, String> {
        match self.chars.peek().copied() {
            Some(q @ ('\'' | '"')) => {
                self.chars.next();
                let mut s = String::new();
                loop {
                    match self.chars.next() {
                        Some(c) if c == q => return Ok(Py::Str(s)),
                        Some('\\') => s.push(self.chars.next().ok_or("unterminated string")?),
                        Some(c) => s.push(c),
                        None => return Err("unterminated string".into()),
                    }
                }
            }
            Some(c) if c.is_ascii_alphanumeric() => {
                let mut word = String::new();
                while let Some(&c) = self.chars.peek().filter(|c| c.is_ascii_alphanumeric() || **c == '_') {
                    word.push(c);
                    self.chars.next();
                }
                match word.as_str() {
                    "True" => Ok(Py::Bool(true)),
                    "False" => Ok(Py::Bool(false)),
                    "None" => Ok(Py::None),
                    // Python 2 wrote long integers with an `L` suffix.
                    w => w
                        .strip_suffix('L')
                        .unwrap_or(w)
                        .parse()
                        .map(Py::Int)
                        .map_err(|_| format!("unexpected `{}`", shown(w, 40))),
                }
            }
            Some(c) => Err(format!("unexpected `{}`", shown(&c.to_string(), 1))),
            None => Err("unexpected end of header".into()),
        }
    }
}

fn header_error(path: &Path, header: &str, why: impl std::fmt::Display) -> DataError {
    DataError::format(path, format!("bad npy header ({why}): {}", shown(header.trim_end(), 200)))
}

/// How the data of a supported dtype is laid out and what it becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Elem {
    F4,
    F8,
    I4,
    I8,
    U1,
    B1,
    I1,
    I2,
    U2,
    U4,
}

impl Elem {
    fn size(self) -> usize {
        match self {
            Elem::U1 | Elem::B1 | Elem::I1 => 1,
            Elem::I2 | Elem::U2 => 2,
            Elem::F4 | Elem::I4 | Elem::U4 => 4,
            Elem::F8 | Elem::I8 => 8,
        }
    }
}

/// The element and whether it is big-endian, for a `descr` string; `None` if unsupported.
fn parse_descr(descr: &str) -> Option<(Elem, bool)> {
    let (order, code) = match descr.chars().next()? {
        c @ ('<' | '>' | '|' | '=') => (c, &descr[1..]),
        _ => ('|', descr),
    };
    let elem = match code {
        "f4" => Elem::F4,
        "f8" => Elem::F8,
        "i4" => Elem::I4,
        "i8" => Elem::I8,
        "u1" => Elem::U1,
        "b1" => Elem::B1,
        "i1" => Elem::I1,
        "i2" => Elem::I2,
        "u2" => Elem::U2,
        "u4" => Elem::U4,
        _ => return None,
    };
    let big = match order {
        '>' => true,
        '<' => false,
        '=' => cfg!(target_endian = "big"),
        // `|` means "not applicable": only right for one-byte types.
        _ if elem.size() == 1 => false,
        _ => return None,
    };
    Some((elem, big))
}

/// Parses the bytes of a `.npy` file (raw or gzip); `path` is for messages. The entry point
/// for fuzzing the `.npy` reader.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<Tensor, DataError> {
    read(Stream::of_bytes(path, bytes))
}

/// Reads a `.npy` file: the header, checked against the file's size, then the data.
pub(crate) fn read(mut stream: Stream) -> Result<Tensor, DataError> {
    let path = stream.path();
    let bytes = stream.head(12)?;
    if !bytes.starts_with(MAGIC) {
        let head: Vec<String> = bytes.iter().take(6).map(|b| format!("{b:02x}")).collect();
        return Err(DataError::format(
            path,
            format!("bad npy magic [{}]: a .npy file starts with \\x93NUMPY (93 4e 55 4d 50 59)", head.join(" ")),
        ));
    }
    let found = bytes.len();
    let truncated_header = |need: usize, found: usize| {
        DataError::format(path, format!("truncated npy header: expected {need} bytes, found {found}"))
    };
    if found < 10 {
        return Err(truncated_header(10, found));
    }
    let (major, minor) = (bytes[6], bytes[7]);
    let (header_start, header_len) = match major {
        1 => (10, usize::from(u16::from_le_bytes([bytes[8], bytes[9]]))),
        2 | 3 => {
            if found < 12 {
                return Err(truncated_header(12, found));
            }
            (12, u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize)
        }
        _ => {
            return Err(DataError::format(
                path,
                format!("unsupported npy format version {major}.{minor} (1.0, 2.0 and 3.0 are supported)"),
            ))
        }
    };
    if header_len > MAX_HEADER_LEN {
        return Err(DataError::format(
            path,
            format!("npy header of {header_len} bytes is longer than the {MAX_HEADER_LEN} bytes dfc reads"),
        ));
    }
    let data_start = header_start + header_len;
    let bytes = stream.head(data_start)?;
    if bytes.len() < data_start {
        return Err(truncated_header(data_start, bytes.len()));
    }
    let raw = &bytes[header_start..data_start];
    let header: String = if major == 3 {
        std::str::from_utf8(raw).map_err(|_| DataError::format(path, "npy header is not valid UTF-8"))?.to_string()
    } else {
        raw.iter().map(|&b| char::from(b)).collect() // Latin-1
    };
    let mut parser = Parser { chars: header.chars().peekable() };
    let dict = match parser.value() {
        Ok(Py::Dict(items)) => items,
        Ok(_) => return Err(header_error(path, &header, "not a dict")),
        Err(e) => return Err(header_error(path, &header, e)),
    };
    let get = |key: &str| {
        dict.iter()
            .find(|(k, _)| matches!(k, Py::Str(s) if s == key))
            .map(|(_, v)| v)
            .ok_or_else(|| header_error(path, &header, format_args!("no '{key}'")))
    };
    let (elem, big) = match get("descr")? {
        Py::Str(descr) => parse_descr(descr).ok_or_else(|| {
            DataError::format(path, format!("unsupported npy dtype '{}' (supported: {SUPPORTED})", shown(descr, 40)))
        })?,
        other => {
            return Err(DataError::format(
                path,
                format!(
                    "unsupported npy dtype {}: a structured (record) dtype (supported: {SUPPORTED})",
                    shown(&other.to_string(), 200)
                ),
            ))
        }
    };
    let dims: Vec<usize> = match get("shape")? {
        Py::Tuple(items) => items
            .iter()
            .map(|d| match d {
                Py::Int(n) => usize::try_from(*n).map_err(|_| header_error(path, &header, "dimension too large")),
                _ => Err(header_error(path, &header, "'shape' is not a tuple of integers")),
            })
            .collect::<Result<_, _>>()?,
        _ => return Err(header_error(path, &header, "'shape' is not a tuple")),
    };
    let fortran = match get("fortran_order")? {
        Py::Bool(b) => *b,
        _ => return Err(header_error(path, &header, "'fortran_order' is not True or False")),
    };
    let shape = Shape(dims);
    // A Fortran-order array of rank 0 or 1 has the same layout as a C-order one.
    if fortran && shape.rank() > 1 {
        return Err(DataError::format(
            path,
            format!(
                "npy array of shape {shape} is in Fortran order; only C order is supported \
                 (save it with np.save(path, np.ascontiguousarray(a)))"
            ),
        ));
    }
    let descr = match get("descr")? {
        Py::Str(s) => s.as_str(),
        _ => "",
    };
    let n_bytes = shape
        .dims()
        .iter()
        .try_fold(elem.size() as u64, |n, &d| n.checked_mul(d as u64))
        .ok_or_else(|| DataError::format(path, format!("npy shape {shape} is too large: its size overflows")))?;
    let data = stream.body(data_start, n_bytes, "npy", &format!("'{descr}' {shape}"))?;
    fn words<const N: usize, T>(data: &[u8], big: bool, le: fn([u8; N]) -> T, be: fn([u8; N]) -> T) -> Vec<T> {
        let f = if big { be } else { le };
        data.chunks_exact(N).map(|c| f(std::array::from_fn(|i| c[i]))).collect()
    }
    let bytes = data;
    let data = &bytes[..];
    let data = match elem {
        Elem::F4 => Data::F32(words(data, big, f32::from_le_bytes, f32::from_be_bytes)),
        Elem::F8 => Data::F64(words(data, big, f64::from_le_bytes, f64::from_be_bytes)),
        Elem::I4 => Data::I32(words(data, big, i32::from_le_bytes, i32::from_be_bytes)),
        Elem::I8 => Data::I64(words(data, big, i64::from_le_bytes, i64::from_be_bytes)),
        Elem::U1 => Data::U8(bytes),
        Elem::B1 => Data::Bool(data.iter().map(|&b| b != 0).collect()),
        Elem::I1 => Data::I32(data.iter().map(|&b| i32::from(b as i8)).collect()),
        Elem::I2 => {
            Data::I32(words(data, big, i16::from_le_bytes, i16::from_be_bytes).into_iter().map(i32::from).collect())
        }
        Elem::U2 => {
            Data::I32(words(data, big, u16::from_le_bytes, u16::from_be_bytes).into_iter().map(i32::from).collect())
        }
        Elem::U4 => {
            Data::I64(words(data, big, u32::from_le_bytes, u32::from_be_bytes).into_iter().map(i64::from).collect())
        }
    };
    Ok(Tensor::new(shape, data))
}

/// The `descr` NumPy uses for a dtype.
fn descr(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "<f4",
        DType::F64 => "<f8",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::U8 => "|u1",
        DType::Bool => "|b1",
    }
}

/// The header of a `.npy` file for `tensor`: format 1.0 (2.0 only if the header would not fit
/// 1.0's 16-bit length), padded so that the data starts at a multiple of 64 bytes.
fn header(tensor: &Tensor) -> Vec<u8> {
    let dims = tensor.shape.dims();
    let shape = match dims {
        [] => "()".to_string(),
        [n] => format!("({n},)"),
        _ => format!("({})", dims.iter().map(|d| d.to_string()).collect::<Vec<_>>().join(", ")),
    };
    let dict = format!("{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}", descr(tensor.dtype()));
    let v1 = dict.len() + 1 + 63 <= usize::from(u16::MAX);
    let prefix = if v1 { 10 } else { 12 };
    let unpadded = prefix + dict.len() + 1;
    let padding = (64 - unpadded % 64) % 64;
    let header_len = dict.len() + padding + 1;
    let mut out = Vec::with_capacity(prefix + header_len);
    out.extend_from_slice(MAGIC);
    if v1 {
        out.extend_from_slice(&[1, 0]);
        out.extend_from_slice(&(header_len as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&[2, 0]);
        out.extend_from_slice(&(header_len as u32).to_le_bytes());
    }
    out.extend_from_slice(dict.as_bytes());
    out.resize(out.len() + padding, b' ');
    out.push(b'\n');
    out
}

/// The bytes of `tensor` as a `.npy` file (format 1.0, C order, little-endian).
pub fn to_npy_bytes(tensor: &Tensor) -> Vec<u8> {
    let mut out = header(tensor);
    out.extend_from_slice(&tensor.to_le_bytes());
    out
}

/// Writes `tensor` to `path` as a `.npy` file (format 1.0, C order, little-endian) that
/// `numpy.load` reads back with the same dtype and shape.
pub fn save_npy(path: &Path, tensor: &Tensor) -> io::Result<()> {
    let mut file = BufWriter::new(File::create(path)?);
    file.write_all(&header(tensor))?;
    file.write_all(&tensor.to_le_bytes())?;
    file.flush()
}
