//! Every reader against thousands of mutations of valid small files: bit flips, byte changes,
//! truncations, insertions, repeated chunks and header fields set to extreme values. Each must
//! return `Ok` or `Err`: never panic, overflow the stack or allocate what the bytes do not
//! justify, and take little time. The readers are called through their public byte entry
//! points, the ones a fuzzer would call: `data::load_bytes`, `data::parse_idx`,
//! `data::parse_csv`, `npy::parse` and `checkpoint::parse`.

use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use dfc_driver::{checkpoint, data, npy};
use dfc_interp::{Data, Tensor};
use dfc_ir::DType;
use rand_chacha::rand_core::{RngCore, SeedableRng};
use rand_chacha::ChaCha8Rng;

const MUTATIONS: usize = 2000;

/// The slowest any one parse of a small mutated file may be.
const SLOWEST: Duration = Duration::from_secs(2);

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    encoder.write_all(bytes).unwrap();
    encoder.finish().unwrap()
}

fn idx_file() -> Vec<u8> {
    let mut out = vec![0, 0, 0x08, 3, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 2];
    out.extend(0..12u8);
    out
}

fn csv_file() -> Vec<u8> {
    b"a,b,c\n1,2.5,-3\n4,5e3,6\n7,8,9\n".to_vec()
}

fn checkpoint_file() -> Vec<u8> {
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::new(vec![2, 3], Data::F32(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]));
    let step = Tensor::new(vec![], Data::I64(vec![7]));
    let path = checkpoint::save(dir.path(), 7, 1, [("w", &w), ("step", &step)]).unwrap();
    std::fs::read(path).unwrap()
}

/// The bytes of a file, mutated one way chosen by `rng`.
fn mutate(rng: &mut ChaCha8Rng, original: &[u8]) -> Vec<u8> {
    let mut bytes = original.to_vec();
    let below = |rng: &mut ChaCha8Rng, n: usize| (rng.next_u64() % n.max(1) as u64) as usize;
    // Mutations tend to hit headers: half of them within the first 64 bytes.
    let position = |rng: &mut ChaCha8Rng, len: usize| {
        if rng.next_u32() & 1 == 0 {
            below(rng, len.min(64))
        } else {
            below(rng, len)
        }
    };
    for _ in 0..1 + below(rng, 3) {
        let len = bytes.len();
        match below(rng, 8) {
            0 if len > 0 => {
                let at = position(rng, len);
                bytes[at] ^= 1 << below(rng, 8);
            }
            1 if len > 0 => {
                let at = position(rng, len);
                bytes[at] = [0x00, 0xff, 0x7f, 0x80, b'[', b'(', b'9', b','][below(rng, 8)];
            }
            2 => bytes.truncate(below(rng, len + 1)),
            3 => {
                let at = position(rng, len + 1);
                let inserted: Vec<u8> = (0..1 + below(rng, 16)).map(|_| rng.next_u32() as u8).collect();
                bytes.splice(at..at, inserted);
            }
            4 if len > 0 => {
                // A chunk repeated: runs of brackets, digits, rows.
                let at = position(rng, len);
                let end = (at + 1 + below(rng, 8)).min(len);
                let chunk = bytes[at..end].to_vec();
                let times = 1 + below(rng, 2000);
                let repeated: Vec<u8> = chunk.iter().copied().cycle().take(chunk.len() * times).collect();
                bytes.splice(at..at, repeated);
            }
            5 if len >= 4 => {
                // A 32- or 64-bit field set to an extreme value, either byte order.
                let at = position(rng, len - 3);
                let value: u64 = [u64::MAX, u64::MAX / 2, 1 << 32, 1 << 31, 0, 1][below(rng, 6)];
                let width = if at + 8 <= len && rng.next_u32() & 1 == 0 { 8 } else { 4 };
                let field = if rng.next_u32() & 1 == 0 { value.to_le_bytes() } else { value.to_be_bytes() };
                bytes[at..at + width].copy_from_slice(&field[..width]);
            }
            6 if len > 0 => {
                // Digits made long: a header's number grown past any size.
                let at = position(rng, len);
                let digits = vec![b'9'; 1 + below(rng, 40)];
                bytes.splice(at..at, digits);
            }
            _ => bytes.extend((0..1 + below(rng, 8)).map(|_| rng.next_u32() as u8)),
        }
    }
    bytes
}

/// Runs `parse` on `MUTATIONS` mutations of `original`; each must return, quickly. Returns how
/// many parsed without error (the unmutated file must).
fn survive<T, E: std::fmt::Display>(
    what: &str,
    original: &[u8],
    seed: u64,
    parse: impl Fn(&[u8]) -> Result<T, E>,
) -> usize {
    if let Err(e) = parse(original) {
        panic!("{what}: the unmutated file does not parse: {e}");
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut ok = 0;
    for i in 0..MUTATIONS {
        let bytes = mutate(&mut rng, original);
        let started = Instant::now();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| parse(&bytes)));
        let took = started.elapsed();
        match result {
            Ok(Ok(_)) => ok += 1,
            Ok(Err(e)) => {
                let message = e.to_string();
                assert!(!message.contains('\n'), "{what}, mutation {i}: a message of several lines: {message}");
            }
            Err(_) => panic!("{what}, mutation {i} (seed {seed}) panicked on {} bytes: {:02x?}", bytes.len(), bytes),
        }
        assert!(took < SLOWEST, "{what}, mutation {i}: took {took:?}");
    }
    ok
}

#[test]
fn idx_mutations() {
    let path = Path::new("m-idx3-ubyte");
    let raw = idx_file();
    survive("IDX", &raw, 1, |b| data::parse_idx(path, b));
    survive("IDX, gzip", &gzip(&raw), 2, |b| data::parse_idx(path, b));
    survive("IDX through load_bytes", &raw, 3, |b| data::load_bytes(path, b));
}

#[test]
fn npy_mutations() {
    let tensors = [
        Tensor::new(vec![2, 3], Data::F32(vec![1.0, -2.0, 3.5, 0.0, 5.0, 6.0])),
        Tensor::new(vec![4], Data::I64(vec![1, -2, 3, 1 << 40])),
        Tensor::new(vec![3], Data::Bool(vec![true, false, true])),
    ];
    for (i, tensor) in tensors.iter().enumerate() {
        let bytes = npy::to_npy_bytes(tensor);
        let path = Path::new("m.npy");
        let seed = 10 + i as u64;
        survive("npy", &bytes, seed, |b| npy::parse(path, b));
        survive("npy, gzip", &gzip(&bytes), seed + 100, |b| npy::parse(path, b));
        survive("npy through load_bytes", &bytes, seed + 200, |b| data::load_bytes(path, b));
    }
    // Versions 2.0 and 3.0: the header length is 32 bits.
    let mut v3 = npy::to_npy_bytes(&tensors[0]);
    let header_len = u16::from_le_bytes([v3[8], v3[9]]);
    v3[6] = 3;
    v3.splice(8..10, u32::from(header_len).to_le_bytes());
    survive("npy 3.0", &v3, 20, |b| npy::parse(Path::new("m3.npy"), b));
}

#[test]
fn csv_mutations() {
    let raw = csv_file();
    let files: [(DType, &[u8]); 4] = [
        (DType::F32, &raw),
        (DType::I64, b"x,y\n1,-2\n3,4\n"),
        (DType::U8, b"1\t2\n3\t4\n"),
        (DType::Bool, b"1,0\ntrue,false\n"),
    ];
    for (i, (dtype, file)) in files.into_iter().enumerate() {
        let path = Path::new(if dtype == DType::U8 { "m.tsv" } else { "m.csv" });
        survive(&format!("CSV as {dtype}"), file, 30 + i as u64, |b| data::parse_csv(path, b, dtype));
    }
    survive("CSV, gzip", &gzip(&raw), 40, |b| data::parse_csv(Path::new("m.csv.gz"), b, DType::F32));
    survive("CSV through load_bytes", &raw, 41, |b| data::load_bytes(Path::new("m.csv"), b));
    survive("unknown format through load_bytes", &raw, 42, |b| data::load_bytes(Path::new("m.bin"), b));
}

#[test]
fn checkpoint_mutations() {
    let bytes = checkpoint_file();
    let ok = survive("checkpoint", &bytes, 50, |b| checkpoint::parse(Path::new("ckpt-00000007.safetensors"), b));
    assert!(ok < MUTATIONS, "some mutations must be refused");
}
