//! Loading IDX and CSV files (raw and gzip), format detection, `fit`, datasets, batches and
//! shuffling. (`.npy` has its own file, `npy.rs`.)

use std::io::Write;
use std::path::{Path, PathBuf};

use dfc_driver::data::{self, DataError, Dataset};
use dfc_interp::{Data, Tensor};
use dfc_ir::{DType, TensorType};

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

fn idx(type_byte: u8, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, type_byte, dims.len() as u8];
    for d in dims {
        out.extend_from_slice(&d.to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

fn err(result: Result<Tensor, DataError>) -> String {
    match result {
        Ok(t) => panic!("expected an error, loaded {}", t.ty()),
        Err(e) => e.to_string(),
    }
}

fn contains(message: &str, parts: &[&str]) {
    for part in parts {
        assert!(message.contains(part), "message {message:?} lacks {part:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// IDX

/// Every IDX type, raw and gzip, under an IDX-looking name and under a neutral one.
#[test]
fn idx_every_type_raw_and_gzip() {
    let dir = tempfile::tempdir().unwrap();
    let be =
        |v: &[i64], size: usize| -> Vec<u8> { v.iter().flat_map(|&x| x.to_be_bytes()[8 - size..].to_vec()).collect() };
    let cases: Vec<(u8, Vec<u8>, Tensor)> = vec![
        (0x08, vec![0, 1, 127, 128, 255, 7], Tensor::new(vec![2, 3], Data::U8(vec![0, 1, 127, 128, 255, 7]))),
        (0x09, be(&[-128, -1, 0, 1, 127, 5], 1), Tensor::new(vec![2, 3], Data::I32(vec![-128, -1, 0, 1, 127, 5]))),
        (
            0x0B,
            be(&[-32768, -1, 0, 1, 32767, 300], 2),
            Tensor::new(vec![2, 3], Data::I32(vec![-32768, -1, 0, 1, 32767, 300])),
        ),
        (
            0x0C,
            be(&[i32::MIN as i64, -1, 0, 1, i32::MAX as i64, 70000], 4),
            Tensor::new(vec![2, 3], Data::I32(vec![i32::MIN, -1, 0, 1, i32::MAX, 70000])),
        ),
        (
            0x0D,
            [1.5f32, -2.25, 0.0, 1e-7, f32::MAX, -0.5].iter().flat_map(|x| x.to_be_bytes()).collect(),
            Tensor::new(vec![2, 3], Data::F32(vec![1.5, -2.25, 0.0, 1e-7, f32::MAX, -0.5])),
        ),
        (
            0x0E,
            [1.5f64, -2.25, 0.0, 1e-300, f64::MAX, -0.5].iter().flat_map(|x| x.to_be_bytes()).collect(),
            Tensor::new(vec![2, 3], Data::F64(vec![1.5, -2.25, 0.0, 1e-300, f64::MAX, -0.5])),
        ),
    ];
    for (type_byte, payload, expected) in cases {
        let bytes = idx(type_byte, &[2, 3], &payload);
        let raw = write(dir.path(), &format!("t{type_byte:02x}-idx2-ubyte"), &bytes);
        let gz = write(dir.path(), &format!("t{type_byte:02x}-idx2-ubyte.gz"), &gzip(&bytes));
        let neutral = write(dir.path(), &format!("t{type_byte:02x}.bin"), &gzip(&bytes));
        for path in [&raw, &gz, &neutral] {
            assert_eq!(data::load(path).unwrap(), expected, "{}", path.display());
            assert_eq!(data::load_idx(path).unwrap(), expected, "{}", path.display());
        }
    }
}

#[test]
fn idx_rank_one_and_three() {
    let dir = tempfile::tempdir().unwrap();
    let labels = write(dir.path(), "labels", &idx(0x08, &[4], &[3, 1, 4, 1]));
    assert_eq!(data::load(&labels).unwrap(), Tensor::new(vec![4], Data::U8(vec![3, 1, 4, 1])));
    let images: Vec<u8> = (0..2 * 3 * 2).collect();
    let path = write(dir.path(), "images.idx", &gzip(&idx(0x08, &[2, 3, 2], &images)));
    assert_eq!(data::load(&path).unwrap(), Tensor::new(vec![2, 3, 2], Data::U8(images)));
}

#[test]
fn idx_errors() {
    let dir = tempfile::tempdir().unwrap();

    // Truncated data: expected vs actual bytes, also through gzip.
    let mut bytes = idx(0x08, &[10, 28, 28], &vec![0; 10 * 28 * 28]);
    bytes.truncate(bytes.len() - 10);
    let path = write(dir.path(), "short-idx3-ubyte", &bytes);
    let msg = err(data::load(&path));
    contains(&msg, &["short-idx3-ubyte", "truncated IDX data", "u8[10,28,28]", "needs 7840 bytes", "found 7830"]);
    let path = write(dir.path(), "short-idx3-ubyte.gz", &gzip(&bytes));
    contains(&err(data::load(&path)), &["short-idx3-ubyte.gz", "needs 7840 bytes, found 7830"]);

    let path = write(dir.path(), "f32.idx", &idx(0x0D, &[3], &[0; 11]));
    contains(&err(data::load(&path)), &["truncated IDX data: f32[3] needs 12 bytes, found 11"]);

    // Truncated header.
    let path = write(dir.path(), "hdr.idx", &[0, 0, 8, 3, 0, 0, 0, 10]);
    contains(&err(data::load(&path)), &["hdr.idx", "truncated IDX header", "need 16 header bytes, found 8"]);
    let path = write(dir.path(), "tiny.idx", &[0, 0]);
    contains(&err(data::load(&path)), &["truncated IDX header: expected at least 4 bytes, found 2"]);

    // Bad magic.
    let path = write(dir.path(), "magic-idx1-ubyte", &[1, 2, 8, 1, 0, 0, 0, 1, 5]);
    contains(&err(data::load(&path)), &["magic-idx1-ubyte", "bad IDX magic 01 02 08 01"]);
    let path = write(dir.path(), "type.idx", &idx(0x0A, &[1], &[5]));
    contains(&err(data::load(&path)), &["type.idx", "bad IDX magic", "unknown type byte 0a"]);

    // Zero dimensions, trailing bytes.
    let path = write(dir.path(), "zero.idx", &[0, 0, 8, 0, 5]);
    contains(&err(data::load(&path)), &["0 dimensions"]);
    let path = write(dir.path(), "long.idx", &idx(0x08, &[2], &[1, 2, 3]));
    contains(&err(data::load(&path)), &["long.idx", "1 bytes after the data of u8[2]"]);

    // Corrupt gzip.
    let mut gz = gzip(&idx(0x08, &[100], &[7; 100]));
    gz.truncate(gz.len() / 2);
    let path = write(dir.path(), "cut.idx.gz", &gz);
    contains(&err(data::load(&path)), &["cut.idx.gz", "gzip data is corrupt or truncated"]);

    // Hostile sizes: dims whose product overflows, a gzip file declaring more than it can
    // hold, a gzip bomb behind a small header (refused after inflating one byte past it).
    let path = write(dir.path(), "overflow-idx3-ubyte", &idx(0x0E, &[u32::MAX, u32::MAX, u32::MAX], &[]));
    contains(
        &err(data::load(&path)),
        &["overflow-idx3-ubyte", "IDX shape f64[4294967295,4294967295,4294967295] is too large"],
    );
    let path = write(dir.path(), "huge-idx1-ubyte", &idx(0x08, &[u32::MAX], &[1, 2]));
    contains(&err(data::load(&path)), &["truncated IDX data: u8[4294967295] needs 4294967295 bytes, found 2"]);
    let path = write(dir.path(), "huge-idx1-ubyte.gz", &gzip(&idx(0x08, &[u32::MAX], &[1, 2])));
    contains(&err(data::load(&path)), &["huge-idx1-ubyte.gz", "4294967295 bytes of data, more than a gzip file of"]);
    let mut bomb = idx(0x08, &[1000], &[]);
    bomb.resize(50_000_000, 0);
    let path = write(dir.path(), "bomb-idx1-ubyte.gz", &gzip(&bomb));
    contains(
        &err(data::load(&path)),
        &["bomb-idx1-ubyte.gz", "decompresses to more than the 1008 bytes its header declares"],
    );

    // Missing file.
    let msg = err(data::load(&dir.path().join("nope.idx")));
    contains(&msg, &["cannot read", "nope.idx"]);
}

/// A pipe has no size: IDX and gzip IDX are read from one all the same (`<(zcat …)`), checked
/// against what their headers declare.
#[test]
fn idx_from_a_pipe() {
    let dir = tempfile::tempdir().unwrap();
    let bytes = idx(0x08, &[2, 3], &[1, 2, 3, 4, 5, 6]);
    for (name, content, expected) in [
        ("raw", bytes.clone(), Ok(())),
        ("gz", gzip(&bytes), Ok(())),
        ("short", bytes[..14].to_vec(), Err("truncated IDX data: u8[2,3] needs 6 bytes, found 2")),
    ] {
        let fifo = dir.path().join(format!("{name}-idx3-ubyte"));
        let made = std::process::Command::new("mkfifo").arg(&fifo).status().expect("mkfifo");
        assert!(made.success());
        let writer = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::write(fifo, content).unwrap())
        };
        let loaded = data::load(&fifo);
        writer.join().unwrap();
        match expected {
            Ok(()) => assert_eq!(loaded.unwrap(), Tensor::new(vec![2, 3], Data::U8(vec![1, 2, 3, 4, 5, 6])), "{name}"),
            Err(message) => contains(&err(loaded), &[message]),
        }
    }
}

#[test]
fn unrecognised_format() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "blob.bin", &[0xff, 0xfe, 0x00, 0x80, 0x81]);
    contains(&err(data::load(&path)), &["blob.bin", "unrecognised data format", "ff fe 00 80 81"]);
    let path = write(dir.path(), "empty.bin", &[]);
    contains(&err(data::load(&path)), &["empty.bin", "the file is empty"]);
}

// ---------------------------------------------------------------------------------------------
// CSV

#[test]
fn csv_with_and_without_header() {
    let dir = tempfile::tempdir().unwrap();
    let expected = Tensor::new(vec![3, 2], Data::F32(vec![1.0, 2.5, -3.0, 4e-3, 5.0, 6.0]));
    let plain = write(dir.path(), "plain.csv", b"1,2.5\n-3, 4e-3\n5,6\n");
    assert_eq!(data::load(&plain).unwrap(), expected);
    let header = write(dir.path(), "header.csv", b"x,y\n1,2.5\n-3,4e-3\n5,6\n");
    assert_eq!(data::load(&header).unwrap(), expected);
    // Windows line ends, no final newline, gzip, no extension (text).
    let crlf = write(dir.path(), "crlf.csv", b"x,y\r\n1,2.5\r\n-3,4e-3\r\n5,6");
    assert_eq!(data::load(&crlf).unwrap(), expected);
    let gz = write(dir.path(), "data.csv.gz", &gzip(b"1,2.5\n-3,4e-3\n5,6\n"));
    assert_eq!(data::load(&gz).unwrap(), expected);
    let bare = write(dir.path(), "features", b"1,2.5\n-3,4e-3\n5,6\n");
    assert_eq!(data::load(&bare).unwrap(), expected);
    // A header with one numeric-looking field still counts as a header.
    let mixed = write(dir.path(), "mixed.csv", b"x,2\n1,2.5\n-3,4e-3\n5,6\n");
    assert_eq!(data::load(&mixed).unwrap(), expected);
    // Tabs for .tsv.
    let tsv = write(dir.path(), "data.tsv", b"a\tb\n1\t2.5\n-3\t4e-3\n5\t6\n");
    assert_eq!(data::load(&tsv).unwrap(), expected);
    assert_eq!(data::load_csv(&tsv, DType::F32).unwrap(), expected);
}

#[test]
fn csv_single_column_is_rank_one() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "labels.csv", b"label\n3\n1\n4\n");
    assert_eq!(data::load(&path).unwrap(), Tensor::new(vec![3], Data::F32(vec![3.0, 1.0, 4.0])));
    assert_eq!(data::load_csv(&path, DType::I32).unwrap(), Tensor::new(vec![3], Data::I32(vec![3, 1, 4])));
}

#[test]
fn csv_every_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "ints.csv", b"0,1\n255,7\n");
    let cases = [
        (DType::F32, Data::F32(vec![0.0, 1.0, 255.0, 7.0])),
        (DType::F64, Data::F64(vec![0.0, 1.0, 255.0, 7.0])),
        (DType::I32, Data::I32(vec![0, 1, 255, 7])),
        (DType::I64, Data::I64(vec![0, 1, 255, 7])),
        (DType::U8, Data::U8(vec![0, 1, 255, 7])),
    ];
    for (dtype, data) in cases {
        assert_eq!(data::load_csv(&path, dtype).unwrap(), Tensor::new(vec![2, 2], data), "{dtype}");
    }
    let path = write(dir.path(), "bools.csv", b"0,1\ntrue,FALSE\n");
    assert_eq!(
        data::load_csv(&path, DType::Bool).unwrap(),
        Tensor::new(vec![2, 2], Data::Bool(vec![false, true, true, false]))
    );
    let path = write(dir.path(), "big.csv", b"9007199254740993\n-5\n");
    assert_eq!(data::load_csv(&path, DType::I64).unwrap(), Tensor::new(vec![2], Data::I64(vec![9007199254740993, -5])));
}

#[test]
fn csv_errors() {
    let dir = tempfile::tempdir().unwrap();
    // Ragged rows: row N has K fields where the first has M.
    let path = write(dir.path(), "ragged.csv", b"1,2,3\n4,5,6\n7,8\n");
    contains(&err(data::load(&path)), &["ragged.csv", "row 3 has 2 fields where the first row (row 1) has 3"]);
    let path = write(dir.path(), "ragged-header.csv", b"a,b\n1,2\n3,4,5\n");
    contains(&err(data::load(&path)), &["row 3 has 3 fields where the first row (row 1) has 2"]);

    // A non-number at row:column.
    let path = write(dir.path(), "nan.csv", b"a,b\n1,2\n3,x4\n");
    let msg = err(data::load(&path));
    contains(&msg, &["nan.csv:3:2:", "`x4` is not a number"]);
    let path = write(dir.path(), "empty-field.csv", b"1,2\n3,\n");
    contains(&err(data::load(&path)), &["empty-field.csv:2:2:", "empty field"]);
    let path = write(dir.path(), "float.csv", b"1,2\n3,4.5\n");
    contains(&err(data::load_csv(&path, DType::I32)), &["float.csv:2:2:", "`4.5` is not a valid i32"]);
    contains(&err(data::load_csv(&path, DType::U8)), &["float.csv:2:2:", "`4.5` is not a valid u8"]);
    let path = write(dir.path(), "wide.csv", b"1,256\n");
    contains(&err(data::load_csv(&path, DType::U8)), &["wide.csv:1:2:", "`256` is not a valid u8"]);
    let path = write(dir.path(), "bool.csv", b"1,2\n");
    contains(&err(data::load_csv(&path, DType::Bool)), &["bool.csv:1:2:", "`2` is not a bool"]);

    // Nothing to load.
    let path = write(dir.path(), "empty.csv", b"");
    contains(&err(data::load(&path)), &["empty.csv", "no rows"]);
    // A gzip CSV bomb is refused after inflating its limit; as much text uncompressed loads.
    let zeros = "0\n".repeat(1_000_000);
    let packed = gzip(zeros.as_bytes());
    assert!(zeros.len() as u64 > data::CSV_GZIP_MAX_RATIO * packed.len() as u64, "the test needs a bomb");
    let path = write(dir.path(), "bomb.csv.gz", &packed);
    contains(&err(data::load(&path)), &["bomb.csv.gz", "gzip data decompresses to more than", "gunzip it"]);
    let path = write(dir.path(), "zeros.csv", zeros.as_bytes());
    assert_eq!(data::load(&path).unwrap().shape.dims(), [1_000_000]);
    // Bytes that are not UTF-8 in a CSV file.
    let path = write(dir.path(), "latin.csv", b"1,2\n3,\xff\n");
    contains(&err(data::load(&path)), &["latin.csv", "not valid CSV", "UTF-8"]);

    let path = write(dir.path(), "only-header.csv", b"a,b\n");
    contains(&err(data::load(&path)), &["only-header.csv", "header but no data rows"]);
}

// ---------------------------------------------------------------------------------------------
// fit

fn ty(dtype: DType, dims: &[usize]) -> TensorType {
    TensorType::new(dtype, dims.to_vec())
}

#[test]
fn fit_checks_the_per_example_shape() {
    let images = Tensor::new(vec![2, 28, 28], Data::U8(vec![0; 2 * 28 * 28]));
    let e = data::fit("images", images.clone(), &ty(DType::U8, &[128, 32, 32])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "feed `images`: examples are u8[28,28] but the model's input `images` takes u8[32,32] per example (batch 128)"
    );
    // The number of examples need not be the batch size.
    let fitted = data::fit("images", images.clone(), &ty(DType::U8, &[128, 28, 28])).unwrap();
    assert_eq!(fitted, images);
    // Rank differences are shape differences.
    let e = data::fit("images", images, &ty(DType::F32, &[128, 784])).unwrap_err();
    assert_eq!(
        e.to_string(),
        "feed `images`: examples are u8[28,28] but the model's input `images` takes f32[784] per example (batch 128)"
    );
    // Scalars on either side.
    let labels = Tensor::new(vec![3], Data::U8(vec![1, 2, 3]));
    let e = data::fit("labels", labels, &TensorType::scalar(DType::U8)).unwrap_err();
    contains(&e.to_string(), &["feed `labels`", "scalar", "no batch axis"]);
    let scalar = Tensor::new(vec![], Data::F32(vec![1.0]));
    let e = data::fit("x", scalar, &ty(DType::F32, &[4])).unwrap_err();
    contains(&e.to_string(), &["feed `x`", "no example axis"]);
}

#[test]
fn fit_converts_losslessly() {
    let u8s = Tensor::new(vec![3], Data::U8(vec![0, 7, 255]));
    let cases = [
        (DType::I32, Data::I32(vec![0, 7, 255])),
        (DType::I64, Data::I64(vec![0, 7, 255])),
        (DType::F32, Data::F32(vec![0.0, 7.0, 255.0])),
        (DType::F64, Data::F64(vec![0.0, 7.0, 255.0])),
    ];
    for (dtype, data) in cases {
        assert_eq!(data::fit("x", u8s.clone(), &ty(dtype, &[8])).unwrap(), Tensor::new(vec![3], data));
    }
    let i32s = Tensor::new(vec![3], Data::I32(vec![-1, 0, 1 << 24]));
    assert_eq!(data::fit("x", i32s.clone(), &ty(DType::I64, &[8])).unwrap().data, Data::I64(vec![-1, 0, 1 << 24]));
    assert_eq!(
        data::fit("x", i32s.clone(), &ty(DType::F64, &[8])).unwrap().data,
        Data::F64(vec![-1.0, 0.0, 16777216.0])
    );
    assert_eq!(data::fit("x", i32s, &ty(DType::F32, &[8])).unwrap().data, Data::F32(vec![-1.0, 0.0, 16777216.0]));
    let f32s = Tensor::new(vec![2], Data::F32(vec![0.1, -2.5]));
    assert_eq!(data::fit("x", f32s, &ty(DType::F64, &[8])).unwrap().data, Data::F64(vec![0.1f32 as f64, -2.5]));
    // NumPy's default integers: i64 labels that fit i32.
    let i64s = Tensor::new(vec![3], Data::I64(vec![9, 0, -3]));
    assert_eq!(data::fit("labels", i64s.clone(), &ty(DType::I32, &[8])).unwrap().data, Data::I32(vec![9, 0, -3]));
    assert_eq!(data::fit("labels", i64s, &ty(DType::F32, &[8])).unwrap().data, Data::F32(vec![9.0, 0.0, -3.0]));
}

#[test]
fn fit_refuses_lossy_conversions() {
    // i32 → f32 only when every value is exact.
    let i32s = Tensor::new(vec![3], Data::I32(vec![1, (1 << 24) + 1, 2]));
    let e = data::fit("x", i32s, &ty(DType::F32, &[4])).unwrap_err().to_string();
    contains(&e, &["feed `x`", "examples are i32[]", "takes f32[] per example (batch 4)", "16777217 at flat index 1"]);
    let max = Tensor::new(vec![1], Data::I32(vec![i32::MAX]));
    assert!(data::fit("x", max, &ty(DType::F32, &[4])).is_err());
    let i64s = Tensor::new(vec![2], Data::I64(vec![1, 1 << 40]));
    let e = data::fit("labels", i64s, &ty(DType::I32, &[4])).unwrap_err().to_string();
    contains(&e, &["feed `labels`", "1099511627776 at flat index 1", "not exactly representable as i32"]);

    let f64s = Tensor::new(vec![2, 2], Data::F64(vec![0.0; 4]));
    let e = data::fit("x", f64s, &ty(DType::F32, &[4, 2])).unwrap_err().to_string();
    assert_eq!(
        e,
        "feed `x`: examples are f64[2] but the model's input `x` takes f32[2] per example (batch 4); \
         f64 → f32 is not a lossless conversion (it may lose precision; convert the data to f32 before feeding it)"
    );
    let refused = [
        (Data::F32(vec![1.0]), DType::I32),
        (Data::F32(vec![1.0]), DType::U8),
        (Data::I32(vec![1]), DType::U8),
        (Data::U8(vec![1]), DType::Bool),
        (Data::Bool(vec![true]), DType::U8),
        (Data::F64(vec![1.0]), DType::I64),
    ];
    for (data, to) in refused {
        let t = Tensor::new(vec![1], data);
        let from = t.dtype();
        let e = data::fit("v", t, &ty(to, &[2])).unwrap_err().to_string();
        contains(&e, &["feed `v`", &format!("{from} → {to} is not a lossless conversion")]);
    }
}

// ---------------------------------------------------------------------------------------------
// Datasets, batches, shuffling

fn dataset(n: usize) -> Dataset {
    let x = Tensor::new(vec![n, 2], Data::F32((0..2 * n).map(|i| i as f32).collect()));
    let y = Tensor::new(vec![n], Data::I32((0..n as i32).map(|i| i * 10).collect()));
    Dataset::new(vec![("x".to_string(), x), ("y".to_string(), y)]).unwrap()
}

#[test]
fn dataset_checks_example_counts() {
    let x = Tensor::new(vec![5, 2], Data::F32(vec![0.0; 10]));
    let y = Tensor::new(vec![4], Data::U8(vec![0; 4]));
    let e = Dataset::new(vec![("images".into(), x.clone()), ("labels".into(), y)]).unwrap_err();
    assert_eq!(
        e.to_string(),
        "feed `labels`: has 4 examples but feed `images` has 5; every feed needs the same number"
    );
    let e = Dataset::new(vec![("x".into(), x.clone()), ("x".into(), x.clone())]).unwrap_err();
    assert_eq!(e.to_string(), "feed `x`: is given more than once");
    let scalar = Tensor::new(vec![], Data::F32(vec![0.0]));
    let e = Dataset::new(vec![("s".into(), scalar)]).unwrap_err();
    contains(&e.to_string(), &["feed `s`", "no example axis"]);
    let d = Dataset::new(vec![("x".into(), x.clone()), ("y".into(), x)]).unwrap();
    assert_eq!(d.len(), 5);
    assert_eq!(d.names().collect::<Vec<_>>(), ["x", "y"]);
    assert_eq!(d.get("y").unwrap().shape.dims(), [5, 2]);
    assert!(d.get("z").is_none());
    assert!(!d.is_empty());
    assert!(Dataset::new(vec![]).unwrap().is_empty());
}

#[test]
fn batches_gather_rows_in_order_and_drop_the_remainder() {
    let d = dataset(10);
    let order = [9, 0, 3, 4, 8, 1, 2, 7, 6, 5];
    let batches: Vec<_> = d.batches(3, &order).collect();
    assert_eq!(batches.len(), 3, "10 examples in batches of 3: the last one is dropped");
    assert_eq!(d.num_batches(3), 3);
    let b = &batches[0];
    assert_eq!(b["x"], Tensor::new(vec![3, 2], Data::F32(vec![18.0, 19.0, 0.0, 1.0, 6.0, 7.0])));
    assert_eq!(b["y"], Tensor::new(vec![3], Data::I32(vec![90, 0, 30])));
    assert_eq!(batches[2]["y"], Tensor::new(vec![3], Data::I32(vec![20, 70, 60])));
    // Example 5 (the remainder) is in no batch.
    assert!(batches.iter().all(|b| !matches!(&b["y"].data, Data::I32(v) if v.contains(&50))));
    // Exact fit, and fewer examples than a batch.
    assert_eq!(d.batches(5, &order).count(), 2);
    assert_eq!(d.batches(11, &order).count(), 0);
    // Other element types and ranks gather the same.
    let imgs = Tensor::new(vec![3, 2, 2], Data::U8((0..12).collect()));
    let flags = Tensor::new(vec![3], Data::Bool(vec![true, false, true]));
    let d = Dataset::new(vec![("imgs".into(), imgs), ("flags".into(), flags)]).unwrap();
    let b: Vec<_> = d.batches(2, &[2, 0, 1]).collect();
    assert_eq!(b.len(), 1);
    assert_eq!(b[0]["imgs"], Tensor::new(vec![2, 2, 2], Data::U8(vec![8, 9, 10, 11, 0, 1, 2, 3])));
    assert_eq!(b[0]["flags"], Tensor::new(vec![2], Data::Bool(vec![true, true])));
}

#[test]
#[should_panic(expected = "out of range")]
fn batches_reject_bad_indices() {
    let d = dataset(4);
    let _ = d.batches(2, &[0, 1, 2, 4]).count();
}

#[test]
fn shuffles_are_deterministic_permutations() {
    for n in [0, 1, 2, 10, 1000] {
        for epoch in 0..5 {
            let order = data::shuffled_order(n, 42, epoch);
            assert_eq!(order, data::shuffled_order(n, 42, epoch), "deterministic");
            let mut sorted = order.clone();
            sorted.sort_unstable();
            assert_eq!(sorted, (0..n).collect::<Vec<_>>(), "a permutation of 0..{n}");
        }
    }
    let a = data::shuffled_order(1000, 42, 0);
    assert_ne!(a, data::shuffled_order(1000, 42, 1), "epochs differ");
    assert_ne!(a, data::shuffled_order(1000, 43, 0), "seeds differ");
    assert_ne!(a, (0..1000).collect::<Vec<_>>(), "it shuffles");
    // Pinned: the same order on every machine and in every version (a change here changes runs).
    assert_eq!(data::shuffled_order(10, 0, 0), PINNED);
}

const PINNED: [usize; 10] = [2, 1, 4, 0, 3, 6, 5, 9, 8, 7];

#[test]
fn shuffle_is_roughly_uniform() {
    // Where element 0 lands over 4000 epochs of 4 elements: each place about 1000 times.
    let mut counts = [0usize; 4];
    for epoch in 0..4000 {
        let order = data::shuffled_order(4, 7, epoch);
        counts[order.iter().position(|&i| i == 0).unwrap()] += 1;
    }
    for c in counts {
        assert!((850..1150).contains(&c), "{counts:?}");
    }
}

// ---------------------------------------------------------------------------------------------
// Text feeds

/// A text file's bytes as tokens, in windows of `window` that overlap by one: every byte but
/// the first is the next token of exactly one example; the tail that fills no window is left.
#[test]
fn text_windows_overlap_by_one_token() {
    let dir = tempfile::tempdir().unwrap();
    let text = b"abcdefghij";
    for (name, bytes) in [("corpus.txt", text.to_vec()), ("corpus.txt.gz", gzip(text))] {
        let path = write(dir.path(), name, &bytes);
        let t = data::load_text_windows(&path, 4).unwrap();
        assert_eq!(t.shape.dims(), &[3, 4], "{name}");
        assert_eq!(t.as_slice::<u8>().unwrap(), b"abcddefgghij", "{name}");
    }
    let path = write(dir.path(), "short.txt", b"abc");
    let one = data::load_text_windows(&path, 3).unwrap();
    assert_eq!(one.as_slice::<u8>().unwrap(), b"abc");
}

#[test]
fn text_window_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "short.txt", b"abc");
    contains(&err(data::load_text_windows(&path, 4)), &["short.txt", "holds 3 bytes", "one example of 4 tokens"]);
    contains(&err(data::load_text_windows(&path, 1)), &["at least 2 tokens"]);
    let empty = write(dir.path(), "empty.txt", b"");
    contains(&err(data::load_text_windows(&empty, 2)), &["holds 0 bytes"]);
    contains(&err(data::load_text_windows(&dir.path().join("missing.txt"), 2)), &["cannot read", "missing.txt"]);
    // A gzip bomb: 64 MB of one byte.
    let bomb = gzip(&vec![b'a'; 64 << 20]);
    let path = write(dir.path(), "bomb.txt.gz", &bomb);
    contains(&err(data::load_text_windows(&path, 65)), &["bomb.txt.gz", "decompresses to more than 64 times"]);
}
