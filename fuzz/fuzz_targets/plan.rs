//! Fuzzes what a plan file reaches: the input is a plan file whose length and checksum fields
//! are made right before decoding (so that mutations reach the payload's content, as a crafted
//! file or a bit flipped before the checksum would). Decoding must not panic; a plan it accepts
//! must go through the summary `dfc inspect` prints and through a session on the reference
//! interpreter running one training step (or forward pass) on zero inputs, where any error is
//! fine and a panic is a failure.

#![no_main]

use dfc_driver::{Backend, Session};
use dfc_interp::Tensor;
use libfuzzer_sys::fuzz_target;
use std::collections::HashMap;

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.to_vec();
    if bytes.len() >= dfc_plan::HEADER_LEN {
        let payload = &bytes[dfc_plan::HEADER_LEN..];
        let (length, checksum) = (payload.len() as u64, crc32fast::hash(payload));
        bytes[12..20].copy_from_slice(&length.to_le_bytes());
        bytes[20..24].copy_from_slice(&checksum.to_le_bytes());
    }
    let Ok(plan) = dfc_plan::decode(&bytes) else { return };
    let summary = dfc_plan::summary(&plan);
    let _ = summary.to_string();

    // A plan whose tensors are large is valid but slow to run: the fuzzer looks for panics.
    let elements: usize = plan.partitions.iter().map(|p| p.module.graph.len()).sum();
    let largest = plan
        .partitions
        .iter()
        .flat_map(|p| p.module.graph.node_ids().flat_map(move |id| p.module.graph.node(id).outputs.clone()))
        .map(|ty| ty.shape.n_elements())
        .max()
        .unwrap_or(0);
    if elements > 2000 || largest > 1 << 20 {
        return;
    }
    let Ok(mut session) = Session::with_backend(&plan, 0, Backend::Interp) else { return };
    let (fetches, targets): (Vec<&str>, Vec<&str>) = match &plan.training {
        Some(t) => (vec![t.loss_node.as_str()], t.updates.iter().map(String::as_str).collect()),
        None => (plan.outputs.iter().map(|o| o.name.as_str()).collect(), Vec::new()),
    };
    let Ok(program) = session.program(&fetches, &targets) else { return };
    let feeds: HashMap<String, Tensor> =
        plan.inputs.iter().map(|input| (input.name.clone(), Tensor::zeros(&input.ty))).collect();
    let _ = session.run(&program, &feeds);
});
