//! NumPy `.npy` reading (every supported dtype, versions 1.0/2.0/3.0, gzip) and writing.

use std::io::Write;
use std::path::{Path, PathBuf};

use dfc_driver::data::{self, DataError};
use dfc_driver::npy;
use dfc_interp::{Data, Tensor};

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

fn hex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// A `.npy` file with the given header dict text (padded as NumPy pads) and data.
fn npy_file(major: u8, dict: &str, data: &[u8]) -> Vec<u8> {
    let prefix = if major == 1 { 10 } else { 12 };
    let mut header = dict.to_string();
    let padding = (64 - (prefix + header.len() + 1) % 64) % 64;
    header.push_str(&" ".repeat(padding));
    header.push('\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.extend_from_slice(&[major, 0]);
    if major == 1 {
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

fn dict(descr: &str, shape: &str) -> String {
    format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}")
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

/// Files written by NumPy 2.4 (`np.save`), byte for byte.
#[test]
fn reads_files_numpy_wrote() {
    let dir = tempfile::tempdir().unwrap();
    let header = |dict: &str| {
        // NumPy's header: the dict, spaces, a newline; 118 bytes for these.
        let mut h = dict.to_string();
        while h.len() < 117 {
            h.push(' ');
        }
        h + "\n"
    };
    // np.array([[1.5,-2.25,0.0],[1e-7,3.0,-0.5]], dtype='<f4')
    let f4 = hex(concat!(
        "934e554d5059010076007b276465736372273a20273c6634272c2027666f727472616e5f6f72646572273a2046616c",
        "73652c20277368617065273a2028322c2033292c207d20202020202020202020202020202020202020202020202020",
        "2020202020202020202020202020202020202020202020202020202020202020200a0000c03f000010c00000000095",
        "bfd63300004040000000bf",
    ));
    assert_eq!(&f4[10..128], header("{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }").as_bytes());
    let path = write(dir.path(), "f4.npy", &f4);
    assert_eq!(data::load(&path).unwrap(), Tensor::new(vec![2, 3], Data::F32(vec![1.5, -2.25, 0.0, 1e-7, 3.0, -0.5])));
    // np.array([-1, 0, 2**40], dtype='<i8')
    let i8 = hex(concat!(
        "934e554d5059010076007b276465736372273a20273c6938272c2027666f727472616e5f6f72646572273a2046616c",
        "73652c20277368617065273a2028332c292c207d202020202020202020202020202020202020202020202020202020",
        "2020202020202020202020202020202020202020202020202020202020202020200affffffffffffffff0000000000",
        "0000000000000000010000",
    ));
    let path = write(dir.path(), "i8.npy", &i8);
    assert_eq!(data::load(&path).unwrap(), Tensor::new(vec![3], Data::I64(vec![-1, 0, 1 << 40])));
    // np.array([True, False, True])
    let b1 = hex(concat!(
        "934e554d5059010076007b276465736372273a20277c6231272c2027666f727472616e5f6f72646572273a2046616c",
        "73652c20277368617065273a2028332c292c207d202020202020202020202020202020202020202020202020202020",
        "2020202020202020202020202020202020202020202020202020202020202020200a010001",
    ));
    let path = write(dir.path(), "b1.npy", &b1);
    assert_eq!(data::load(&path).unwrap(), Tensor::new(vec![3], Data::Bool(vec![true, false, true])));
    // np.lib.format.write_array(f, np.array([1.0, 2.0]), version=(3, 0))
    let v3 = hex(concat!(
        "934e554d50590300740000007b276465736372273a20273c6638272c2027666f727472616e5f6f72646572273a2046",
        "616c73652c20277368617065273a2028322c292c207d20202020202020202020202020202020202020202020202020",
        "2020202020202020202020202020202020202020202020202020202020202020200a000000000000f03f0000000000",
        "000040",
    ));
    let path = write(dir.path(), "v3.npy.gz", &gzip(&v3));
    assert_eq!(data::load(&path).unwrap(), Tensor::new(vec![2], Data::F64(vec![1.0, 2.0])));
}

#[test]
fn every_dtype_every_version_raw_and_gzip() {
    let dir = tempfile::tempdir().unwrap();
    let le = |v: &[i64], size: usize| -> Vec<u8> { v.iter().flat_map(|&x| x.to_le_bytes()[..size].to_vec()).collect() };
    let cases: Vec<(&str, Vec<u8>, Data)> = vec![
        (
            "<f4",
            [1.5f32, -2.0, 0.25, 8.0].iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::F32(vec![1.5, -2.0, 0.25, 8.0]),
        ),
        (
            "<f8",
            [1.5f64, -2.0, 1e-300, 8.0].iter().flat_map(|x| x.to_le_bytes()).collect(),
            Data::F64(vec![1.5, -2.0, 1e-300, 8.0]),
        ),
        ("<i4", le(&[i32::MIN.into(), -1, 0, i32::MAX.into()], 4), Data::I32(vec![i32::MIN, -1, 0, i32::MAX])),
        ("<i8", le(&[i64::MIN, -1, 0, i64::MAX], 8), Data::I64(vec![i64::MIN, -1, 0, i64::MAX])),
        ("|u1", vec![0, 1, 128, 255], Data::U8(vec![0, 1, 128, 255])),
        ("|b1", vec![0, 1, 1, 0], Data::Bool(vec![false, true, true, false])),
        ("|i1", le(&[-128, -1, 0, 127], 1), Data::I32(vec![-128, -1, 0, 127])),
        ("<i2", le(&[-32768, -1, 0, 32767], 2), Data::I32(vec![-32768, -1, 0, 32767])),
        ("<u2", le(&[0, 1, 32768, 65535], 2), Data::I32(vec![0, 1, 32768, 65535])),
        ("<u4", le(&[0, 1, 1 << 31, u32::MAX.into()], 4), Data::I64(vec![0, 1, 1 << 31, u32::MAX.into()])),
    ];
    for (descr, payload, expected) in cases {
        let expected = Tensor::new(vec![2, 2], expected);
        for major in [1, 2, 3] {
            let bytes = npy_file(major, &dict(descr, "(2, 2)"), &payload);
            let name = format!("{}-v{major}", descr.replace(['<', '|'], ""));
            let raw = write(dir.path(), &format!("{name}.npy"), &bytes);
            let gz = write(dir.path(), &format!("{name}.npy.gz"), &gzip(&bytes));
            let neutral = write(dir.path(), &format!("{name}.data"), &gzip(&bytes));
            for path in [&raw, &gz, &neutral] {
                assert_eq!(data::load(path).unwrap(), expected, "{}", path.display());
                assert_eq!(data::load_npy(path).unwrap(), expected, "{}", path.display());
            }
        }
    }
}

#[test]
fn header_variants() {
    let dir = tempfile::tempdir().unwrap();
    let payload: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let expected = Tensor::new(vec![3], Data::F32(vec![1.0, 2.0, 3.0]));
    // Keys in another order, double quotes, Python 2 longs, a rank-1 Fortran array (same layout).
    for header in [
        "{'shape': (3,), 'fortran_order': False, 'descr': '<f4'}",
        "{\"descr\": \"<f4\", \"fortran_order\": False, \"shape\": (3L,)}",
        "{'descr': '<f4', 'fortran_order': True, 'shape': (3,), }",
    ] {
        let path = write(dir.path(), "h.npy", &npy_file(1, header, &payload));
        assert_eq!(data::load(&path).unwrap(), expected, "{header}");
    }
    // Big-endian data.
    let be: Vec<u8> = [1.0f32, 2.0, 3.0].iter().flat_map(|x| x.to_be_bytes()).collect();
    let path = write(dir.path(), "be.npy", &npy_file(1, &dict(">f4", "(3,)"), &be));
    assert_eq!(data::load(&path).unwrap(), expected);
}

#[test]
fn errors() {
    let dir = tempfile::tempdir().unwrap();
    let f4: Vec<u8> = [1.0f32; 6].iter().flat_map(|x| x.to_le_bytes()).collect();

    // Unsupported dtypes name the dtype string.
    for descr in ["<f2", "<u8", "<c8", "<U5", "|O", "|u2"] {
        let path = write(dir.path(), "dt.npy", &npy_file(1, &dict(descr, "(1,)"), &[0; 16]));
        contains(&err(data::load(&path)), &["dt.npy", &format!("unsupported npy dtype '{descr}'"), "supported: <f4"]);
    }
    let structured = "{'descr': [('x', '<f4'), ('y', '<i4')], 'fortran_order': False, 'shape': (1,), }";
    let path = write(dir.path(), "rec.npy", &npy_file(1, structured, &[0; 8]));
    contains(&err(data::load(&path)), &["unsupported npy dtype [('x', '<f4'), ('y', '<i4')]", "structured"]);

    // Fortran order.
    let header = "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }";
    let path = write(dir.path(), "fortran.npy", &npy_file(1, header, &f4));
    contains(&err(data::load(&path)), &["fortran.npy", "shape [2,3] is in Fortran order", "only C order"]);

    // Truncated and overlong data, truncated header, bad magic, unknown version.
    let path = write(dir.path(), "short.npy", &npy_file(1, &dict("<f4", "(2, 3)"), &f4[..20]));
    contains(&err(data::load(&path)), &["short.npy", "truncated npy data", "[2,3] needs 24 bytes, found 20"]);
    let path = write(dir.path(), "long.npy", &npy_file(1, &dict("<f4", "(5,)"), &f4));
    contains(&err(data::load(&path)), &["4 bytes after the data"]);
    let full = npy_file(1, &dict("<f4", "(6,)"), &f4);
    let path = write(dir.path(), "cut.npy", &full[..40]);
    contains(&err(data::load(&path)), &["cut.npy", "truncated npy header: expected 128 bytes, found 40"]);
    let mut bad = full.clone();
    bad[1] = b'X';
    let path = write(dir.path(), "magic.npy", &bad);
    contains(&err(data::load(&path)), &["magic.npy", "bad npy magic [93 58 55 4d 50 59]"]);
    let mut v9 = full.clone();
    v9[6] = 9;
    let path = write(dir.path(), "v9.npy", &v9);
    contains(&err(data::load(&path)), &["unsupported npy format version 9.0"]);

    // Broken headers.
    for (header, why) in [
        ("{'descr': '<f4', 'shape': (6,)}", "no 'fortran_order'"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': 6}", "'shape' is not a tuple"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (6,)", "expected `,` or `}`"),
        ("['descr']", "not a dict"),
    ] {
        let path = write(dir.path(), "hdr.npy", &npy_file(1, header, &f4));
        contains(&err(data::load(&path)), &["bad npy header", why]);
    }

    // Hostile headers: deep nesting is an error (not a stack overflow), shown shortened; a
    // header longer than dfc reads, a shape whose size overflows, a gzip file whose header
    // declares more than it can hold, or that inflates past what its header declares.
    let deep = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {}", "[".repeat(100_000));
    let path = write(dir.path(), "deep.npy", &npy_file(2, &deep, &f4));
    let msg = err(data::load(&path));
    contains(&msg, &["deep.npy", "bad npy header (brackets nested more than 32 deep)", "…"]);
    assert!(msg.len() < 400, "the header is shortened in the message: {} bytes", msg.len());
    let ok_depth = format!(
        "{{'descr': '<f4', 'fortran_order': False, 'x': {}1{}, 'shape': (6,)}}",
        "[".repeat(31),
        "]".repeat(31)
    );
    let path = write(dir.path(), "nested.npy", &npy_file(1, &ok_depth, &f4));
    assert_eq!(data::load(&path).unwrap().shape.dims(), [6], "31 levels inside the dict are within the limit");
    let mut long = b"\x93NUMPY\x02\x00".to_vec();
    long.extend_from_slice(&u32::MAX.to_le_bytes());
    let path = write(dir.path(), "long-header.npy", &long);
    contains(&err(data::load(&path)), &["long-header.npy", "npy header of 4294967295 bytes is longer than"]);
    let huge = dict("<f8", "(4294967296, 4294967296, 4294967296)");
    let path = write(dir.path(), "overflow.npy", &npy_file(1, &huge, &f4));
    contains(&err(data::load(&path)), &["overflow.npy", "too large: its size overflows"]);
    let path = write(dir.path(), "big.npy.gz", &gzip(&npy_file(1, &dict("<f4", "(1000000000,)"), &f4)));
    contains(&err(data::load(&path)), &["big.npy.gz", "4000000000 bytes of data, more than a gzip file of"]);
    let mut bomb = npy_file(1, &dict("|u1", "(1000,)"), &[]);
    bomb.resize(bomb.len() + 50_000_000, 0);
    let path = write(dir.path(), "bomb.npy.gz", &gzip(&bomb));
    contains(&err(data::load(&path)), &["bomb.npy.gz", "decompresses to more than the 1128 bytes its header declares"]);

    // A 0-d array has no example axis (load_npy itself reads it).
    let path = write(dir.path(), "scalar.npy", &npy_file(1, &dict("<f4", "()"), &f4[..4]));
    contains(&err(data::load(&path)), &["scalar.npy", "no example axis"]);
    assert_eq!(data::load_npy(&path).unwrap(), Tensor::new(vec![], Data::F32(vec![1.0])));
}

#[test]
fn save_npy_round_trips_every_dtype() {
    let dir = tempfile::tempdir().unwrap();
    let tensors = [
        Tensor::new(vec![2, 3], Data::F32(vec![1.5, -2.0, 0.0, f32::MIN_POSITIVE, f32::MAX, -0.0])),
        Tensor::new(vec![3], Data::F64(vec![1e-300, -2.0, std::f64::consts::PI])),
        Tensor::new(vec![2, 1, 2], Data::I32(vec![i32::MIN, -1, 0, i32::MAX])),
        Tensor::new(vec![2], Data::I64(vec![i64::MIN, i64::MAX])),
        Tensor::new(vec![4], Data::U8(vec![0, 1, 254, 255])),
        Tensor::new(vec![3], Data::Bool(vec![true, false, true])),
        Tensor::new(vec![], Data::F32(vec![7.0])),
        Tensor::new(vec![0, 5], Data::F32(vec![])),
    ];
    for (i, t) in tensors.iter().enumerate() {
        let path = dir.path().join(format!("t{i}.npy"));
        npy::save_npy(&path, t).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(bytes, npy::to_npy_bytes(t));
        // Format 1.0, data aligned to 64 bytes, header ended by a newline.
        assert_eq!(&bytes[..8], b"\x93NUMPY\x01\x00");
        let header_len = u16::from_le_bytes([bytes[8], bytes[9]]) as usize;
        assert_eq!((10 + header_len) % 64, 0);
        assert_eq!(bytes[10 + header_len - 1], b'\n');
        assert_eq!(&data::load_npy(&path).unwrap(), t);
    }
    // The header NumPy expects, exactly.
    let bytes = npy::to_npy_bytes(&tensors[0]);
    let header = std::str::from_utf8(&bytes[10..128]).unwrap();
    assert_eq!(header.trim_end(), "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }");
    let bytes = npy::to_npy_bytes(&tensors[5]);
    assert!(bytes[10..].starts_with(b"{'descr': '|b1', 'fortran_order': False, 'shape': (3,), }"));
    let bytes = npy::to_npy_bytes(&tensors[6]);
    assert!(bytes[10..].starts_with(b"{'descr': '<f4', 'fortran_order': False, 'shape': (), }"));
}
