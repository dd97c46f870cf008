//! The real Fashion-MNIST files, as Debian's `dataset-fashion-mnist` package installs them.
//! Without the package each test records a skip (`tests/support/skip.rs`) and passes, unless
//! `DFC_REQUIRE` lists `fashion-mnist` (CI installs the package and does).

use std::path::PathBuf;

#[path = "../../../tests/support/skip.rs"]
mod skip;

use dfc_driver::data::{self, Dataset};
use dfc_interp::Data;
use dfc_ir::{DType, TensorType};

/// Where Debian installs the files; `DFC_FASHION_MNIST_DIR` overrides it.
const DIR: &str = "/usr/share/datasets/fashion-mnist";

/// The files of one split, or `None` (with a skip recorded) if they are not installed.
fn split(name: &str) -> Option<(PathBuf, PathBuf)> {
    let dir = std::env::var_os("DFC_FASHION_MNIST_DIR").map_or_else(|| PathBuf::from(DIR), PathBuf::from);
    let images = dir.join(format!("{name}-images-idx3-ubyte.gz"));
    let labels = dir.join(format!("{name}-labels-idx1-ubyte.gz"));
    if images.is_file() && labels.is_file() {
        Some((images, labels))
    } else {
        let reason = format!(
            "Fashion-MNIST is not installed ({} or {} missing; apt-get install dataset-fashion-mnist)",
            images.display(),
            labels.display()
        );
        skip::skip(skip::Need::FashionMnist, &reason);
        None
    }
}

fn check(name: &str, n: usize) {
    let Some((images, labels)) = split(name) else { return };
    let images = data::load(&images).unwrap();
    let labels = data::load(&labels).unwrap();
    assert_eq!(images.ty(), TensorType::new(DType::U8, vec![n, 28, 28]));
    assert_eq!(labels.ty(), TensorType::new(DType::U8, vec![n]));

    let Data::U8(l) = &labels.data else { unreachable!() };
    let mut counts = [0usize; 10];
    for &label in l {
        assert!(label <= 9, "label {label}");
        counts[usize::from(label)] += 1;
    }
    // Fashion-MNIST is balanced: n/10 examples of each class.
    assert_eq!(counts, [n / 10; 10], "{counts:?}");
    let Data::U8(px) = &images.data else { unreachable!() };
    assert!(px.contains(&0) && px.contains(&255), "pixels span 0..=255");

    // Fitted to a model taking f32 images and i32 labels in batches of 128.
    let images = data::fit("images", images, &TensorType::new(DType::F32, vec![128, 28, 28])).unwrap();
    let labels = data::fit("labels", labels, &TensorType::new(DType::I32, vec![128])).unwrap();
    let dataset = Dataset::new(vec![("images".into(), images), ("labels".into(), labels)]).unwrap();
    assert_eq!(dataset.len(), n);
    let order = data::shuffled_order(n, 1, 0);
    let batches: Vec<_> = dataset.batches(128, &order).take(2).collect();
    assert_eq!(batches[0]["images"].ty(), TensorType::new(DType::F32, vec![128, 28, 28]));
    assert_eq!(batches[1]["labels"].ty(), TensorType::new(DType::I32, vec![128]));
    assert_eq!(dataset.batches(128, &order).count(), n / 128, "the remainder is dropped");

    // A 32×32 model does not take 28×28 images.
    let e = data::fit("images", dataset.get("images").unwrap().clone(), &TensorType::new(DType::F32, vec![64, 32, 32]));
    assert_eq!(
        e.unwrap_err().to_string(),
        "feed `images`: examples are f32[28,28] but the model's input `images` takes f32[32,32] per example (batch 64)"
    );
}

#[test]
fn train_split() {
    check("train", 60000);
}

#[test]
fn test_split() {
    check("t10k", 10000);
}
