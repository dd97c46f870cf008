//! Hostile data files and checkpoints through `dfc run`: every one refused with exit status 1
//! and a one-line message naming the file and the problem, no panic, and under 2 GiB of memory
//! (the child's peak resident set from `wait4`, an upper bound: Linux counts in it the peak
//! of this process, whose memory a spawned child shares until it runs `dfc`) — deep npy headers, shapes that overflow,
//! truncated bodies, gzip bombs, ragged CSV, labels and ids out of range (on both backends,
//! on one device, on parameter servers in one process and on worker processes), damaged and
//! foreign checkpoints. Also the analysis behind the range checks (`dfc_driver::indices`) on
//! the examples compiled for several strategies.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use dfc_compile::{compile, CompileOptions, Strategy};
use dfc_driver::indices::{index_ranges, IndexRange};
use dfc_interp::{Data, Tensor};
use dfc_ir::{Cluster, DeviceKind};

/// The most memory a refused run may take.
const MAX_RSS: u64 = 2 << 30;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn scratch(name: &str) -> PathBuf {
    let dir = root().join("target").join("hostile-feeds-tests").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    dir
}

fn s(path: &Path) -> &str {
    path.to_str().expect("utf-8 path")
}

/// What a finished `dfc` process left: its exit code, its stderr and its peak resident set.
struct Finished {
    code: Option<i32>,
    stderr: String,
    max_rss: u64,
}

/// Runs `dfc args`, measuring the peak memory of the process.
// The child is reaped by `wait4` (for its rusage), which clippy does not see.
#[allow(clippy::zombie_processes)]
fn dfc(args: &[&str]) -> Finished {
    let mut child = Command::new(env!("CARGO_BIN_EXE_dfc"))
        .args(args)
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start dfc");
    let mut pipe = child.stderr.take().expect("piped");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = pipe.read_to_string(&mut text);
        text
    });
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: rusage is plain integers and timevals, for which all zeros is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: `pid` is this process's child, not yet reaped (`Child::wait` is never called on
    // it); `status` and `usage` are valid for writes for the duration of the call.
    let reaped = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    assert_eq!(reaped, pid, "wait4: {}", std::io::Error::last_os_error());
    let code = libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
    // ru_maxrss is in KiB on Linux.
    Finished { code, stderr: reader.join().expect("stderr"), max_rss: usage.ru_maxrss as u64 * 1024 }
}

fn compile_plan(example: &str, dir: &Path, name: &str, extra: &[&str]) -> PathBuf {
    let plan = dir.join(format!("{name}.plan"));
    let source = root().join("examples").join(format!("{example}.df"));
    let mut args = vec!["compile", s(&source), "-o", s(&plan)];
    args.extend_from_slice(extra);
    let done = dfc(&args);
    assert_eq!(done.code, Some(0), "{}", done.stderr);
    plan
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write");
    path
}

fn idx(type_byte: u8, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = vec![0, 0, type_byte, dims.len() as u8];
    for d in dims {
        out.extend_from_slice(&d.to_be_bytes());
    }
    out.extend_from_slice(data);
    out
}

fn npy(header: &str, data: &[u8]) -> Vec<u8> {
    let mut text = header.to_string();
    text.push('\n');
    let mut out = b"\x93NUMPY\x02\x00".to_vec();
    out.extend_from_slice(&(text.len() as u32).to_le_bytes());
    out.extend_from_slice(text.as_bytes());
    out.extend_from_slice(data);
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(bytes).expect("compress");
    encoder.finish().expect("compress")
}

/// A gzip file whose content is `head` then `chunk` written `times` times in a row: one gzip
/// member for `head`, then one member for the rest, repeated `repeats` times (gzip readers
/// join members), so that gigabytes of content take a few MB and a second to make, in little
/// memory: what this process holds when it starts `dfc` counts in the child's measured peak.
fn gzip_bomb(head: &[u8], chunk: &[u8], times: usize, repeats: usize) -> Vec<u8> {
    let mut out = gzip(head);
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    for _ in 0..times {
        encoder.write_all(chunk).expect("compress");
    }
    let member = encoder.finish().expect("compress");
    out.reserve(member.len() * repeats);
    for _ in 0..repeats {
        out.extend_from_slice(&member);
    }
    out
}

/// `dims` as the little-endian bytes of an i32 array.
fn i32s(values: &[i32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// One hostile case: `dfc run PLAN ARGS…` must fail with exit status 1 and a message holding
/// every one of `expected`.
struct Case {
    what: &'static str,
    args: Vec<String>,
    expected: Vec<String>,
}

fn check(cases: &[Case]) {
    let mut failures = Vec::new();
    for case in cases {
        let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
        let done = dfc(&args);
        let stderr = done.stderr.trim_end();
        let last = stderr.lines().last().unwrap_or("");
        let problems: Vec<String> = [
            (done.code != Some(1)).then(|| format!("exit status {:?}", done.code)),
            (!last.starts_with("error: ")).then(|| "no `error:` line last".to_string()),
            ["panicked", "RUST_BACKTRACE", "fatal runtime error", "stack overflow"]
                .iter()
                .find(|p| stderr.contains(*p))
                .map(|p| format!("`{p}` in the output")),
            case.expected.iter().find(|e| !last.contains(e.as_str())).map(|e| format!("no `{e}` in the message")),
            (done.max_rss >= MAX_RSS).then(|| format!("{} MiB of memory", done.max_rss >> 20)),
        ]
        .into_iter()
        .flatten()
        .collect();
        println!("{}: {} MiB: {last}", case.what, done.max_rss >> 20);
        if !problems.is_empty() {
            failures.push(format!("{}: {}\n  dfc {}\n  {stderr}", case.what, problems.join(", "), args.join(" ")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

fn case(what: &'static str, args: Vec<String>, expected: &[&str]) -> Case {
    Case { what, args, expected: expected.iter().map(|e| e.to_string()).collect() }
}

/// `run PLAN --feed images=IMAGES --feed labels=LABELS …`
fn mlp_run(plan: &Path, images: &Path, labels: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = vec![
        "run".to_string(),
        s(plan).into(),
        "--feed".into(),
        format!("images={}", s(images)),
        "--feed".into(),
        format!("labels={}", s(labels)),
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

#[test]
fn hostile_data_files_are_refused() {
    let dir = scratch("files");
    let plan = compile_plan("mlp", &dir, "mlp", &["--dim", "batch=4"]);
    let images = write(&dir, "images-idx3-ubyte", &idx(0x08, &[8, 28, 28], &[0; 8 * 784]));
    let labels = write(&dir, "labels-idx1-ubyte", &idx(0x08, &[8], &[1, 2, 3, 4, 5, 6, 7, 8]));
    // The good files train.
    let ok =
        dfc(&mlp_run(&plan, &images, &labels, &["--backend", "interp"]).iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(ok.code, Some(0), "{}", ok.stderr);

    let f = |name: &str, bytes: Vec<u8>| write(&dir, name, &bytes);
    let deep =
        f("deep.npy", npy(&format!("{{'descr': '<i4', 'fortran_order': False, 'shape': {}", "[".repeat(100_000)), &[]));
    let overflow = f(
        "overflow.npy",
        npy("{'descr': '<i4', 'fortran_order': False, 'shape': (1099511627776, 1099511627776, 1099511627776), }", &[]),
    );
    let short_npy =
        f("short.npy", npy("{'descr': '<i4', 'fortran_order': False, 'shape': (8,), }", &i32s(&[1, 2, 3, 4, 5])));
    let long_header = f("long-header.npy", {
        let mut bytes = b"\x93NUMPY\x02\x00".to_vec();
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        bytes
    });
    let idx_overflow = f("overflow-idx3-ubyte", idx(0x0E, &[u32::MAX, u32::MAX, u32::MAX], &[]));
    let idx_short = f("short-idx1-ubyte", idx(0x08, &[8], &[1, 2, 3, 4, 5]));
    let idx_huge_gz = f("huge-idx1-ubyte.gz", gzip(&idx(0x08, &[u32::MAX], &[1, 2, 3])));
    // 10 GB of zeros behind a header that declares 8 labels.
    let zeros = vec![0u8; 1 << 20];
    let bomb = f("bomb-idx1-ubyte.gz", gzip_bomb(&idx(0x08, &[8], &[]), &zeros, 100, 100));
    let npy_bomb = f(
        "bomb.npy.gz",
        gzip_bomb(&npy("{'descr': '<i4', 'fortran_order': False, 'shape': (8,), }", &[]), &zeros, 100, 100),
    );
    let cut_gz = f("cut-idx1-ubyte.gz", {
        let mut bytes = gzip(&idx(0x08, &[8], &[1; 8]));
        bytes.truncate(bytes.len() - 6);
        bytes
    });
    // 1 GB of `0\n` rows.
    let rows = "0\n".repeat(1 << 19);
    let csv_bomb = f("bomb.csv.gz", gzip_bomb(b"", rows.as_bytes(), 100, 10));
    let ragged = f("ragged.csv", b"1\n2\n3,4\n5\n6\n7\n8\n9\n".to_vec());
    let not_a_number = f("words.csv", b"1\n2\nx4\n5\n6\n7\n8\n9\n".to_vec());
    let binary = f("labels.bin", vec![0xff, 0xfe, 0x00, 0x80]);
    let labels_12 = f("labels-12-idx1-ubyte", idx(0x08, &[8], &[1, 2, 3, 4, 5, 12, 7, 8]));
    let labels_minus_1 = f(
        "labels-minus-1.npy",
        npy("{'descr': '<i4', 'fortran_order': False, 'shape': (8,), }", &i32s(&[1, 2, 3, -1, 5, 6, 7, 8])),
    );

    let interp = ["--backend", "interp"];
    let mut cases = vec![
        case(
            "deep npy header",
            mlp_run(&plan, &images, &deep, &interp),
            &["deep.npy", "bad npy header (brackets nested more than 32 deep)"],
        ),
        case(
            "npy shape overflow",
            mlp_run(&plan, &images, &overflow, &interp),
            &["overflow.npy", "too large: its size overflows"],
        ),
        case(
            "npy truncated body",
            mlp_run(&plan, &images, &short_npy, &interp),
            &["short.npy", "truncated npy data: '<i4' [8] needs 32 bytes, found 20"],
        ),
        case(
            "npy header length",
            mlp_run(&plan, &images, &long_header, &interp),
            &["long-header.npy", "npy header of 4294967295 bytes is longer than"],
        ),
        case(
            "IDX dims overflow",
            mlp_run(&plan, &idx_overflow, &labels, &interp),
            &["overflow-idx3-ubyte", "is too large: its size overflows"],
        ),
        case(
            "IDX truncated",
            mlp_run(&plan, &images, &idx_short, &interp),
            &["short-idx1-ubyte", "truncated IDX data: u8[8] needs 8 bytes, found 5"],
        ),
        case(
            "IDX gzip declaring more than it holds",
            mlp_run(&plan, &images, &idx_huge_gz, &interp),
            &["huge-idx1-ubyte.gz", "more than a gzip file of"],
        ),
        case(
            "IDX gzip bomb",
            mlp_run(&plan, &images, &bomb, &interp),
            &["bomb-idx1-ubyte.gz", "decompresses to more than the 16 bytes its header declares"],
        ),
        case(
            "npy gzip bomb",
            mlp_run(&plan, &images, &npy_bomb, &interp),
            &["bomb.npy.gz", "decompresses to more than the"],
        ),
        case(
            "gzip truncated",
            mlp_run(&plan, &images, &cut_gz, &interp),
            &["cut-idx1-ubyte.gz", "gzip data is corrupt or truncated"],
        ),
        case(
            "CSV gzip bomb",
            mlp_run(&plan, &images, &csv_bomb, &interp),
            &["bomb.csv.gz", "gzip data decompresses to more than", "gunzip it"],
        ),
        case(
            "ragged CSV",
            mlp_run(&plan, &images, &ragged, &interp),
            &["ragged.csv", "row 3 has 2 fields where the first row (row 1) has 1"],
        ),
        case("CSV word", mlp_run(&plan, &images, &not_a_number, &interp), &["words.csv:3:1", "`x4` is not a number"]),
        case("binary", mlp_run(&plan, &images, &binary, &interp), &["labels.bin", "unrecognised data format"]),
    ];
    for backend in ["interp", "llvm"] {
        let args = ["--backend", backend];
        let label = |file: &str, value: &str, example: &str| {
            vec![
                format!("input `labels` ({file}"),
                format!("example {example} has label {value}, outside [0, 10) of one_hot(labels, 10)"),
            ]
        };
        let mut twelve = case("label 12", mlp_run(&plan, &images, &labels_12, &args), &[]);
        twelve.expected = label(s(&labels_12), "12", "5");
        let mut minus = case("label -1", mlp_run(&plan, &images, &labels_minus_1, &args), &[]);
        minus.expected = label(s(&labels_minus_1), "-1", "3");
        cases.extend([twelve, minus]);
    }
    // As evaluation data, and for --fetch.
    let mut eval = mlp_run(&plan, &images, &labels, &interp);
    eval.extend([
        "--eval-feed".into(),
        format!("images={}", s(&images)),
        "--eval-feed".into(),
        format!("labels={}", s(&labels_12)),
    ]);
    cases.push(case("label 12 in --eval-feed", eval, &["input `labels`", "example 5 has label 12"]));
    let fetch = mlp_run(&plan, &images, &labels_12, &["--backend", "interp", "--fetch", "logits"]);
    cases.push(case("label 12 with --fetch", fetch, &["input `labels`", "example 5 has label 12"]));
    check(&cases);
}

/// wide_and_deep's user ids index a table of 200 rows, partitioned in 4 on parameter servers:
/// an id outside it is refused on one device, on parameter servers in one process and on
/// worker processes, synchronous or not.
#[test]
fn ids_outside_a_partitioned_table_are_refused_on_every_strategy() {
    let dir = scratch("ids");
    let cluster = write(
        &dir,
        "cluster.json",
        br#"{"cluster": {"worker": ["localhost:1", "localhost:2"], "ps": ["localhost:3", "localhost:4"]}}"#,
    );
    let dims = ["--dim", "batch=8", "--dim", "users=200"];
    let plans = [
        (
            "single device",
            compile_plan("wide_and_deep", &dir, "single", &[&dims[..], &["--soft-placement"]].concat()),
            vec![],
        ),
        (
            "mirrored on 2 devices",
            compile_plan(
                "wide_and_deep",
                &dir,
                "mirrored",
                &[&dims[..], &["--devices", "2", "--strategy", "mirrored", "--soft-placement"]].concat(),
            ),
            vec![],
        ),
        (
            "async ps",
            compile_plan(
                "wide_and_deep",
                &dir,
                "ps",
                &[&dims[..], &["--cluster", s(&cluster), "--strategy", "ps"]].concat(),
            ),
            vec![],
        ),
        (
            "sync ps",
            compile_plan(
                "wide_and_deep",
                &dir,
                "ps-sync",
                &[&dims[..], &["--cluster", s(&cluster), "--strategy", "ps", "--sync"]].concat(),
            ),
            vec![],
        ),
    ];
    let n = 16;
    let f32s = |count: usize| vec![0u8; count * 4];
    let dense =
        write(&dir, "dense.npy", &npy("{'descr': '<f4', 'fortran_order': False, 'shape': (16, 16), }", &f32s(n * 16)));
    let clicked =
        write(&dir, "clicked.npy", &npy("{'descr': '<f4', 'fortran_order': False, 'shape': (16,), }", &f32s(n)));
    let mut ids: Vec<i32> = (0..n as i32).map(|i| i * 12).collect();
    let good =
        write(&dir, "users.npy", &npy("{'descr': '<i4', 'fortran_order': False, 'shape': (16,), }", &i32s(&ids)));
    ids[11] = 200;
    let over =
        write(&dir, "users-200.npy", &npy("{'descr': '<i4', 'fortran_order': False, 'shape': (16,), }", &i32s(&ids)));
    ids[11] = -7;
    let under = write(
        &dir,
        "users-minus-7.npy",
        &npy("{'descr': '<i4', 'fortran_order': False, 'shape': (16,), }", &i32s(&ids)),
    );
    let run = |plan: &Path, users: &Path, extra: &[&str]| {
        let mut args = vec![
            "run".to_string(),
            s(plan).into(),
            "--backend".into(),
            "interp".into(),
            "--feed".into(),
            format!("user={}", s(users)),
            "--feed".into(),
            format!("dense_features={}", s(&dense)),
            "--feed".into(),
            format!("clicked={}", s(&clicked)),
        ];
        args.extend(extra.iter().map(|a| a.to_string()));
        args
    };
    let mut cases = Vec::new();
    for (what, plan, extra) in &plans {
        let extra: Vec<&str> = extra.to_vec();
        let ok = dfc(&run(plan, &good, &extra).iter().map(String::as_str).collect::<Vec<_>>());
        assert_eq!(ok.code, Some(0), "{what}: {}", ok.stderr);
        cases.push(case(
            what,
            run(plan, &over, &extra),
            &["input `user` (", "users-200.npy): example 11 has id 200, outside [0, 200) of gather(user_table, user)"],
        ));
        cases.push(case(
            what,
            run(plan, &under, &extra),
            &["users-minus-7.npy): example 11 has id -7, outside [0, 200)"],
        ));
    }
    // The driver reads the feeds, so worker processes are covered alike: 2 workers and 2 ps.
    let ps = &plans[2].1;
    cases.push(case(
        "async ps on 4 worker processes",
        run(ps, &over, &["--spawn", "4"]),
        &["users-200.npy): example 11 has id 200, outside [0, 200)"],
    ));
    cases.push(case(
        "sync ps on 4 worker processes, --fetch",
        run(&plans[3].1, &over, &["--spawn", "4", "--fetch", "probability"]),
        &["example 11 has id 200"],
    ));
    check(&cases);
}

/// Damaged and foreign checkpoints, found by `--checkpoint-dir`: refused naming the file and
/// the tensor, in one process and on worker processes.
#[test]
fn hostile_checkpoints_are_refused() {
    let dir = scratch("checkpoints");
    let plan = compile_plan("linear_regression", &dir, "linear", &[]);
    let x = write(
        &dir,
        "x.npy",
        &npy("{'descr': '<f4', 'fortran_order': False, 'shape': (64, 13), }", &vec![0; 64 * 13 * 4]),
    );
    let y = write(&dir, "y.npy", &npy("{'descr': '<f4', 'fortran_order': False, 'shape': (64,), }", &vec![0; 64 * 4]));
    let mut cases = Vec::new();
    let mut checkpoint_case = |what: &'static str, name: &str, bytes: Vec<u8>, extra: &[&str], expected: &[&str]| {
        let ckpt = dir.join(name);
        std::fs::create_dir_all(&ckpt).expect("dir");
        std::fs::write(ckpt.join("ckpt-00000001.safetensors"), bytes).expect("write");
        let mut args: Vec<String> = ["run", s(&plan), "--backend", "interp"].iter().map(|a| a.to_string()).collect();
        args.extend(["--feed".into(), format!("x={}", s(&x)), "--feed".into(), format!("y={}", s(&y))]);
        args.extend(["--checkpoint-dir".into(), s(&ckpt).into()]);
        args.extend(extra.iter().map(|a| a.to_string()));
        let mut expected: Vec<String> = expected.iter().map(|e| e.to_string()).collect();
        expected.push(format!("{name}/ckpt-00000001.safetensors"));
        cases.push(Case { what, args, expected });
    };
    let forged = |header: &str, data: usize| {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data, 0);
        bytes
    };
    let meta = r#""__metadata__":{"format":"dfc-checkpoint-1","step":"1","epoch":"0"}"#;
    let saved = |tensors: &[(&str, Tensor)]| {
        let scratch = tempfile::tempdir().expect("dir");
        let path =
            dfc_driver::checkpoint::save(scratch.path(), 1, 0, tensors.iter().map(|(n, t)| (*n, t))).expect("save");
        std::fs::read(path).expect("read")
    };
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    checkpoint_case("huge header length", "huge", huge, &[], &["header length 18446744073709551615 is more than"]);
    checkpoint_case(
        "offsets outside the file",
        "offsets",
        forged(&format!(r#"{{{meta},"w":{{"dtype":"F32","shape":[13],"data_offsets":[0,5200]}}}}"#), 52),
        &[],
        &["not a valid safetensors file"],
    );
    checkpoint_case(
        "shape overflow",
        "overflow",
        forged(
            &format!(
                r#"{{{meta},"w":{{"dtype":"F64","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}}}"#
            ),
            8,
        ),
        &[],
        &["overflow"],
    );
    checkpoint_case(
        "truncated",
        "truncated",
        saved(&[("w", Tensor::new(vec![13], Data::F32(vec![0.0; 13])))])[..60].to_vec(),
        &[],
        &["not a valid safetensors file"],
    );
    let wrong_shape = saved(&[
        ("w", Tensor::new(vec![12], Data::F32(vec![0.0; 12]))),
        ("b", Tensor::new(vec![], Data::F32(vec![0.0]))),
    ]);
    checkpoint_case(
        "wrong shape",
        "shape",
        wrong_shape.clone(),
        &[],
        &["holds `w` as f32[12], but the plan's variable is f32[13,1]"],
    );
    let missing = saved(&[("other", Tensor::new(vec![1], Data::F32(vec![0.0])))]);
    checkpoint_case("missing variable", "missing", missing.clone(), &[], &["has no variable `"]);
    checkpoint_case(
        "missing variable, --fetch",
        "missing-fetch",
        missing.clone(),
        &["--fetch", "prediction"],
        &["has no variable `"],
    );
    checkpoint_case(
        "wrong shape on worker processes",
        "shape-remote",
        wrong_shape,
        &["--spawn", "1"],
        &["holds `w` as f32[12]"],
    );
    check(&cases);
}

fn ranges(example: &str, cluster: Cluster, strategy: Strategy) -> Vec<(String, i64, i64, String)> {
    let source = std::fs::read_to_string(root().join("examples").join(format!("{example}.df"))).expect("example");
    let dims = match example {
        "wide_and_deep" => vec![("batch".to_string(), 16), ("users".to_string(), 200)],
        _ => vec![("batch".to_string(), 16)],
    };
    let options = CompileOptions {
        cluster,
        strategy,
        soft_placement: true,
        sema: dfc_sema::Options { dims, optimizer: None },
        ..CompileOptions::default()
    };
    let plan = compile(&source, &format!("{example}.df"), &options).expect("compiles").plan;
    index_ranges(&plan).into_iter().map(|r: IndexRange| (r.input, r.lo, r.hi, r.op)).collect()
}

fn ps_cluster() -> Cluster {
    Cluster::from_json(r#"{"cluster": {"worker": ["w0:1", "w1:1"], "ps": ["p0:1", "p1:1"]}}"#).expect("cluster")
}

#[test]
fn the_ranges_of_the_examples_inputs() {
    let one_hot = vec![("labels".to_string(), 0, 10, "one_hot(labels, 10)".to_string())];
    let lookup = vec![("user".to_string(), 0, 200, "gather(user_table, user)".to_string())];
    let local = |n| Cluster::local(n, DeviceKind::Cpu);
    assert_eq!(ranges("mlp", local(1), Strategy::Single), one_hot);
    assert_eq!(ranges("mlp", local(2), Strategy::Mirrored), one_hot);
    assert_eq!(ranges("mlp", local(2), Strategy::Model), one_hot);
    assert_eq!(ranges("mlp", ps_cluster(), Strategy::ParameterServer { sync: false }), one_hot);
    assert_eq!(ranges("wide_and_deep", local(1), Strategy::Single), lookup);
    assert_eq!(ranges("wide_and_deep", local(2), Strategy::Mirrored), lookup);
    assert_eq!(ranges("wide_and_deep", ps_cluster(), Strategy::ParameterServer { sync: false }), lookup);
    assert_eq!(ranges("wide_and_deep", ps_cluster(), Strategy::ParameterServer { sync: true }), lookup);
    assert_eq!(ranges("linear_regression", local(1), Strategy::Single), vec![]);
}

/// Shifts by constants move the range; a clamp written in the model lets every value through;
/// a partitioned table is checked whole, shifts and all.
#[test]
fn ranges_follow_shifts_and_stop_at_clamps() {
    let source = r#"
        model m {
            dim batch = 4
            input ids: i32[batch]
            input clamped: i32[batch]
            input labels: i32[batch]
            param table: f32[10, 3] = zeros
            @partitioned(2)
            param sharded: f32[30, 3] = zeros
            let a = gather(table, ids - 1)
            let b = gather(table, minimum(maximum(clamped, 0), 9))
            let c = gather(sharded, ids + 2)
            let loss = mean(softmax_cross_entropy(a + b + c, one_hot(labels + 2, 3)))
            minimize loss with sgd(lr = 0.1)
        }
    "#;
    let plan = compile(source, "m.df", &CompileOptions::default()).expect("compiles").plan;
    let mut found: Vec<(String, i64, i64, String)> =
        index_ranges(&plan).into_iter().map(|r| (r.input, r.lo, r.hi, r.op)).collect();
    found.sort();
    let expected = [
        ("ids", -2, 28, "gather(sharded, ids + 2)"),
        ("ids", 1, 11, "gather(table, ids - 1)"),
        ("labels", -2, 1, "one_hot(labels + 2, 3)"),
    ];
    let expected: Vec<(String, i64, i64, String)> =
        expected.iter().map(|(i, lo, hi, op)| (i.to_string(), *lo, *hi, op.to_string())).collect();
    assert_eq!(found, expected);
}
