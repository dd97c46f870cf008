//! The JSON-lines metrics log.

use std::collections::BTreeMap;

use dfc_driver::metrics::{BackupCounts, EpochRecord, MetricsLog};

fn record(epoch: u64) -> EpochRecord {
    EpochRecord {
        epoch,
        step: epoch * 468,
        train_loss: 0.5,
        learning_rate: Some(0.125),
        eval_loss: Some(0.25),
        eval_accuracy: Some(0.875),
        examples_per_sec: 1000.0,
        seconds: 2.5,
        metrics: BTreeMap::from([("top5".to_string(), 0.99), ("f1".to_string(), 0.8)]),
        all_reduces: 0,
        staleness: None,
        backup: None,
        workers: Vec::new(),
    }
}

#[test]
fn one_flushed_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("out/metrics.jsonl");
    let mut log = MetricsLog::create(&path).unwrap();
    log.write(&record(1)).unwrap();
    // Flushed: readable while the log is still open.
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(
        text,
        "{\"epoch\":1,\"step\":468,\"train_loss\":0.5,\"learning_rate\":0.125,\"eval_loss\":0.25,\"eval_accuracy\":0.875,\
         \"eval_f1\":0.8,\"eval_top5\":0.99,\"examples_per_sec\":1000.0,\"seconds\":2.5}\n"
    );
    // No evaluation: the eval keys are null; so is a diverged loss. All-reduces, where there
    // were some, come last.
    let plain = EpochRecord {
        epoch: 2,
        step: 936,
        train_loss: f64::NAN,
        examples_per_sec: 3.0,
        seconds: 1.0,
        all_reduces: 59,
        ..Default::default()
    };
    log.write(&plain).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(
        lines[1],
        "{\"epoch\":2,\"step\":936,\"train_loss\":null,\"learning_rate\":null,\"eval_loss\":null,\"eval_accuracy\":null,\"examples_per_sec\":3.0,\"seconds\":1.0,\"all_reduces\":59}"
    );
    for line in lines {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        assert!(value.is_object());
    }
    drop(log);

    // Append keeps what is there; create truncates.
    let mut log = MetricsLog::append(&path).unwrap();
    log.write(&record(3)).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 3);
    let mut log = MetricsLog::create(&path).unwrap();
    log.write(&record(4)).unwrap();
    assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 1);
}

#[test]
fn a_metric_may_not_shadow_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let mut log = MetricsLog::create(dir.path().join("m.jsonl")).unwrap();
    let mut r = record(1);
    r.metrics.insert("loss".into(), 1.0);
    let e = log.write(&r).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert!(e.to_string().contains("`eval_loss`"), "{e}");
    assert_eq!(std::fs::read_to_string(dir.path().join("m.jsonl")).unwrap(), "", "nothing half-written");
}

#[test]
fn backup_workers_write_their_updates_and_dropped_gradients() {
    let backup = Some(BackupCounts { updates: 40, dropped: 7 });
    let r = EpochRecord {
        epoch: 1,
        step: 50,
        train_loss: 0.5,
        examples_per_sec: 8.0,
        seconds: 2.0,
        backup,
        ..Default::default()
    };
    let line = r.to_json_line().unwrap();
    assert!(line.ends_with(",\"updates\":40,\"updates_per_sec\":20.0,\"gradients_dropped\":7}"), "{line}");
    let scalars = r.scalars();
    assert!(scalars.contains(&("updates_per_sec".to_string(), 20.0)), "{scalars:?}");
}
