//! Checkpoints: save/latest/load round trips, atomicity, pruning, damaged files.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use dfc_driver::checkpoint::{self, Checkpoint, CheckpointError};
use dfc_interp::{Data, Tensor};

fn variables() -> Vec<(String, Tensor)> {
    vec![
        ("dense/w".into(), Tensor::new(vec![2, 3], Data::F32(vec![1.5, -2.0, 0.0, 1e-7, f32::MAX, -0.5]))),
        ("dense/b".into(), Tensor::new(vec![3], Data::F64(vec![1e-300, -2.0, std::f64::consts::PI]))),
        ("counts".into(), Tensor::new(vec![2, 2], Data::I32(vec![i32::MIN, -1, 0, i32::MAX]))),
        ("global_step".into(), Tensor::new(vec![], Data::I64(vec![i64::MAX]))),
        ("bytes".into(), Tensor::new(vec![4], Data::U8(vec![0, 1, 254, 255]))),
        ("mask".into(), Tensor::new(vec![3], Data::Bool(vec![true, false, true]))),
        ("empty".into(), Tensor::new(vec![0, 4], Data::F32(vec![]))),
    ]
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    names
}

#[test]
fn save_latest_load_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let ckpts = dir.path().join("run/ckpts"); // created by save
    assert!(checkpoint::latest(&ckpts).unwrap().is_none(), "no directory: no checkpoint");

    let vars = variables();
    let path = checkpoint::save(&ckpts, 1234, 7, vars.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    assert_eq!(path, ckpts.join("ckpt-00001234.safetensors"));
    assert_eq!(names(&ckpts), ["ckpt-00001234.safetensors"], "no temporary file left behind");

    let expected = Checkpoint {
        path: path.clone(),
        step: 1234,
        epoch: 7,
        tensors: vars.iter().cloned().collect::<BTreeMap<_, _>>(),
    };
    assert_eq!(checkpoint::load(&path).unwrap(), expected);
    assert_eq!(checkpoint::latest(&ckpts).unwrap(), Some(expected));

    // Names can also be owned strings, from any iterator (a HashMap here).
    let map: HashMap<String, Tensor> = vars.into_iter().collect();
    let path = checkpoint::save(&ckpts, 1300, 8, map.iter().map(|(n, t)| (n.clone(), t))).unwrap();
    let latest = checkpoint::latest(&ckpts).unwrap().unwrap();
    assert_eq!((latest.path, latest.step, latest.epoch), (path, 1300, 8));
    assert_eq!(latest.tensors.len(), map.len());
    for (name, tensor) in &map {
        assert_eq!(&latest.tensors[name], tensor, "{name}");
    }
}

#[test]
fn metadata_is_readable_by_any_safetensors_reader() {
    let dir = tempfile::tempdir().unwrap();
    let vars = variables();
    let path = checkpoint::save(dir.path(), 5, 2, vars.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    let bytes = std::fs::read(path).unwrap();
    let (_, metadata) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
    let info = metadata.metadata().clone().unwrap();
    assert_eq!(info["format"], "dfc-checkpoint-1");
    assert_eq!(info["step"], "5");
    assert_eq!(info["epoch"], "2");
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let w = file.tensor("dense/w").unwrap();
    assert_eq!(w.dtype(), safetensors::Dtype::F32);
    assert_eq!(w.shape(), [2, 3]);
    assert_eq!(file.tensor("mask").unwrap().dtype(), safetensors::Dtype::BOOL);
}

#[test]
fn keeps_the_last_three() {
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::new(vec![1], Data::F32(vec![0.0]));
    for step in [100, 200, 300, 400, 500] {
        checkpoint::save(dir.path(), step, step / 100, [("w", &w)]).unwrap();
    }
    assert_eq!(
        names(dir.path()),
        ["ckpt-00000300.safetensors", "ckpt-00000400.safetensors", "ckpt-00000500.safetensors"]
    );
    let steps: Vec<u64> = checkpoint::list(dir.path()).unwrap().into_iter().map(|(s, _)| s).collect();
    assert_eq!(steps, [300, 400, 500]);
    // Steps past eight digits sort by number, not by name.
    checkpoint::save(dir.path(), 1_000_000_000, 9, [("w", &w)]).unwrap();
    assert_eq!(checkpoint::latest(dir.path()).unwrap().unwrap().step, 1_000_000_000);
    assert_eq!(
        names(dir.path()),
        ["ckpt-00000400.safetensors", "ckpt-00000500.safetensors", "ckpt-1000000000.safetensors"]
    );
    // An older step written later (a run resumed from an earlier checkpoint) is kept all the same.
    let path = checkpoint::save(dir.path(), 50, 0, [("w", &w)]).unwrap();
    assert!(path.exists());
}

#[test]
fn latest_ignores_other_files() {
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::new(vec![2], Data::F32(vec![1.0, 2.0]));
    checkpoint::save(dir.path(), 10, 1, [("w", &w)]).unwrap();
    // What a crash or a user may leave: temporary files, other names, a directory.
    for name in [
        ".ckpt-XYZ.tmp",
        "ckpt-00000099.safetensors.tmp",
        "ckpt-latest.safetensors",
        "ckpt-99.safetensors",
        "ckpt-0000009x.safetensors",
        "notes.txt",
    ] {
        std::fs::write(dir.path().join(name), b"garbage").unwrap();
    }
    std::fs::create_dir(dir.path().join("ckpt-00000098.safetensors")).unwrap();
    let latest = checkpoint::latest(dir.path()).unwrap().unwrap();
    assert_eq!(latest.step, 10);
    assert_eq!(latest.tensors["w"], w);
    // Pruning leaves them alone too.
    for step in [20, 30, 40] {
        checkpoint::save(dir.path(), step, 1, [("w", &w)]).unwrap();
    }
    assert!(dir.path().join("notes.txt").exists());
    assert!(dir.path().join(".ckpt-XYZ.tmp").exists());
    assert!(!dir.path().join("ckpt-00000010.safetensors").exists());
}

#[test]
fn a_failed_save_leaves_no_partial_file() {
    let dir = tempfile::tempdir().unwrap();
    let w = Tensor::new(vec![3], Data::F32(vec![1.0, 2.0, 3.0]));
    checkpoint::save(dir.path(), 1, 0, [("w", &w)]).unwrap();

    // The final rename fails: a non-empty directory holds the checkpoint's name.
    let blocker = dir.path().join("ckpt-00000002.safetensors");
    std::fs::create_dir(&blocker).unwrap();
    std::fs::write(blocker.join("x"), b"").unwrap();
    assert!(checkpoint::save(dir.path(), 2, 0, [("w", &w)]).is_err());
    assert_eq!(names(dir.path()), ["ckpt-00000001.safetensors", "ckpt-00000002.safetensors"], "no temporary file");
    assert_eq!(checkpoint::latest(dir.path()).unwrap().unwrap().step, 1, "the earlier checkpoint is intact");

    // Two variables of one name: refused before anything is written.
    let e = checkpoint::save(dir.path(), 3, 0, [("w", &w), ("w", &w)]).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("two variables are named `w`"), "{e}");
    assert_eq!(names(dir.path()), ["ckpt-00000001.safetensors", "ckpt-00000002.safetensors"]);

    // A directory that cannot be created.
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"").unwrap();
    assert!(checkpoint::save(&file.join("sub"), 1, 0, [("w", &w)]).is_err());
}

fn load_err(path: &Path) -> String {
    match checkpoint::load(path) {
        Ok(c) => panic!("expected an error, loaded step {}", c.step),
        Err(e) => e.to_string(),
    }
}

/// A checkpoint named on a command line may be anything: a device or a pipe is refused at once,
/// not read for ever.
#[test]
fn devices_and_fifos_are_not_checkpoints() {
    let msg = load_err(Path::new("/dev/zero"));
    assert!(msg.contains("/dev/zero") && msg.contains("not a regular file"), "{msg}");
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("ckpt-00000001.safetensors");
    assert!(std::process::Command::new("mkfifo").arg(&fifo).status().unwrap().success());
    let msg = load_err(&fifo);
    assert!(msg.contains("not a regular file"), "{msg}");
}

#[test]
fn damaged_and_foreign_files_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let vars = variables();
    let path = checkpoint::save(dir.path(), 7, 1, vars.iter().map(|(n, t)| (n.as_str(), t))).unwrap();
    let bytes = std::fs::read(&path).unwrap();

    // Hostile headers: a length past the file, offsets outside the data, a shape whose size
    // overflows, JSON nested past serde_json's limit.
    let mut huge = u64::MAX.to_le_bytes().to_vec();
    huge.extend_from_slice(b"{}");
    let path = dir.path().join("huge.safetensors");
    std::fs::write(&path, &huge).unwrap();
    let msg = load_err(&path);
    assert!(
        msg.contains("huge.safetensors") && msg.contains("header length 18446744073709551615 is more than"),
        "{msg}"
    );
    let forged = |name: &str, header: &str, data: usize| {
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.resize(bytes.len() + data, 0);
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).unwrap();
        load_err(&path)
    };
    let meta = r#""__metadata__":{"format":"dfc-checkpoint-1","step":"1","epoch":"0"}"#;
    let msg = forged(
        "offsets.safetensors",
        &format!(r#"{{{meta},"w":{{"dtype":"F32","shape":[2],"data_offsets":[0,800]}}}}"#),
        8,
    );
    assert!(msg.contains("offsets.safetensors") && msg.contains("not a valid safetensors file"), "{msg}");
    let msg = forged(
        "overflow.safetensors",
        &format!(r#"{{{meta},"w":{{"dtype":"F64","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]}}}}"#),
        8,
    );
    assert!(msg.contains("overflow.safetensors") && msg.contains("overflow"), "{msg}");
    let msg = forged("deep.safetensors", &format!("{}{}", "[".repeat(100_000), "]".repeat(100_000)), 0);
    assert!(msg.contains("deep.safetensors") && msg.contains("invalid JSON"), "{msg}");

    // Truncated at several places: always an error naming the file, never a panic.
    for cut in [0, 4, 8, 20, bytes.len() / 2, bytes.len() - 1] {
        let broken = dir.path().join(format!("cut-{cut}.safetensors"));
        std::fs::write(&broken, &bytes[..cut]).unwrap();
        let msg = load_err(&broken);
        assert!(
            msg.contains(&format!("cut-{cut}.safetensors")) && msg.contains("not a valid safetensors file"),
            "{msg}"
        );
    }

    // A safetensors file that is not a dfc checkpoint.
    let w = Tensor::new(vec![1], Data::F32(vec![0.0]));
    struct V<'a>(&'a Tensor);
    impl safetensors::View for V<'_> {
        fn dtype(&self) -> safetensors::Dtype {
            safetensors::Dtype::F32
        }
        fn shape(&self) -> &[usize] {
            self.0.shape.dims()
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            self.0.to_le_bytes().into()
        }
        fn data_len(&self) -> usize {
            4
        }
    }
    let foreign = dir.path().join("foreign.safetensors");
    std::fs::write(&foreign, safetensors::serialize([("w", V(&w))], None).unwrap()).unwrap();
    assert!(load_err(&foreign).contains("no `format` metadata"));
    let meta = HashMap::from([("format".to_string(), "other-2".to_string())]);
    std::fs::write(&foreign, safetensors::serialize([("w", V(&w))], Some(meta)).unwrap()).unwrap();
    assert!(load_err(&foreign).contains("format is `other-2`, expected `dfc-checkpoint-1`"));
    let meta = HashMap::from([
        ("format".to_string(), "dfc-checkpoint-1".to_string()),
        ("step".to_string(), "seven".to_string()),
        ("epoch".to_string(), "1".to_string()),
    ]);
    std::fs::write(&foreign, safetensors::serialize([("w", V(&w))], Some(meta)).unwrap()).unwrap();
    assert!(load_err(&foreign).contains("`step` metadata `seven` is not a number"));

    // An unsupported dtype names the tensor.
    struct Half;
    impl safetensors::View for Half {
        fn dtype(&self) -> safetensors::Dtype {
            safetensors::Dtype::F16
        }
        fn shape(&self) -> &[usize] {
            &[1]
        }
        fn data(&self) -> std::borrow::Cow<'_, [u8]> {
            vec![0, 0].into()
        }
        fn data_len(&self) -> usize {
            2
        }
    }
    let meta = HashMap::from([
        ("format".to_string(), "dfc-checkpoint-1".to_string()),
        ("step".to_string(), "1".to_string()),
        ("epoch".to_string(), "0".to_string()),
    ]);
    std::fs::write(&foreign, safetensors::serialize([("h", Half)], Some(meta)).unwrap()).unwrap();
    assert!(load_err(&foreign).contains("tensor `h` has dtype F16"));

    // A missing file.
    match checkpoint::load(&dir.path().join("missing.safetensors")) {
        Err(CheckpointError::Io { path, .. }) => assert!(path.ends_with("missing.safetensors")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn file_names() {
    assert_eq!(checkpoint::file_name(0), "ckpt-00000000.safetensors");
    assert_eq!(checkpoint::file_name(123_456_789), "ckpt-123456789.safetensors");
    assert_eq!(checkpoint::step_of("ckpt-00000042.safetensors"), Some(42));
    assert_eq!(checkpoint::step_of("ckpt-123456789.safetensors"), Some(123_456_789));
    assert_eq!(checkpoint::step_of("ckpt-42.safetensors"), None);
    assert_eq!(checkpoint::step_of("ckpt-00000042.safetensors.tmp"), None);
    assert_eq!(checkpoint::step_of(".ckpt-00000042.safetensors"), None);
    assert_eq!(checkpoint::step_of("ckpt-+0000042.safetensors"), None);
}
